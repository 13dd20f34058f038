"""Our kernels (model/csrc/*.c) called from Python: the `Kernels` object binds one build's
shared object (kernel_build.py compiles and caches it) and checks every call's buffers before C
sees them. Which build, and whether indices are range-checked, is settled once at start-up
(kernel_config.py's KernelConfig) and handed down: the loader passes the `Kernels` object (or
None: torch's ops) to the weights, the head and the Transformer.

Calls go through ctypes with raw pointers into torch tensors, every entry point bound by
cabi.py's one table; the caller guarantees dtype, layout and bounds (checked here once per call,
cheaply, or once where a holder binds a matrix or the pool: kernel_matrix.py), and the kernel's
OpenMP calls resolve to the libgomp torch has loaded, so both share one thread pool.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from radixserve.memory.pool.kv_types import TYPES, KVType
from radixserve.model import kernel_build
from radixserve.model.cabi import bind
from radixserve.model.kernel_build import _PREFIX, VARIANTS, KernelsError
from radixserve.model.kernel_matrix import (
    BF16_PANEL,
    FILE_BLOCKS,
    TILE_BLOCK_BYTES,
    Bf16Matrix,
    FileRowsMatrix,
    TileMatrix,
)

ATTN_BLOCK = 256  # positions a block of decode_attn.c's attention (its BLOCK)


def _cells_arg(cells: slice | torch.Tensor, n_cells: int,
               checks: bool) -> tuple[int | None, int, int]:
    """A sequence's cells as the kernels take them: (index pointer or None, first cell, count);
    an index tensor's entries must lie in the pool (checked when `checks`, the kernels' check
    mode: decode_attn.c reads kh + cells[j] d unchecked)."""
    if isinstance(cells, slice):
        c0 = cells.start or 0
        n = (n_cells if cells.stop is None else cells.stop) - c0
        if c0 < 0 or n <= 0 or c0 + n > n_cells:
            raise IndexError(f"cells {cells} outside a pool of {n_cells}")
        return None, c0, n
    if cells.dtype != torch.int64 or not cells.is_contiguous() or cells.numel() == 0:
        raise ValueError("cell index must be a non-empty contiguous int64 tensor")
    if checks:
        check_cells(cells, n_cells)
    return cells.data_ptr(), 0, cells.numel()


def check_cells(cells: slice | torch.Tensor, n_cells: int) -> None:
    """IndexError unless an index tensor's entries lie in a pool of `n_cells` (a run is checked
    by _cells_arg always): the check mode's pass over an index, before a kernel reads through
    it."""
    if isinstance(cells, torch.Tensor) and cells.numel() and not (
            0 <= int(cells.min()) and int(cells.max()) < n_cells):
        raise IndexError(f"cell index outside a pool of {n_cells} cells "
                         f"({int(cells.min())}..{int(cells.max())})")


KVTypes = tuple[KVType, KVType]


def pool_args(k: torch.Tensor, v: torch.Tensor, n_head: int, d: int,
              types: KVTypes | None) -> tuple[int, ...]:
    """(n_kv, n_cells, g, kt code, vt code, K head stride in bytes, V head stride in bytes) of
    pool K/V [..., n_kv, n_cells, width] (one layer or all) holding
    rows of head size d in the cache types `types` (None: bf16, the compute dtype); ValueError
    unless the tensors are what those types store, contiguous."""
    kt, vt = types or (TYPES["bf16"], TYPES["bf16"])
    n_kv, n_cells = k.shape[-3:-1]
    if not (k.dtype == kt.storage and v.dtype == vt.storage and k.shape[-1] == kt.width(d)
            and v.shape[-1] == vt.width(d) and k.shape[:-1] == v.shape[:-1]
            and k.is_contiguous() and v.is_contiguous() and n_head % n_kv == 0
            and d % 2 == 0 and d % kt.block == 0 and d % vt.block == 0):
        raise ValueError(f"attention needs {kt.name}/{vt.name} K/V rows of head size {d} "
                         f"in the pool's layout")
    return (n_kv, n_cells, n_head // n_kv, kt.code, vt.code,
            k.stride(-3) * k.element_size(), v.stride(-3) * v.element_size())



def _check_state_step(name: str, proj: torch.Tensor, width: int, k: torch.Tensor,
                      v: torch.Tensor, w: int, n_new: torch.Tensor, read: torch.Tensor,
                      write: torch.Tensor, weights: str) -> list[int]:
    """A recurrent step's buffers and plan (gdn_step's, mamba2_step's), checked before C trusts
    them: contiguous bf16 proj [T, width], f32 state stores k, v [n_cells, w], int64 n_new,
    read, write [S]; each sequence's token count (>= 1, summing to T), the cell it reads (-1:
    none) and the one it writes, inside the pool, each write cell its own and no read cell.
    `weights` describes the kernel's weights in the refusal. Returns n_new."""
    rows = proj.shape[0] if proj.dim() == 2 else 0
    ok = (proj.dtype == torch.bfloat16 and proj.dim() == 2 and proj.shape[1] == width
          and rows > 0 and k.dtype == v.dtype == torch.float32 and k.dim() == 2
          and k.shape == v.shape and k.shape[1] == w and k.shape[0] > 0
          and n_new.dtype == read.dtype == write.dtype == torch.int64
          and n_new.dim() == 1 and n_new.numel() > 0
          and read.shape == write.shape == n_new.shape
          and all(t.is_contiguous() for t in (proj, k, v, n_new, read, write)))
    if not ok:
        raise ValueError(f"{name} needs contiguous bf16 proj [T, {width}], f32 states k, v "
                         f"[n_cells, {w}], {weights} and int64 n_new, read, write [S]")
    n_cells = k.shape[0]
    ns, rd, wr = n_new.tolist(), read.tolist(), write.tolist()
    if min(ns) < 1 or sum(ns) != rows:
        raise ValueError(f"{name}: n_new {ns} must be >= 1 each and sum to T = {rows}")
    if not all(-1 <= r < n_cells for r in rd) or not all(0 <= c < n_cells for c in wr):
        raise IndexError(f"{name}: cells outside a pool of {n_cells} (read {rd}, write {wr})")
    if len(set(wr)) != len(wr) or set(wr) & set(rd):
        raise ValueError(f"{name}: each write cell must be its own, no read cell (read {rd}, "
                         f"write {wr})")
    return ns


