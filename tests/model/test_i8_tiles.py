"""The 8-bit tiles (csrc/q4_gemv.c's i8_matmul_bf16, quant.py's I8Linear): Q5_0, Q5_1, Q8_0, Q5_K
and Q6_K weights as int8 codes with f32 scales, in the AVX512-BF16 build.

Blocks are made here (tests/model/test_qmm.py's random codes and scales written as the type's
bytes). Times the identity the tiles give gguf-py's dequantization bit for bit after the bf16
output rounding, the affine types too (d c rounds once in the FMA onto zero, then + m rounds
once: gguf-py's two roundings); a row's bits never depend on the rows or threads sharing the
call; the loader picks them for those types with AVX512-BF16, and only there."""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch

from radixserve.model import qmm
from radixserve.model.kernels import kernels
from radixserve.model.quant import I8_FORMATS, I8Linear, pack_i8
from tests.model.kernel_variants import variant, variant_kernels  # noqa: F401 (fixture)
from tests.model.test_qmm import random_blocks

Q = gguf.GGMLQuantizationType
TYPES = list(I8_FORMATS)
_gemma_reader = functools.cache(gguf.GGUFReader)  # ~11 s: its 262k-token vocabulary


def linear(t: Q, n: int = 48, k: int = 512, bias: torch.Tensor | None = None
           ) -> tuple[I8Linear, torch.Tensor]:
    raw = random_blocks(t, n, k, seed=int(t))
    ref = torch.from_numpy(gguf.quants.dequantize(raw, t).reshape(n, k).astype(np.float32))
    return I8Linear([(t, raw)], k, bias, variant_kernels("avx512bf16")), ref


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_identity_is_gguf_dequantization(t: Q) -> None:
    lin, ref = linear(t)
    want = ref.to(torch.bfloat16)
    got = lin(torch.eye(lin.n_in, dtype=torch.bfloat16)).t()
    assert torch.equal(got, want), f"{(got != want).sum().item()} weights differ"
    assert torch.equal(lin.weight(), want)
    # the codes and maps themselves: d c + m in f32 is gguf-py's weight, exactly
    c, d, m = qmm.codes(variant_kernels("avx512bf16").lib, int(t),
                        random_blocks(t, 48, 512, seed=int(t)), 512)
    w = c.astype(np.float32) * np.repeat(d, 16, axis=1) + np.repeat(m, 32, axis=1)
    assert np.array_equal(w, ref.numpy())


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_rows_invariant_and_close(t: Q) -> None:
    lin, ref = linear(t, bias=torch.randn(48).to(torch.bfloat16))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(140, lin.n_in, generator=g).to(torch.bfloat16)
    full = lin(x)
    # few rows (1-4: registers) and many (5+: each tile decoded once a block of rows)
    for size in (1, 3, 4, 7, 33):
        parts = torch.cat([lin(x[i:i + size].contiguous()) for i in range(0, 140, size)])
        assert torch.equal(parts, full), f"rows of {size} differ"
    torch.set_num_threads(1)
    try:
        assert torch.equal(lin(x), full), "1 thread differs"
    finally:
        torch.set_num_threads(2)
    xw = (x.double() @ ref.double().t()).float()
    want = xw + lin.bias.float()
    # exact products and f32 sums (within 2^-16 of the row's absolute sum), one bf16 rounding
    # of the product and one of the bias add (each half a bf16 step of its value)
    scale = (x.double().abs() @ ref.double().abs().t()).float()
    tol = (xw.abs() + want.abs()) * 2.0**-8 + scale * 2.0**-16
    assert ((full.float() - want).abs() <= tol).all()


def test_refuses_what_it_cannot_hold() -> None:
    lib = variant_kernels("avx512bf16").lib
    raw = random_blocks(Q.Q4_0, 16, 64)
    with pytest.raises(ValueError):
        qmm.codes(lib, int(Q.Q4_0), raw, 64)  # the 4-bit types have their own tiles
    c, d, m = qmm.codes(lib, int(Q.Q5_1), random_blocks(Q.Q5_1, 16, 64), 64)
    assert m.any()
    with pytest.raises(ValueError):
        pack_i8(c, d, m, 1)  # a format without offsets
    c, d, m = qmm.codes(lib, int(Q.Q6_K), random_blocks(Q.Q6_K, 16, 256), 256)
    with pytest.raises(ValueError):
        pack_i8(c, d, m, 1)  # Q6_K's two scales a group in a one-scale format
    kern = variant_kernels("avx512bf16")
    tiles = pack_i8(*qmm.codes(lib, int(Q.Q8_0), random_blocks(Q.Q8_0, 16, 64), 64), 1)
    with pytest.raises(ValueError):
        kern.i8(tiles, 2, 16, 64)  # the wrong format's block size
    mat = kern.i8(tiles, 1, 16, 64)
    with pytest.raises(ValueError):
        mat.matmul(torch.zeros(2, 32, dtype=torch.bfloat16))


def test_types_of_one_format_share_a_matrix() -> None:
    """Q5_0 rows above Q8_0 rows (Gemma 3's q/k and v) in one matrix: each row's bits are
    those of its own type's matrix; a Q6_K part (two scales a group) is refused beside them."""
    kern = variant_kernels("avx512bf16")
    a, b = random_blocks(Q.Q5_0, 32, 512, seed=5), random_blocks(Q.Q8_0, 16, 512, seed=8)
    both = I8Linear([(Q.Q5_0, a), (Q.Q8_0, b)], 512, None, kern)
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    want = torch.cat([I8Linear([(Q.Q5_0, a)], 512, None, kern)(x),
                      I8Linear([(Q.Q8_0, b)], 512, None, kern)(x)], dim=1)
    assert both.n_out == 48 and torch.equal(both(x), want)
    with pytest.raises(ValueError, match="tile format"):
        I8Linear([(Q.Q5_0, a), (Q.Q6_K, random_blocks(Q.Q6_K, 16, 512))], 512, None, kern)


@pytest.mark.parametrize("variant", ["avx512bf16", "avx2"], indirect=True)
def test_loader_runs_them_packed_only_with_avx512bf16(variant: str) -> None:
    """Gemma 3's Q4_K_M mixes Q4_K, Q5_0, Q6_K and Q8_0 (its layer 0: Q5_0 q/k, Q8_0 v, Q6_K
    down): with AVX512-BF16 none of its layer matrices is dense; elsewhere the 5-8-bit ones run
    qmm.c on the file's blocks."""
    from radixserve.model.default_model import gemma3_model_path
    from radixserve.model.quant import ConcatLinear, DenseLinear, QuantLinear
    from radixserve.model.weights import _Loader

    reader = _gemma_reader(gemma3_model_path())
    load = _Loader(reader, torch.bfloat16, packed=True)
    names = [f"blk.0.{n}.weight" for n in ("attn_q", "attn_k", "attn_v", "ffn_down")]
    types = {reader_t.tensor_type for reader_t in reader.tensors if reader_t.name in names}
    assert {Q.Q5_0, Q.Q8_0, Q.Q6_K} <= types
    parts = []
    for lin in (load.linear(names[:3], [None] * 3), load.linear(names[3:], [None])):
        parts += lin.parts if isinstance(lin, ConcatLinear) else [lin]
    assert not any(isinstance(p, DenseLinear) for p in parts)
    want = I8Linear if kernels().has_q4 else QuantLinear
    assert all(type(p) is want for p in parts), [type(p) for p in parts]
    # 8-bit tiles: q/k (Q5_0) and v (Q8_0) share a tile format, so one matrix, one call
    assert len(parts) == (2 if want is I8Linear else 3)
