"""Every C entry point of the kernels (csrc/*.c) and its signature, bound in one place, and the
check of each buffer handed to C.

Why one table: the bindings lived in four modules (kernels.py, qmm.py, head.py and the step),
each declaring its own argument types; a prototype changed in C and missed in one of them
would pass ints where C reads pointers. tests/model/test_cabi.py reads every exported function
of csrc/*.c and checks it against this table, argument by argument, both ways.

ctypes passes raw pointers: C trusts every size it is given. So a buffer goes to C through
`buf`, which checks its dtype, layout and element count against what the call will touch
(a ValueError here, never a read past the end there), except where a holder checked it once
at bind time (a matrix's tiles, the pool's K/V) and keeps it.
"""

from __future__ import annotations

import ctypes
import functools
from types import SimpleNamespace

import torch

P, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SEQS = [I32, P, P, P, P]  # n_seq, cells, c0, len, n_new
_ATTN = [I32, I32, I32, F32, P, P, P, I64]  # n_kv, g, d, scale, sinks, out, work, work_floats
_KV = [I32, I32, I64, I64]  # K and V cache types (kv_types.py), K and V head strides in bytes
# name -> (return type, argument types), in csrc's prototypes' order
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    # decode_attn.c
    "attn_work_floats": (I64, [I64, I64, I32, I32, I32]),
    "attn_causal_win_bf16": (I32, [P, P, P, *_KV, *_SEQS, P, I64, *_ATTN]),
    "attn_step_win_bf16": (I32, [P, P, P, P, P, *_KV, P, *_SEQS, P, I64, P, P, F32, *_ATTN]),
    "attn_head_norm_bf16": (I32, [P, I64, I64, I32, I32, P, F32, P]),
    # kv_rows.c
    "kv_store_row": (None, [I32, P, I32, P]),
    "kv_store_rows_bf16": (I32, [I32, P, I64, I32, P]),
    # rowwise.c
    "add_rms_norm_bf16": (None, [P, I64, P, P, I64, I32, F32, P]),
    "silu_mul_bf16": (None, [P, I64, I64, P]),
    "post_norm_add_bf16": (None, [P, I64, P, P, P, I64, I32, F32, P]),
    "gelu_mul_bf16": (None, [P, I64, I64, P]),
    "swiglu_oai_bf16": (None, [P, I64, I64, P]),
    # short_conv.c
    "short_conv_bf16": (None, [P, I64, I32, I32, P, P, P, P, P, P]),
    # delta_net.c
    "gdn_step_bf16": (None, [P, I64, I64, P, P, P, P, P, I64, P, I32, P, P, P, I32, I32, I32,
                             I32, F32, P, P]),
    # mamba2.c
    "mamba2_step_bf16": (None, [P, I64, I64, P, P, P, P, P, I64, P, P, I32, P, P, P, P, I32,
                                I32, I32, I32, F32, P, P]),
    # int8_head.c
    "int8_head_available": (I32, []),
    "int8_head": (I32, [P, P, P, P, P, I64, I64, I32, P]),
    "int8_head_bound": (I32, [P, P, P, P, P, P, P, I64, I64, I32, P, P, F32, F32, P, P, P]),
    "head_candidates": (I64, [P, I64, F32, P, P]),
    # f32_head.c
    "f32_head_dot": (F32, [P, P, I64]),
    "f32_head_dots": (I32, [P, I64, I64, P, I64, P, I64, P]),
    # i8act.c
    "i8a_matmul": (I32, [I32, P, P, I64, I64, I64, P]),
    "i8a_matmul_rows": (I32, [I32, I64, I64, P, P, P, I64, I64, I64, P]),
    # bf16_gemm.c
    "bf16_gemm_available": (I32, []),
    "bf16_matmul": (I32, [P, P, I64, I64, I64, P]),
    # qmm.c
    "qmm_block": (I64, [I32, ctypes.POINTER(I64)]),
    "qmm_bf16": (I32, [I32, P, I64, P, I64, I64, I64, P]),
    "qmm_codes": (I32, [I32, P, I64, I64, I64, P, P, P]),
    "qmm_rows_f32": (I32, [I32, P, I64, I64, I64, P, I64, P]),
    "qmm_head_dots": (I32, [I32, P, I64, I64, I64, P, I64, P, I64, P]),
}


@functools.cache
def bind(lib: ctypes.CDLL) -> SimpleNamespace:
    """`lib`'s entry points with their signatures set, as attributes by name (once per
    library)."""
    fns = {}
    for name, (res, args) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
        fns[name] = fn
    return SimpleNamespace(**fns)


def buf(t: torch.Tensor | None, dtype: torch.dtype, numel: int, what: str,
        at_least: bool = False) -> int | None:
    """t's data pointer for a C call that reads or writes `numel` elements of `dtype` there
    (at least that many with `at_least`: a scratch buffer); None for None. Raises ValueError
    naming `what` for another dtype, a non-contiguous tensor or another size."""
    if t is None:
        return None
    n = t.numel()
    if not (t.dtype == dtype and t.is_contiguous() and (n >= numel if at_least else n == numel)):
        raise ValueError(f"{what}: C needs contiguous {dtype} of {'>= ' if at_least else ''}"
                         f"{numel} elements, got {t.dtype} {list(t.shape)}"
                         f"{'' if t.is_contiguous() else ' (not contiguous)'}")
    return t.data_ptr()