class Kernels:
    """The bf16 kernels (csrc/): the tiles' products with 8-bit activations, the row-invariant
    bf16 matmul, causal attention reading K/V in place from the pool in fixed blocks (alone, or fused
    with RoPE and the K/V store for a whole step of decode tokens and prefill chunks),
    the residual add fused with RMSNorm-to-bf16, the SiLU gate, the head's int8 pass and its
    exact f32 dot products.
    Pointers go to C unchecked, so every entry point checks dtype and layout first (cheaply, or
    once per step). `variant` names the build's flags (VARIANTS), `build_key` the whole build
    (the variant, sources, compiler, flags): the bits these kernels compute depend on it, so
    KV kept across processes is keyed by it (Model.identity). `lib` is the shared object, for
    the callers that hold matrices or steps of their own (their entry points: cabi.bind).
    `checks`: the check mode (RADIXSERVE_KERNEL_CHECKS=1): every index a kernel reads through
    is range-checked before the call (a pass over it: the test suite runs so, a server need
    not; the sizes a kernel trusts are checked either way, once, where the matrix, pool or
    head is bound)."""

    def __init__(self, lib: ctypes.CDLL, build_key: str = "", variant: str = "",
                 checks: bool = False) -> None:
        self.lib, self.build_key, self.variant, self.checks = lib, build_key, variant, checks
        c = bind(lib)
        self._attn, self._work_floats = c.attn_causal_win_bf16, c.attn_work_floats
        self._norm, self._silu = c.add_rms_norm_bf16, c.silu_mul_bf16
        self._swiglu_oai = c.swiglu_oai_bf16
        self._int8_head, self._dots = c.int8_head, c.f32_head_dots
        self._tiles = c.i8a_matmul  # the 4- and 8-bit tiles' products, 8-bit activations
        self._file_rows = c.i8a_matmul_rows  # the same from a file's Q8_0 / MXFP4 rows
        self._bf16_mm = c.bf16_matmul
        self._short_conv = c.short_conv_bf16
        self._gdn = c.gdn_step_bf16
        self._mamba2 = c.mamba2_step_bf16
        self.has_int8_head = bool(c.int8_head_available())  # every build (VNNI, AVX2, NEON, C)
        self.has_bf16_gemm = bool(c.bf16_gemm_available())  # needs AVX512-BF16
        self._work = torch.empty(0)
        # the recurrent steps' conv outputs (gdn_step's, mamba2_step's), grown to fit a call
        self._state_work = torch.empty(0)

    def _scratch(self, longest: int, n_tok: int, n_kv: int, g: int, d: int) -> torch.Tensor:
        """The attention scratch, grown (never shrunk) to fit a call: it is sized by the
        longest cell list, the query count and the thread count."""
        need = self._work_floats(longest, n_tok, n_kv, g, d)
        if self._work.numel() < need:
            self._work = torch.empty(need, dtype=torch.float32)
        return self._work

    def _work_for(self, floats: int) -> torch.Tensor:
        """The recurrent steps' f32 scratch, grown (never shrunk) to `floats`."""
        if self._state_work.numel() < floats:
            self._state_work = torch.empty(floats, dtype=torch.float32)
        return self._state_work

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cells: slice | torch.Tensor) -> torch.Tensor:
        """q [1, n_head, d]; k, v one layer of the pool [n_head_kv, n_cells, d]; cells the
        sequence's cells in position order (a run or an int64 index) -> [1, n_head * d].
        attend_causal for a single query, which sees every cell."""
        return self.attend_causal(q, k, v, cells)

    def attend_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cells: slice | torch.Tensor, *, window: int = 0,
                      pos0: int = 0, types: KVTypes | None = None,
                      scale: float | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [n, n_head, d] rotated queries of a sequence's last n cells, whose K/V are already
        in k, v (one layer of the pool [n_head_kv, n_cells, d]); cells the sequence's cells in
        position order (a run or an int64 index), entry j at position pos0 + j; query i (at
        position p = pos0 + len - n + i) sees the entries at positions k <= p, and with
        window > 0 only those with p - window < k -> [n, n_head * d]. Bitwise the same whatever
        n is and however many older entries precede a query's window (decode_attn.c's blocks,
        aligned to absolute positions). `types`: the pool's cache types (None: bf16 rows);
        `scale`: q.k's (None: 1 / sqrt(d)); `sinks`: f32 [n_head], a logit a head that joins
        its softmax and adds no value (gpt-oss; None: none)."""
        d = q.shape[-1]
        n_kv, n_cells, g, kt, vt, k_hs, v_hs = pool_args(k, v, q.shape[1], d, types)
        idx, c0, length = _cells_arg(cells, n_cells, self.checks)
        n = q.shape[0]
        if not (q.dtype == torch.bfloat16 and q.is_contiguous() and q.dim() == 3
                and q.shape[2] == d and 1 <= n <= length):
            raise ValueError("attention needs contiguous bf16 queries [n <= cells, n_head, d]")
        if not (0 <= window < 2**62 and 0 <= pos0 < 2**62):
            raise ValueError(f"attention needs window >= 0 and pos0 >= 0 ({window}, {pos0})")
        if sinks is not None and not (sinks.dtype == torch.float32 and sinks.is_contiguous()
                                      and sinks.shape == (q.shape[1],)):
            raise ValueError("attention sinks must be contiguous f32 [n_head]")
        # the scratch holds the blocks the list spans: from its first block's start
        work = self._scratch(max(length + pos0 % ATTN_BLOCK, n_cells), n, n_kv, g, d)
        out = torch.empty(n, q.shape[1] * d, dtype=torch.bfloat16)
        arr = ctypes.c_int64 * 1
        rc = self._attn(q.data_ptr(), k.data_ptr(), v.data_ptr(), kt, vt, k_hs, v_hs, 1,
                        (ctypes.c_void_p * 1)(idx), arr(c0), arr(length), arr(n), arr(pos0),
                        window, n_kv, g, d, d**-0.5 if scale is None else scale,
                        None if sinks is None else sinks.data_ptr(), out.data_ptr(),
                        work.data_ptr(),
                        work.numel())
        if rc != 0:
            raise ValueError(f"attention kernel refused g={g} d={d} n={n} of {length} (rc {rc})")
        return out

    def add_rms_norm(self, x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """x += y (in place, f32 rows [T, d]; skipped when y is None), then bf16(rms_norm(x) *
        w): the residual add and the next layer's norm in one pass."""
        rows, d = x.shape
        if not (x.dtype == w.dtype == torch.float32 and x.stride(1) == 1
                and w.is_contiguous() and w.numel() == d
                and (y is None or (y.dtype == torch.bfloat16 and y.is_contiguous()
                                   and y.shape == x.shape))):
            raise ValueError("add_rms_norm needs f32 rows, an f32 weight and bf16 addends")
        out = torch.empty(rows, d, dtype=torch.bfloat16)
        self._norm(x.data_ptr(), x.stride(0), None if y is None else y.data_ptr(), w.data_ptr(),
                   rows, d, eps, out.data_ptr())
        return out

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for bf16 rows gu [T, 2 ff] = [gate | up] -> [T, ff]."""
        return self._gate(self._silu, gu)

    def swiglu_oai(self, gu: torch.Tensor) -> torch.Tensor:
        """gpt-oss's clamped SwiGLU (moe.py's swiglu_oai) for bf16 rows gu [T, 2 ff] = [gate |
        up] -> [T, ff] bf16."""
        return self._gate(self._swiglu_oai, gu)

    @staticmethod
    def _gate(fn: Callable[..., None], gu: torch.Tensor) -> torch.Tensor:
        rows, ff2 = gu.shape
        if not (gu.dtype == torch.bfloat16 and gu.is_contiguous() and ff2 % 2 == 0):
            raise ValueError("the gate kernels need contiguous bf16 [gate | up] rows")
        out = torch.empty(rows, ff2 // 2, dtype=torch.bfloat16)
        fn(gu.data_ptr(), rows, ff2 // 2, out.data_ptr())
        return out

    def short_conv(self, bcx: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor,
                   new: torch.Tensor, reads: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """LFM2's short convolution of one layer (csrc/short_conv.c; model/short_conv.py's
        arithmetic): the in-projection's bf16 rows bcx [T, 3 e], the layer's input rows in the
        window part ck, cv [n_cells, e / 2] (written at the cells `new` [T]), the cells each
        output reads [T * L] (-1: before position 0), the kernel w [e, L] f32 -> [T, e]."""
        rows, e3 = bcx.shape
        e, L = w.shape
        ok = (bcx.dtype == ck.dtype == cv.dtype == torch.bfloat16 and w.dtype == torch.float32
              and e3 == 3 * e and e % 2 == 0 and ck.shape == cv.shape and ck.shape[1] == e // 2
              and all(t.is_contiguous() for t in (bcx, ck, cv, w))
              and new.dtype == reads.dtype == torch.int64 and new.numel() == rows
              and reads.numel() == rows * L)
        if not ok:
            raise ValueError("short_conv kernel needs contiguous bf16 rows and caches, an f32 "
                             "kernel [e, L] and int64 cells")
        out = torch.empty(rows, e, dtype=torch.bfloat16)
        self._short_conv(bcx.data_ptr(), rows, e, L, ck.data_ptr(), cv.data_ptr(),
                         new.data_ptr(), reads.data_ptr(), w.data_ptr(), out.data_ptr())
        return out

    def gdn_step(self, proj: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 n_new: torch.Tensor, read: torch.Tensor, write: torch.Tensor,
                 conv_w: torch.Tensor, ssm_a: torch.Tensor, dt_bias: torch.Tensor,
                 norm_w: torch.Tensor, nk: int, nv: int, dk: int, dv: int,
                 eps: float) -> torch.Tensor:
        """One Gated DeltaNet layer (Qwen3.5's linear attention) for a step's sequences
        (csrc/delta_net.c): the depthwise causal conv, the q/k L2 norms, the gated delta rule
        and the gated RMS norm, bf16 in and out, the state in f32.

        proj bf16 [T, P]: each token's in-projections [q | k | v (the Cc = 2 nk dk + nv dv conv
        channels) | z (nv dv) | beta logits (nv) | alpha (nv)]; k, v f32 [n_cells, W] the
        layer's state stores, a cell a row, W = (K-1) Cc + ceil(nv / 2) dk dv (k's row: the conv
        state, K-1 rows of Cc oldest first, then v-heads 0..ceil(nv/2)-1's [dk][dv] matrices;
        v's row: the other v-heads' matrices, then padding); n_new, read, write int64 [S]: each
        sequence's tokens (proj's rows in order), the cell its state is read from (-1: zeros;
        never written) and the cell it is left in (not the read cell, nor any other sequence's
        read or write cell). conv_w f32 [Cc, K], ssm_a (= -exp(A_log)) and dt_bias f32 [nv],
        norm_w f32 [dv]; v-head h uses q/k head h % nk -> bf16 [T, nv dv]. A token's bits do not
        depend on the other tokens or sequences of the call, nor on the thread count, and every
        variant computes the same bits (fixed orders, no reassociation or contraction; exp is
        the kernel's own, within 0.51 ulp: libm's expf neither vectorizes nor gives the same bits
        on every CPU)."""
        if not (nk > 0 and nv > 0 and dk > 0 and dv > 0):
            raise ValueError(f"gdn_step needs positive head counts and sizes ({nk}, {nv}, "
                             f"{dk}, {dv})")
        cc = 2 * nk * dk + nv * dv
        width = cc + nv * dv + 2 * nv
        kk = conv_w.shape[1] if conv_w.dim() == 2 else 0
        w = (kk - 1) * cc + (nv + 1) // 2 * dk * dv
        weights = f"f32 conv_w [{cc}, K >= 1], ssm_a, dt_bias [{nv}], norm_w [{dv}]"
        ok = (kk >= 1 and conv_w.dtype == ssm_a.dtype == dt_bias.dtype == norm_w.dtype
              == torch.float32 and conv_w.shape == (cc, kk)
              and ssm_a.shape == dt_bias.shape == (nv,) and norm_w.shape == (dv,)
              and all(t.is_contiguous() for t in (conv_w, ssm_a, dt_bias, norm_w)))
        if not ok:
            raise ValueError(f"gdn_step needs {weights}")
        ns = _check_state_step("gdn_step", proj, width, k, v, w, n_new, read, write, weights)
        rows = proj.shape[0]
        work = self._work_for(rows * cc)
        out = torch.empty(rows, nv * dv, dtype=torch.bfloat16)
        self._gdn(proj.data_ptr(), rows, len(ns), n_new.data_ptr(), read.data_ptr(),
                  write.data_ptr(), k.data_ptr(), v.data_ptr(), w, conv_w.data_ptr(), kk,
                  ssm_a.data_ptr(), dt_bias.data_ptr(), norm_w.data_ptr(), nk, nv, dk, dv,
                  eps, work.data_ptr(), out.data_ptr())
        return out

    def mamba2_step(self, proj: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    n_new: torch.Tensor, read: torch.Tensor, write: torch.Tensor,
                    conv_w: torch.Tensor, conv_b: torch.Tensor | None, ssm_a: torch.Tensor,
                    dt_bias: torch.Tensor, ssm_d: torch.Tensor, norm_w: torch.Tensor,
                    nk: int, nv: int, dk: int, dv: int, eps: float) -> torch.Tensor:
        """One Mamba2 layer (Granite 4.0-H's SSM layers) for a step's sequences
        (csrc/mamba2.c; model/mamba2.py's arithmetic): the depthwise causal conv with its bias,
        the selective scan and the gated group RMS norm, bf16 in and out, the state in f32.

        nk B/C groups of dk (the state size), nv heads of dv, head h in group h // (nv / nk)
        (nv a multiple of nk). proj bf16 [T, P]: each token's in-projection [z (nv dv) | x
        (nv dv) | B (nk dk) | C (nk dk) | dt (nv)], x | B | C the Cc = nv dv + 2 nk dk conv
        channels; k, v f32 [n_cells, W] the layer's state stores, a cell a row, W = (K-1) Cc +
        ceil(nv / 2) dk dv (k's row: the conv state, K-1 rows of Cc oldest first, then heads
        0..ceil(nv/2)-1's [dk][dv] matrices; v's row: the other heads' matrices, then padding);
        n_new, read, write int64 [S]: each sequence's tokens (proj's rows in order), the cell
        its state is read from (-1: zeros; never written) and the cell it is left in (not the
        read cell, nor any other sequence's read or write cell). conv_w f32 [Cc, K], conv_b f32
        [Cc] or None, ssm_a (= -exp(A_log)), dt_bias and ssm_d (the skip) f32 [nv], norm_w f32
        [nv dv] -> bf16 [T, nv dv].

        Per token, in f32: conv out = silu(taps' sum from j = 0 in order + bias); per head
        dt = softplus(dt + dt_bias), S = S exp(dt ssm_a) + B (x dt)^T, y = S^T C (the sum over
        the state index in order), y = (y + ssm_d x) silu(z); per group y times 1 / sqrt(the
        mean of y^2 over the group's heads, in order, + eps), times norm_w. A token's bits do
        not depend on the other tokens or sequences of the call, nor on the thread count, and
        every variant computes the same bits (fixed orders, no reassociation or contraction; exp
        is the kernel's own, delta_net.c's)."""
        if not (nk > 0 and nv > 0 and dk > 0 and dv > 0 and nv % nk == 0):
            raise ValueError(f"mamba2_step needs positive group and head counts and sizes, the "
                             f"heads a multiple of the groups ({nk}, {nv}, {dk}, {dv})")
        vd = nv * dv
        cc = vd + 2 * nk * dk
        width = vd + cc + nv
        kk = conv_w.shape[1] if conv_w.dim() == 2 else 0
        w = (kk - 1) * cc + (nv + 1) // 2 * dk * dv
        f32 = (conv_w, ssm_a, dt_bias, ssm_d, norm_w) + (() if conv_b is None else (conv_b,))
        weights = (f"f32 conv_w [{cc}, K >= 1], conv_b [{cc}] or None, ssm_a, dt_bias, ssm_d "
                   f"[{nv}], norm_w [{vd}]")
        ok = (kk >= 1 and all(t.dtype == torch.float32 and t.is_contiguous() for t in f32)
              and conv_w.shape == (cc, kk) and (conv_b is None or conv_b.shape == (cc,))
              and ssm_a.shape == dt_bias.shape == ssm_d.shape == (nv,)
              and norm_w.shape == (vd,))
        if not ok:
            raise ValueError(f"mamba2_step needs {weights}")
        ns = _check_state_step("mamba2_step", proj, width, k, v, w, n_new, read, write, weights)
        rows = proj.shape[0]
        work = self._work_for(rows * cc)
        out = torch.empty(rows, vd, dtype=torch.bfloat16)
        self._mamba2(proj.data_ptr(), rows, len(ns), n_new.data_ptr(), read.data_ptr(),
                     write.data_ptr(), k.data_ptr(), v.data_ptr(), w, conv_w.data_ptr(),
                     None if conv_b is None else conv_b.data_ptr(), kk, ssm_a.data_ptr(),
                     dt_bias.data_ptr(), ssm_d.data_ptr(), norm_w.data_ptr(), nk, nv, dk, dv,
                     eps, work.data_ptr(), out.data_ptr())
        return out

    def int8_head(self, q8: torch.Tensor, rowsum: torch.Tensor, scale: torch.Tensor,
                  a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """y [n, V] f32 = scale * sum over the two parts p of s_p * (a_p - 128) . q8 for int8
        rows q8 [V, D] (rowsum their int32 row sums, scale f32 [V]) and hidden states split
        into int8 parts a [2n, D] uint8 (+128) with scales s [2n] (head.py's split_int8)."""
        rows, d = q8.shape
        n = a.shape[0] // 2
        if not (self.has_int8_head and q8.dtype == torch.int8 and rowsum.dtype == torch.int32
                and scale.dtype == s.dtype == torch.float32 and a.dtype == torch.uint8
                and all(t.is_contiguous() for t in (q8, rowsum, scale, a, s))
                and rowsum.numel() == scale.numel() == rows and a.shape == (2 * n, d)
                and s.numel() == 2 * n and d % 64 == 0):
            raise ValueError("int8_head needs int8 rows, int32 sums, f32 scales, uint8 parts")
        y = torch.empty(n, rows)
        rc = self._int8_head(q8.data_ptr(), rowsum.data_ptr(), scale.data_ptr(), a.data_ptr(),
                             s.data_ptr(), rows, d, n, y.data_ptr())
        if rc != 0:
            raise ValueError("int8_head kernel refused the shape")
        return y

    def head_dots(self, w: torch.Tensor, h: torch.Tensor,
                  ids: torch.Tensor | None = None) -> torch.Tensor:
        """Exact f32 logits [n, m]: w[ids] . h row by row (every row of w when ids is None),
        each one dot product in a fixed order (csrc/f32_head.c), so a logit never depends on
        which rows or tokens share the call."""
        if not (w.dtype == h.dtype == torch.float32 and w.is_contiguous() and h.is_contiguous()
                and h.dim() == 2 and w.dim() == 2 and h.shape[1] == w.shape[1]):
            raise ValueError("head_dots needs contiguous f32 rows of the head's width")
        m = w.shape[0]
        if ids is not None:
            if not (ids.dtype == torch.int64 and ids.is_contiguous() and ids.dim() == 1):
                raise ValueError("head_dots needs a contiguous int64 token index")
            m = ids.numel()
        out = torch.empty(h.shape[0], m)
        if m and h.shape[0] and self._dots(
                w.data_ptr(), w.shape[0], w.shape[1], None if ids is None else ids.data_ptr(),
                m, h.data_ptr(), h.shape[0], out.data_ptr()) != 0:
            raise IndexError("head_dots: token id outside the head")
        return out

    def tiles(self, tiles: torch.Tensor, fmt: int, n: int, k: int) -> TileMatrix:
        """The matrix W [n, k] held in csrc/i8act.c's tile format `fmt` (TILE_BLOCK_BYTES:
        uint8 [n / 16, k / 32, block bytes], quant.py's pack_q4 and pack_i8), checked once here
        so each product only checks its input."""
        size = TILE_BLOCK_BYTES.get(fmt)
        if not (size is not None and tiles.dtype == torch.uint8 and tiles.is_contiguous()
                and n % 16 == 0 and k % 32 == 0 and tiles.shape == (n // 16, k // 32, size)):
            raise ValueError(f"tile kernels need uint8 tiles [n / 16, k / 32, {size}]")
        return TileMatrix(self, tiles, n, k, fmt)

    def file_rows(self, parts: list[np.ndarray], fmt: int, k: int) -> FileRowsMatrix:
        """The matrix W [n, k] whose rows are `parts` (uint8 [rows, k / 32 * block] each, one
        or two: a fused gate and up), in csrc/i8act.c's file format `fmt` (FILE_BLOCKS: the
        file's Q8_0, MXFP4, Q4_K or Q6_K blocks, used where they lie: a mapped file's pages stay
        mapped), checked once here."""
        per, size = FILE_BLOCKS.get(fmt, (0, 0))
        rb = k // per * size if per and k % per == 0 else -1
        if not (0 < len(parts) <= 2 and all(
                p.dtype == np.uint8 and p.ndim == 2 and p.shape[1] == rb and p.shape[0] % 16 == 0
                and p.shape[0] > 0 and p.flags.c_contiguous for p in parts)):
            raise ValueError(f"file-row kernels need one or two uint8 [16 m, {rb}] row blocks")
        return FileRowsMatrix(self, parts, fmt, k)

    def bf16(self, panels: torch.Tensor, n: int, k: int) -> Bf16Matrix:
        """The bf16 matrix W [n, k] held in bf16_gemm.c's panels (bf16 [ceil(n / 32),
        ceil(k / 32) * 16, 32, 2], quant.py's pack_bf16), checked once here so each product only
        checks its input."""
        shape = (-(-n // BF16_PANEL), -(-k // 32) * 16, BF16_PANEL, 2)
        if not (self.has_bf16_gemm and panels.dtype == torch.bfloat16 and n > 0 and k > 0
                and panels.is_contiguous() and panels.shape == shape):
            raise ValueError(f"bf16 kernel needs bf16 panels {list(shape)}")
        return Bf16Matrix(self, panels, n, k)




def variant_name(kern: Kernels | None) -> str:
    """What /props and `radixserve perf` report: the kernels' variant, "none" without them."""
    return kern.variant if kern is not None else "none"


@functools.cache
def load_kernels(variant: str, cc: str | None, cache: Path,
                 checks: bool = False) -> Kernels | None:
    """`variant`'s kernels, built with `cc` into `cache` (or taken from it) and loaded once per
    process for these inputs; None when they do not build. Raises KernelsError when this CPU
    cannot run them."""
    if variant not in VARIANTS:
        raise KernelsError(f"no kernel variant {variant!r}; allowed: {', '.join(VARIANTS)}")
    missing = kernel_build.missing_flags(variant, kernel_build.cpu_flags())
    if missing:
        raise KernelsError(f"the {variant} kernels cannot run on this CPU: it lacks "
                           f"{' '.join(missing)}")
    path = kernel_build.build(variant, cc, cache)
    if path is None:
        return None
    return Kernels(ctypes.CDLL(str(path)), path.stem.removeprefix(_PREFIX), variant, checks)
