"""Linear layers over a GGUF's weights: 4-bit blocks executed packed, everything else dense.

Decode is memory-bound: each step reads every weight once, so reading Q4 blocks (~0.6 bytes a
weight) instead of dequantized bf16 (2 bytes) is what makes a step fast. GGUF's 4-bit types all
decode a 32-weight group as an affine map of 4-bit codes, w = scale q + offset:

    Q4_0: w = d (q - 8)          -> scale = d,      offset = -8 d
    Q4_1: w = d q + m            -> scale = d,      offset = m
    Q4_K: w = d sc q - dmin mn   -> scale = d sc,   offset = -dmin mn   (per 32 sub-block)

Two executions of that form, picked at load (`packed_linear`):
- Q4Linear, our tiles (csrc/i8act.c, every build of our kernels): f16 scale and offset, so
  Q4_0 and Q4_1 weights are exactly the file's, multiplied with 8-bit activations.
- Int4Linear, torch's CPU int4 weight-only kernel (`aten._weight_int4pack_mm_for_cpu`, group 32,
  w = (q - 8) scale' + zero, so zero = offset + 8 scale) with scale and zero rounded to the
  activation dtype: the path without our kernels. Its bf16 path is the fast one; its f32 path is
  exact but ~10x slower than a dense f32 matmul (cpu-perf-notes.md), so `--weights auto` packs
  only for bf16/f16 compute.
The 5- to 8-bit types (Q5_0, Q5_1, Q8_0, Q5_K, Q6_K) run I8Linear: int8 codes in the same
kernel's 16-row tiles with f32 scales (1.125-1.25 bytes a weight), gguf-py's weights exactly.
Both multiply as llama.cpp's CPU kernels do, by 8-bit integer dot products on activations
quantized a half group of 16 at a time (i8act.c's header: the arithmetic, and why its bits
never depend on the rows or threads sharing a call). Where the tiles cannot hold a matrix (rows not a
multiple of 16), QuantLinear runs it from the file's own blocks (csrc/qmm.c, 16-bit
activations), as it runs the float types F16/BF16/F32 on the builds without AVX512-BF16; with
it, those are dense bf16 in our row-invariant kernel (csrc/bf16_gemm.c, DenseLinear). Without our
kernels, or with f16/f32 compute, the 5- to 8-bit and float types stay dense in the compute
dtype (torch's int8 kernel takes one scale per row: re-quantizing the blocks to it would change
the weights).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from radixserve.model import qmm
from radixserve.model.kernel_matrix import BF16_PANEL, Bf16Matrix
from radixserve.model.kernel_routes import (
    FILE_ROW_TYPES,
    FLOAT_TYPES,
    I8_TYPES,
    Q4_TYPES,
    build_for,
    route_for,
)
from radixserve.model.kernels import Kernels

GROUP = 32
Q = gguf.GGMLQuantizationType
PACKED_TYPES = Q4_TYPES
# the types csrc/qmm.c reads in the file's blocks: every layer matrix where the route table
# says so, and the rows of the embedding and the head on every build
QMM_ROW_TYPES = (*Q4_TYPES, *I8_TYPES, *FLOAT_TYPES)
# torch's int4 kernel: chunks of this many rows or more run as a dense bf16 matmul on weights
# unpacked for that call, as it is compute-bound there and loses to a bf16 GEMM (except in
# deterministic mode: other bits). Our tiles outrun the GEMM at every size and never switch.
DENSE_FROM_ROWS = 96
TILE = 16  # rows per tile (csrc/i8act.c)
# I8Linear: i8act.c's 8-bit tile format of each type (its F_I8, F_I8H, F_I8M: a scale a group,
# a scale a half group for Q6_K's sub-blocks of 16, a scale and an offset)
I8_FORMATS = {Q.Q8_0: 1, Q.Q5_0: 1, Q.Q6_K: 2, Q.Q5_1: 3, Q.Q5_K: 3}
F_MX = 4  # i8act.c's MXFP4 tiles
# each 8-bit tile format's code range
I8_CODES = {1: (-128, 127), 2: (-32, 31), 3: (0, 31)}
F16_MAX = float(np.finfo(np.float16).max)


@dataclass(slots=True)
class Codes:
    """A weight matrix as 4-bit codes with one affine map w = scale q + offset per 32 weights
    of a row."""

    q: np.ndarray  # [N, K] uint8 in 0..15
    scale: np.ndarray  # [N, K / 32] f32
    offset: np.ndarray  # [N, K / 32] f32

    def rows(self, order: np.ndarray) -> Codes:
        return Codes(self.q[order], self.scale[order], self.offset[order])

    @staticmethod
    def concat(parts: list[Codes]) -> Codes:
        return Codes(*(np.concatenate([getattr(p, f) for p in parts])
                       for f in ("q", "scale", "offset")))

    def dequantize(self) -> np.ndarray:
        """f32 weights [N, K], the affine map evaluated in f32."""
        g = lambda a: np.repeat(a, GROUP, axis=1)  # noqa: E731
        return self.q.astype(np.float32) * g(self.scale) + g(self.offset)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: low nibbles are weights 0..15, high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def split_blocks(t: gguf.ReaderTensor) -> Codes:
    """The 4-bit codes and per-group affine maps of a Q4_0 / Q4_1 / Q4_K tensor."""
    n, k = (int(x) for x in reversed(t.shape.tolist()))
    if k % GROUP:
        raise ValueError(f"{t.name}: row length {k} is not a multiple of {GROUP}")
    raw = np.asarray(t.data, dtype=np.uint8).reshape(n, -1)
    f16 = lambda b: b.copy().view(np.float16).astype(np.float32)[..., 0]  # noqa: E731
    if t.tensor_type in (Q.Q4_0, Q.Q4_1):
        size = 18 if t.tensor_type == Q.Q4_0 else 20
        b = raw.reshape(n, k // GROUP, size)
        d = f16(b[..., 0:2])
        q = _nibbles(b[..., size - 16 :])
        offset = -8 * d if t.tensor_type == Q.Q4_0 else f16(b[..., 2:4])
        return Codes(q.reshape(n, k), d, offset)
    if t.tensor_type == Q.Q4_K:
        b = raw.reshape(-1, 144)
        d, dmin = f16(b[:, 0:2])[:, None], f16(b[:, 2:4])[:, None]
        sc, mn = gguf.quants.Q4_K.get_scale_min(b[:, 4:16].copy())
        scale = d * sc.astype(np.float32)
        offset = -dmin * mn.astype(np.float32)
        qs = b[:, 16:].reshape(-1, 4, 32)  # 4 chunks of 32 bytes: sub-blocks 2c (low), 2c+1 (high)
        q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)
        return Codes(q.reshape(n, k), scale.reshape(n, -1), offset.reshape(n, -1))
    raise ValueError(f"{t.name}: {t.tensor_type.name} is not a packed 4-bit type")


class Linear:
    """y = x W^T (+ b) for x [M, K] in the compute dtype. `invariant`: each row's result must
    not depend on M (deterministic mode), so no switching kernels by the number of rows."""

    n_out: int
    bias: torch.Tensor | None
    # whether `invariant=True` holds: checked row by row for each kernel (tests/model/
    # test_quant.py); deterministic mode needs it of every layer matrix
    row_invariant: bool = False
    # the route table's name for what runs it (model/kernel_routes.py)
    route: str = ""

    def __call__(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        raise NotImplementedError

    def weight(self) -> torch.Tensor:
        """W [N, K] in the compute dtype: the weights the matmul multiplies, rounded to it
        (torch's int4 layout's prefill chunks, moving a model to another device, tests)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """bf16 W [N, K] -> bf16_gemm.c's panels [ceil(N / 32), ceil(K / 32) * 16, 32, 2] (its
    header has the layout), zero-padded."""
    n, k = w.shape
    npad, kpad = -(-n // BF16_PANEL) * BF16_PANEL, -(-k // GROUP) * GROUP
    full = torch.zeros(npad, kpad, dtype=torch.bfloat16)
    full[:n, :k] = w
    return full.view(npad // BF16_PANEL, BF16_PANEL, kpad // 2, 2).permute(0, 2, 1, 3).contiguous()


class DenseLinear(Linear):
    """Dense weights. bf16 ones run our kernel (csrc/bf16_gemm.c, needs AVX512-BF16) and are
    kept only in its panels: each row's bits are the same at any row count, which torch's bf16
    GEMM does not give (tests/model/test_quant.py), and it kept up with that GEMM or beat it at
    every row count measured (1 to 512, the default model's shapes; ~3x at decode), so it runs
    in every mode. Other dtypes, or no kernels (`kern` None): F.linear (f32 has no
    deterministic mode)."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None = None,
                 kern: Kernels | None = None) -> None:
        self.bias, self.n_out = bias, w.shape[0]
        self.mat: Bf16Matrix | None = None
        self.w: torch.Tensor | None = w
        if (w.dtype == torch.bfloat16 and w.dim() == 2 and w.numel() and kern is not None
                and kern.has_bf16_gemm):
            self.mat, self.w = kern.bf16(pack_bf16(w), *w.shape), None
        self.row_invariant = self.mat is not None
        self.route = "bf16-panels" if self.mat is not None else "torch-dense"

    def __call__(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        if self.mat is None:
            assert self.w is not None
            return F.linear(x, self.w, self.bias)
        lead = x.shape[:-1]
        y = self.mat.matmul(x.reshape(-1, self.mat.k).contiguous()).view(*lead, self.n_out)
        return y if self.bias is None else y + self.bias

    def weight(self) -> torch.Tensor:
        """W [N, K]; unpacked from the panels (a copy) when the kernel holds them."""
        if self.mat is not None:
            return self.mat.weight()
        assert self.w is not None
        return self.w

    @property
    def nbytes(self) -> int:
        w = self.w if self.mat is None else self.mat.panels
        assert w is not None
        return w.nbytes + (self.bias.nbytes if self.bias is not None else 0)


def _unpack_tiles(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Codes - 8 as f32 [N, K] from torch's CPU int4 layout: byte (b, k, i) holds row 64b + i in
    its low nibble and row 64b + 32 + i in its high one (torch 2.13, AVX-512 and AVX2 builds)."""
    p = packed.view(n // 64, k, 32)
    c = torch.cat([p & 15, p >> 4], -1).view(torch.int8).sub_(8)
    return torch.empty(n // 64, 64, k).copy_(c.transpose(1, 2)).view(n, k)


@functools.cache
def tile_layout_known() -> bool:
    """Whether `_unpack_tiles` reads this build's int4 layout (checked once on a probe matrix)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=g)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return packed.numel() * 2 == q.numel() and torch.equal(_unpack_tiles(packed, 128, 64),
                                                            (q - 8).float())


class PackedLinear(Linear):
    """4-bit weights run a 4-bit kernel; from `dense_from` rows on (prefill chunks, where that
    kernel is slower) they are unpacked for the call and run a bf16 GEMM; no dense copy is
    kept."""

    dense_from: int | None = DENSE_FROM_ROWS
    row_invariant = True  # both 4-bit kernels, as long as they do not switch to the GEMM

    def __call__(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        if self.dense_from is not None and x.shape[0] >= self.dense_from and not invariant:
            return F.linear(x, self.weight(), self.bias)
        y = self.kernel(x)
        return y if self.bias is None else y + self.bias

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T through the 4-bit kernel, no bias."""
        raise NotImplementedError


class Int4Linear(PackedLinear):
    """4-bit codes in torch's int4 CPU layout, one (scale, zero) pair per 32 weights; the
    unpack gives the kernel's own dequantized values (bitwise)."""

    route = "torch-int4"

    def __init__(self, codes: Codes, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        q = torch.from_numpy(np.ascontiguousarray(codes.q)).to(torch.int32)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        zero = codes.offset + 8 * codes.scale
        sz = np.stack([codes.scale.T, zero.T], axis=-1)  # [K / 32, N, 2]
        self.scales_zeros = torch.from_numpy(np.ascontiguousarray(sz)).to(dtype).contiguous()
        self.n_out, self.n_in = codes.q.shape
        self.bias, self.dtype = bias, dtype
        self._tiles = self.n_out % 64 == 0 and tile_layout_known()

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)

    def weight(self) -> torch.Tensor:
        n, k = self.n_out, self.n_in
        if not self._tiles:  # the kernel itself dequantizes: times the identity
            eye = torch.eye(k, dtype=self.dtype)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                eye, self.packed, GROUP, self.scales_zeros).t().contiguous()
        sz = self.scales_zeros.float()
        w = _unpack_tiles(self.packed, n, k).view(n, k // GROUP, GROUP)
        w.mul_(sz[..., 0].t()[..., None]).add_(sz[..., 1].t()[..., None])
        return w.view(n, k).to(self.dtype)

    @property
    def nbytes(self) -> int:
        extra = self.bias.nbytes if self.bias is not None else 0
        return self.packed.nbytes + self.scales_zeros.nbytes + extra


class ConcatLinear(Linear):
    """Several linears on the same input, outputs side by side (a fused Q/K/V of mixed types)."""

    def __init__(self, parts: list[Linear]) -> None:
        self.parts, self.bias = parts, None
        self.n_out = sum(p.n_out for p in parts)
        self.row_invariant = all(p.row_invariant for p in parts)
        self.route = "+".join(p.route for p in parts)

    def __call__(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        return torch.cat([p(x, invariant) for p in self.parts], dim=-1)

    def weight(self) -> torch.Tensor:
        return torch.cat([p.weight() for p in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def pack_q4(codes: Codes) -> torch.Tensor:
    """Codes -> csrc/i8act.c's 4-bit tiles [N / 16, K / 32, 320] uint8: per (tile, group) 4
    chunks of 64 bytes, 16-bit word j of chunk c holding four codes of row j / 2 (nibble i: the
    weight at 8 c + 2 i + (j & 1)), then the 16 rows' f16 scales and f16 offsets."""
    n, k = codes.q.shape
    q = codes.q.reshape(n // TILE, TILE, k // GROUP, 4, 4, 2).astype(np.uint16)
    # [tile, row, group, chunk, nibble, pair half] -> words [tile, group, chunk, row, half]
    words = sum(q[:, :, :, :, i, :] << (4 * i) for i in range(4)).astype(np.uint16)
    words = words.transpose(0, 2, 3, 1, 4).reshape(n // TILE, k // GROUP, 128)

    def per_tile(a: np.ndarray) -> np.ndarray:  # [N, K / 32] -> f16 bytes [tile, group, 32]
        a = a.astype(np.float16).reshape(n // TILE, TILE, k // GROUP).transpose(0, 2, 1)
        return np.ascontiguousarray(a).view(np.uint8)

    blocks = np.concatenate([words.view(np.uint8), per_tile(codes.scale),
                             per_tile(codes.offset)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(blocks))


class Q4Linear(PackedLinear):
    """4-bit codes in our tiles (csrc/i8act.c) with f16 scale and offset, multiplied with 8-bit
    activations; each row's bits are the same at any row count, and it outruns the unpack +
    GEMM path at every row count, so it never switches."""

    dense_from = None
    route = "q4-tiles"

    def __init__(self, codes: Codes, bias: torch.Tensor | None, kern: Kernels) -> None:
        self.n_out, self.n_in = codes.q.shape
        self.mat, self.bias = kern.tiles(pack_q4(codes), 0, self.n_out, self.n_in), bias

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return self.mat.matmul(x.contiguous())

    def weight(self) -> torch.Tensor:
        """bf16(scale q + offset) [N, K], evaluated in f32."""
        return tile_weights(self.mat.tiles, 0).to(torch.bfloat16)

    @property
    def nbytes(self) -> int:
        return self.mat.tiles.nbytes + (self.bias.nbytes if self.bias is not None else 0)


def packed_linear(codes: Codes, bias: torch.Tensor | None, dtype: torch.dtype,
                  kern: Kernels | None = None) -> Linear:
    """4-bit codes in our tiles where the route table's 4-bit route at this dtype and on the
    kernels `kern` (None: none) is theirs (and scales and offsets fit f16), else in torch's int4
    layout (the loader takes this only where the table says torch-int4; builds that read the
    file's blocks never pack); both need rows in tiles of 16, so other matrices stay dense."""
    if codes.q.shape[0] % TILE:
        return DenseLinear(torch.from_numpy(codes.dequantize()).to(dtype), bias, kern)
    tiles = route_for(build_for(kern, dtype), Q.Q4_0, codes.q.shape[0]) == "q4-tiles"
    if (tiles and kern is not None
            and all(np.abs(a).max(initial=0) <= F16_MAX for a in (codes.scale, codes.offset))):
        return Q4Linear(codes, bias, kern)
    return Int4Linear(codes, bias, dtype)


def raw_rows(t: gguf.ReaderTensor) -> np.ndarray:
    """A tensor's bytes as [rows, bytes per row]: each row its blocks, as in the file."""
    n = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
    return np.asarray(t.data).view(np.uint8).reshape(n, -1)


MXFP4_BLOCK = 17  # an E8M0 scale byte, then 16 bytes of E2M1 codes (low nibbles first)
MX_VALUES = np.array(gguf.quants.MXFP4.kvalues, dtype=np.int8)  # E2M1 doubled, by code


def mxfp4_nibbles(raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 rows raw (uint8 [n, k / 32 * 17]) as their codes (uint8 [n, k], 0..15: an index
    into MX_VALUES) and f32 scales [n, k / 32] (the E8M0 scale halved, 2^(e - 128), as
    ggml's e8m0_to_fp32_half): the weight is scale * MX_VALUES[code], gguf-py's exactly (a
    power of two times a small integer)."""
    n = raw.shape[0]
    if raw.ndim != 2 or k % GROUP or raw.shape[1] != k // GROUP * MXFP4_BLOCK:
        raise ValueError(f"MXFP4 rows of {k} weights need {k // GROUP * MXFP4_BLOCK} bytes")
    b = raw.reshape(n, k // GROUP, MXFP4_BLOCK)
    d = gguf.quants.MXFP4.e8m0_to_fp32_half(b[..., 0].astype(np.uint32)).astype(np.float32)
    return _nibbles(b[..., 1:]).reshape(n, k), d


def mxfp4_codes(raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MXFP4 rows as qmm.codes gives the 8-bit types': int8 codes [n, k] (-12..12), scales
    [n, k / 16] and zero offsets [n, k / 32] (F_MX's products are format 1's on these)."""
    q, d = mxfp4_nibbles(raw, k)
    return MX_VALUES[q], np.repeat(d, 2, axis=1), np.zeros_like(d)


def pack_mx(q: np.ndarray, d: np.ndarray) -> torch.Tensor:
    """MXFP4 codes q [N, K] (0..15) and scales d [N, K / 32] -> csrc/i8act.c's F_MX tiles
    [N / 16, K / 32, 320] uint8: pack_q4's nibbles, then the 16 rows' f32 scales."""
    n, k = q.shape
    zero = np.zeros((n, k // GROUP), np.float32)
    nib = pack_q4(Codes(q, zero, zero)).numpy()[..., :256]
    scales = d.astype(np.float32).reshape(n // TILE, TILE, k // GROUP).transpose(0, 2, 1)
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(
        [nib, np.ascontiguousarray(scales).view(np.uint8)], axis=-1)))


# The tiles' order of each 8 weights of a group (csrc/i8act.c): position p holds weight PERM[p],
# the 4-bit tiles' nibble order, which the activation codes take too
PERM = np.array([0, 4, 1, 5, 2, 6, 3, 7])


def pack_i8(c: np.ndarray, d: np.ndarray, m: np.ndarray, fmt: int) -> torch.Tensor:
    """int8 codes c [N, K], scales d [N, K / 16], offsets m [N, K / 32] (qmm.codes) -> csrc/
    i8act.c's 8-bit tiles [N / 16, K / 32, block] uint8: per (tile, group) 8 operands of 64
    bytes (operand t: each of the 16 rows' codes at positions 4t..4t+3 of the group in the tiles'
    order, a row's 4 bytes together), then the 16 rows' f32 scales (format 2: half 0's, then
    half 1's; format 3: then the offsets)."""
    n, k = c.shape
    lo, hi = I8_CODES[fmt]  # the kernel's integer sums are exact for codes in these ranges
    if c.size and (c.min() < lo or c.max() > hi):
        raise ValueError(f"tile format {fmt} holds codes {lo}..{hi}, given {c.min()}..{c.max()}")
    tiles, groups = n // TILE, k // GROUP
    q = c.reshape(tiles, TILE, groups, 4, 8)[..., PERM]
    q = q.reshape(tiles, TILE, groups, 8, 4).transpose(0, 2, 3, 1, 4).reshape(tiles, groups, 512)

    def per_tile(a: np.ndarray) -> np.ndarray:  # [N, K / 32] -> f32 bytes [tile, group, 64]
        a = a.astype(np.float32).reshape(tiles, TILE, groups).transpose(0, 2, 1)
        return np.ascontiguousarray(a).view(np.uint8)

    halves = d.reshape(n, groups, 2)
    parts = [q.view(np.uint8), per_tile(halves[..., 0])]
    if fmt == 2:
        parts.append(per_tile(halves[..., 1]))
    elif not np.array_equal(halves[..., 0], halves[..., 1]):
        raise ValueError("tile format with one scale a group, given two")
    if fmt == 3:
        parts.append(per_tile(m))
    elif m.any():
        raise ValueError("tile format without offsets, given offsets")
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=-1)))


def tile_codes(tiles: np.ndarray, fmt: int) -> np.ndarray:
    """The codes of tiles (pack_q4's, pack_i8's or pack_mx's) as [N, K] in the weights' order:
    the 4-bit ones unsigned (0..15), the 8-bit ones signed, MXFP4's their values (-12..12)."""
    t, groups = tiles.shape[:2]
    if fmt == F_MX:
        return MX_VALUES[tile_codes(tiles, 0)]
    if fmt == 0:  # chunk c's byte 4j + i: row j's weights 8c + PERM[i] (low), PERM[i + 4] (high)
        b = tiles[..., :256].reshape(t, groups, 4, TILE, 4)
        pos = np.concatenate([b & 15, b >> 4], axis=-1)  # [t, g, chunk, row, 8 positions]
    else:  # operand 2c + h: positions 4h..4h+3 of chunk c
        b = tiles[..., :512].view(np.int8).reshape(t, groups, 4, 2, TILE, 4)
        pos = b.transpose(0, 1, 2, 4, 3, 5).reshape(t, groups, 4, TILE, 8)
    q = np.empty_like(pos)
    q[..., PERM] = pos
    return q.transpose(0, 3, 1, 2, 4).reshape(t * TILE, groups * GROUP)


def tile_weights(tiles: torch.Tensor, fmt: int) -> torch.Tensor:
    """W [N, K] f32 from tiles: d c + m evaluated in f32 (pack_q4's f16 scales and offsets as
    they are held)."""
    b = tiles.numpy()
    t, groups = b.shape[:2]
    q = tile_codes(b, fmt).astype(np.float32).reshape(t * TILE, groups, 2, 16)

    def per_row(at: int, dt: type) -> np.ndarray:  # [tile, group, 16 rows] -> [N, K / 32]
        width = 16 * np.dtype(dt).itemsize
        a = np.ascontiguousarray(b[..., at:at + width]).view(dt).astype(np.float32)
        return a.transpose(0, 2, 1).reshape(t * TILE, groups)

    if fmt == 0:
        d0 = d1 = per_row(256, np.float16)
        m = per_row(288, np.float16)
    elif fmt == F_MX:
        d0 = d1 = per_row(256, np.float32)
        m = np.zeros_like(d0)
    else:
        d0 = d1 = per_row(512, np.float32)
        m = np.zeros_like(d0)
        if fmt == 2:
            d1 = per_row(576, np.float32)
        if fmt == 3:
            m = per_row(576, np.float32)
    w = q * np.stack([d0, d1], axis=-1)[..., None] + m[..., None, None]
    return torch.from_numpy(w.reshape(t * TILE, groups * GROUP))


class QuantLinear(Linear):
    """Weights in a GGUF type's own blocks, as the file holds them (csrc/qmm.c): any common
    quant type at its bytes per weight, bf16 activations, each row's bits the same at any row
    count and on any thread count; times the identity it gives gguf-py's dequantization (the
    affine types within one f32 rounding: an FMA where gguf-py multiplies then adds)."""

    row_invariant = True

    def __init__(self, qtype: gguf.GGMLQuantizationType, raw: np.ndarray, k: int,
                 bias: torch.Tensor | None, kern: Kernels) -> None:
        self.qtype, self.n_out, self.n_in, self.bias = qtype, raw.shape[0], k, bias
        self.mat = qmm.QuantMatrix(kern.lib, int(qtype), torch.from_numpy(np.array(raw)), k)
        self.route = "qmm-f32" if qtype in FLOAT_TYPES else "qmm-int"

    def __call__(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.mat.matmul(x.reshape(-1, self.n_in).contiguous()).view(*lead, self.n_out)
        return y if self.bias is None else y + self.bias

    def weight(self) -> torch.Tensor:
        """bf16 W [N, K] from the decoded f32 weights."""
        return self.mat.rows().to(torch.bfloat16)

    @property
    def nbytes(self) -> int:
        return self.mat.raw.nbytes + (self.bias.nbytes if self.bias is not None else 0)


class I8Linear(QuantLinear):
    """Q5_0 / Q5_1 / Q8_0 / Q5_K / Q6_K weights as int8 codes in 16-row tiles with f32 scales
    (csrc/i8act.c, 8-bit activations): 1.125-1.25 bytes a weight, d c + m gguf-py's weights
    bit for bit, each row's bits the same at any row count.

    `parts`: the row blocks (type, raw rows) of one matrix, in order. Types of one tile format
    share one matrix (Gemma 3's Q5_0 q/k and Q8_0 v: one call a step, not three and a cat):
    each row carries its own scales, so a row's arithmetic is its type's either way."""

    def __init__(self, parts: list[tuple[gguf.GGMLQuantizationType, np.ndarray]], k: int,
                 bias: torch.Tensor | None, kern: Kernels) -> None:
        fmts = {I8_FORMATS[t] for t, _ in parts}
        if len(fmts) != 1:
            raise ValueError("one 8-bit matrix needs one tile format")
        fmt = fmts.pop()
        codes = [qmm.codes(kern.lib, int(t), raw, k) for t, raw in parts]
        c, d, m = (np.concatenate([cd[i] for cd in codes]) for i in range(3))
        self.n_out, self.n_in, self.bias = c.shape[0], k, bias
        self.mat = kern.tiles(pack_i8(c, d, m, fmt), fmt, self.n_out, k)
        self.route = "i8-tiles"

    def weight(self) -> torch.Tensor:
        """bf16 W [N, K]: bf16(d c + m), evaluated in f32."""
        return tile_weights(self.mat.tiles, self.mat.fmt).to(torch.bfloat16)

    @property
    def nbytes(self) -> int:
        return self.mat.tiles.nbytes + (self.bias.nbytes if self.bias is not None else 0)


class FileRowsLinear(QuantLinear):
    """A matrix whose rows stay where the mapped GGUF holds them (an expert's slices of the
    file's 3-D tensors, one or two: its gate and up), Q8_0, MXFP4, Q4_K or Q6_K, multiplied as
    the 8-bit, MXFP4 and 4-bit tiles multiply them (csrc/i8act.c's file formats): the same bits,
    no copy, the file's bytes a weight (1.0625, 0.53, 0.5625 and 0.82 against the tiles' 1.125,
    0.625, 0.625 and 1.25)."""

    def __init__(self, qtype: gguf.GGMLQuantizationType, parts: list[np.ndarray], k: int,
                 bias: torch.Tensor | None, kern: Kernels) -> None:
        self.qtype, self.n_in, self.bias = qtype, k, bias
        self.mat = kern.file_rows(parts, FILE_ROW_TYPES[qtype], k)
        self.n_out, self.route = self.mat.n, "file-rows"

    def weight(self) -> torch.Tensor:
        """bf16 W [N, K], gguf-py's dequantization of the rows (what the tiles hold)."""
        w = np.concatenate([gguf.quants.dequantize(p, self.qtype) for p in self.mat.parts])
        return torch.from_numpy(w.reshape(self.n_out, self.n_in)).to(torch.bfloat16)

    @property
    def nbytes(self) -> int:
        return self.mat.nbytes + (self.bias.nbytes if self.bias is not None else 0)


class MxLinear(QuantLinear):
    """MXFP4 weights (gpt-oss's experts) in csrc/i8act.c's F_MX tiles: the file's 4-bit codes
    and an f32 scale a group (0.625 bytes a weight), looked up into int8 codes in registers and
    multiplied with 8-bit activations; gguf-py's weights exactly, each row's bits the same at
    any row count. `raws`: the row blocks of one matrix, in order."""

    def __init__(self, raws: list[np.ndarray], k: int, bias: torch.Tensor | None,
                 kern: Kernels) -> None:
        parts = [mxfp4_nibbles(r, k) for r in raws]
        q, d = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        self.n_out, self.n_in, self.bias = q.shape[0], k, bias
        self.mat = kern.tiles(pack_mx(q, d), F_MX, self.n_out, k)
        self.route = "mxfp4-tiles"

    def weight(self) -> torch.Tensor:
        """bf16 W [N, K]: bf16(d c)."""
        return tile_weights(self.mat.tiles, F_MX).to(torch.bfloat16)

    @property
    def nbytes(self) -> int:
        return self.mat.tiles.nbytes + (self.bias.nbytes if self.bias is not None else 0)
