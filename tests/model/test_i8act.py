"""csrc/i8act.c on every CPU variant: products of the 4- and 8-bit tiles with 8-bit activations.

Each variant's outputs must equal, bit for bit, numpy's replay of the kernel's arithmetic on
matrices made here (every tile format, each GGUF type's code range, odd sizes, 1-130 rows): the
activations quantized a half group of 16 at a time as llama.cpp's quantize_row_q8_0 quantizes a
block (d = amax / 127, rint(x / d) by the reciprocal), the integer sums exact (numpy's int64),
then each group's f32 operations in the kernel's order. The integer sums take different instructions in every variant (vpdpbusd on
zmm and ymm, vpmaddubsw with the signs moved to the activations, plain C), so equal bits say
each sum is exact; the f32 replay says the rest is the documented sequence. A row's bits do
not depend on the rows or threads that share its call (1, 2 and 3 threads)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.model import qmm, quant
from tests.model.kernel_variants import VARIANTS, variant_kernels

F32 = np.float32
# (format, code range): the 4-bit tiles (Q4_0, Q4_1, Q4_K: unsigned 0..15, an offset); Q8_0's
# and Q5_0's signed codes (one scale); Q6_K's (a scale a half group); Q5_1's and Q5_K's
# (unsigned 0..31 and an offset)
CASES = {"q4": (0, 0, 16), "q8_0": (1, -128, 128), "q5_0": (1, -16, 16), "q6_k": (2, -32, 32),
         "q5_k": (3, 0, 32)}


def make_tiles(case: str, n: int, k: int, seed: int = 0):
    """A random matrix of `case` as tiles, with its codes, scales and offsets."""
    fmt, lo, hi = CASES[case]
    rng = np.random.default_rng(seed)
    c = rng.integers(lo, hi, (n, k))
    d = (rng.uniform(1e-3, 2e-2, (n, k // 16)) * rng.choice([-1, 1], (n, k // 16))).astype(F32)
    m = rng.uniform(-0.2, 0.2, (n, k // 32)).astype(F32)
    if fmt == 0:
        d16, m16 = d[:, ::2].astype(np.float16), m.astype(np.float16)
        # f16 subnormals and a negative zero: the generic build converts f16 by hand
        d16[0, 1], m16[1, 0], m16[2, 1], m16[3, 0] = 2.0**-20, -3e-6, -0.0, 2.0**-24
        codes = quant.Codes(c.astype(np.uint8), d16.astype(F32), m16.astype(F32))
        return fmt, quant.pack_q4(codes), c, np.repeat(d16.astype(F32), 2, 1), m16.astype(F32)
    if fmt != 2:
        d = np.repeat(d[:, ::2], 2, 1)
    if fmt != 3:
        m = np.zeros_like(m)
    return fmt, quant.pack_i8(c.astype(np.int8), d, m, fmt), c, d, m


def replay(x: torch.Tensor, fmt: int, c: np.ndarray, d: np.ndarray, m: np.ndarray) -> torch.Tensor:
    """The kernel's output for bf16 rows x, computed in numpy step by step (the C header)."""
    rows, k = x.shape
    h = x.float().numpy().reshape(rows, k // 16, 16)  # half groups
    s = np.abs(h).max(-1) / F32(127)
    inv = np.divide(F32(1), s, out=np.zeros_like(s), where=s > 0)
    a = np.rint(h * inv[..., None]).astype(np.int64)
    sums = a.sum(-1).astype(F32)
    ssum = s[:, 0::2] * sums[:, 0::2] + s[:, 1::2] * sums[:, 1::2]  # [rows, groups]
    w = c.reshape(-1, k // 16, 16).astype(np.int64)
    out = np.zeros((rows, w.shape[0]), F32)
    for j in range(k // 32):
        for half in (2 * j, 2 * j + 1):
            dot = np.einsum("ri,ni->rn", a[:, half], w[:, half]).astype(F32)
            out = out + dot * (d[None, :, half] * s[:, half, None])
        if fmt in (0, 3):
            out = out + m[None, :, j] * ssum[:, j, None]
    return torch.from_numpy(out).to(torch.bfloat16)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_equals_the_replay(variant: str, case: str) -> None:
    kern = variant_kernels(variant)
    n, k = 48, 32 * 7  # three tiles, an odd number of groups
    fmt, tiles, c, d, m = make_tiles(case, n, k)
    mat = kern.tiles(tiles, fmt, n, k)
    x = (torch.randn(130, k, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    x[5, :40] = 0  # a group of zeros, and a half of one
    x[6, 16:32] = 0
    full = mat.matmul(x)
    want = replay(x, fmt, c, d, m)
    diff = full != want
    assert not diff.any(), f"{int(diff.sum())} of {diff.numel()} outputs differ"
    for size in (1, 2, 3, 4, 5, 7, 33, 130):
        parts = torch.cat([mat.matmul(x[i:i + size].contiguous()) for i in range(0, 130, size)])
        assert torch.equal(parts, full), f"rows of {size} differ"
    before = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            assert torch.equal(mat.matmul(x), full), f"{t} threads differ"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("variant", VARIANTS)
def test_mxfp4_tiles_are_gguf_pys_weights_and_format_1s_products(variant: str) -> None:
    """MXFP4 blocks (gguf-py's quantizer, weights over 12 orders of magnitude, a block of
    zeros) in the F_MX tiles (pack_mx: the file's 4-bit codes, looked up in registers): they
    hold gguf-py's dequantized weights exactly, and each variant's products equal, bit for
    bit, the replay of format 1 on the looked-up codes (mxfp4_codes) and the 8-bit tiles of
    those codes."""
    import gguf

    rng = np.random.default_rng(4)
    n, k = 32, 32 * 5
    w = (rng.standard_normal((n, k)) * 10.0 ** rng.uniform(-6, 6, (n, 1))).astype(F32)
    w[3, 32:64] = 0
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.MXFP4)
    q, scale = quant.mxfp4_nibbles(raw, k)
    tiles = quant.pack_mx(q, scale)
    want_w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    assert np.array_equal(quant.tile_weights(tiles, quant.F_MX).numpy(), want_w)
    c, d, m = quant.mxfp4_codes(raw, k)
    assert c.min() == -12 and c.max() == 12 and np.array_equal(quant.tile_codes(
        tiles.numpy(), quant.F_MX), c)
    kern = variant_kernels(variant)
    mat = kern.tiles(tiles, quant.F_MX, n, k)
    i8 = kern.tiles(quant.pack_i8(c, d, m, 1), 1, n, k)
    x = (torch.randn(130, k, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    y = mat.matmul(x)
    assert torch.equal(y, replay(x, 1, c, d, m)) and torch.equal(y, i8.matmul(x))
    for size in (1, 3, 33):
        parts = torch.cat([mat.matmul(x[i:i + size].contiguous()) for i in range(0, 130, size)])
        assert torch.equal(parts, y), size
    with pytest.raises(ValueError, match="MXFP4 rows of 160 weights"):
        quant.mxfp4_nibbles(raw[:, :-1], k)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_files_own_rows_give_the_tiles_products(variant: str) -> None:
    """A Q8_0 or MXFP4 matrix read from the file's own rows (i8a_matmul_rows: views, as a
    mapped file's expert tensors are held) gives the products of the same rows packed into the
    8-bit and F_MX tiles bit for bit, in one row block and as two (a fused gate and up: rows from
    two tensors), at every row count; f16 scales that are subnormal, zero and negative, E8M0
    scales of 0, 1 and 255 (ggml's subnormal halves and the largest), Q8_0 codes of -128; the
    second row block apart from the first (its own buffer), 6 tiles (the prefetch ahead runs);
    and the shapes refused."""
    import gguf

    Q = gguf.GGMLQuantizationType
    kern = variant_kernels(variant)
    rng = np.random.default_rng(5)
    n, k = 96, 32 * 7
    x = (torch.randn(70, k, generator=torch.Generator().manual_seed(3)) * 2).to(torch.bfloat16)
    for qtype, fmt in ((Q.Q8_0, 5), (Q.MXFP4, 6)):
        w = (rng.standard_normal((n, k)) * 10.0 ** rng.uniform(-4, 4, (n, 1))).astype(F32)
        raw = gguf.quants.quantize(w, qtype)
        if qtype == Q.Q8_0:
            blocks = raw.reshape(n, k // 32, 34)
            for (r, g), h in zip([(0, 0), (1, 2), (2, 3)], [2.0**-20, 0.0, -2.0**-24]):
                blocks[r, g, :2] = np.frombuffer(np.float16(h).tobytes(), np.uint8)
            blocks[5:40:3, 1:6, 2:34:5] = 0x80  # -128: outside what the quantizer writes
            c, d, m = qmm.codes(kern.lib, int(qtype), raw, k)
            packed = kern.tiles(quant.pack_i8(c, d, m, 1), 1, n, k)
        else:
            raw.reshape(n, k // 32, 17)[[0, 1, 2], [0, 1, 2], 0] = [0, 1, 255]
            packed = kern.tiles(quant.pack_mx(*quant.mxfp4_nibbles(raw, k)), quant.F_MX, n, k)
        want = packed.matmul(x)
        assert want.isfinite().float().mean() > 0.9
        one = kern.file_rows([raw], fmt, k)
        two = kern.file_rows([raw[:32], raw[32:].copy()], fmt, k)
        assert one.n == two.n == n and one.nbytes == raw.nbytes
        for size in (1, 2, 5, 70):
            for mat in (one, two):
                got = torch.cat([mat.matmul(x[i:i + size].contiguous())
                                 for i in range(0, 70, size)])
                # the bits: E8M0 255's weights overflow to infinities, and their sums to NaN
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (qtype, size)
        with pytest.raises(ValueError, match="row blocks"):
            kern.file_rows([raw[:8]], fmt, k)
        with pytest.raises(ValueError, match="row blocks"):
            kern.file_rows([raw[:, :-1]], fmt, k)
        with pytest.raises(ValueError, match="row blocks"):
            kern.file_rows([raw, raw, raw], fmt, k)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_files_own_q6_k_rows_give_the_8_bit_tiles_products(variant: str) -> None:
    """Q6_K rows read where they lie (random blocks: every low and high bit pattern, int8
    scales of both signs, d of either sign, one subnormal) give the products of the same rows'
    codes (qmm.codes: q - 32, a half group's scale d sc) in the F_I8H tiles bit for bit, in one
    row block and two, at every row count."""
    kern = variant_kernels(variant)
    rng = np.random.default_rng(7)
    n, k = 96, 512
    raw = rng.integers(0, 256, (n, k // 256 * 210), dtype=np.uint8)
    blocks = raw.reshape(n, k // 256, 210)
    d = rng.uniform(2.0**-14, 2.0**-9, (n, k // 256)) * rng.choice([-1, 1], (n, k // 256))
    d[0, 0] = 2.0**-20
    blocks[..., 208:] = d.astype(np.float16).view(np.uint8).reshape(n, k // 256, 2)
    c, dd, m = qmm.codes(kern.lib, 14, raw, k)
    x = (torch.randn(70, k, generator=torch.Generator().manual_seed(5))).to(torch.bfloat16)
    want = kern.tiles(quant.pack_i8(c, dd, m, 2), 2, n, k).matmul(x)
    assert want.isfinite().all() and c.min() == -32 and c.max() == 31
    one = kern.file_rows([raw], 8, k)
    two = kern.file_rows([raw[:16], raw[16:].copy()], 8, k)
    for size in (1, 3, 70):
        for mat in (one, two):
            got = torch.cat([mat.matmul(x[i:i + size].contiguous()) for i in range(0, 70, size)])
            assert torch.equal(got, want), size


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_files_own_q4_k_rows_give_the_4_bit_tiles_products(variant: str) -> None:
    """Q4_K rows read where they lie (random blocks: d and dmin of either sign, one subnormal,
    one zero; every 6-bit scale and min pattern) give the products of the same rows split and
    packed into the 4-bit tiles (split_blocks, pack_q4: the scales and offsets rounded to f16)
    bit for bit, in one row block and two, at every row count; rows not whole super-blocks
    are refused."""
    import gguf

    kern = variant_kernels(variant)
    rng = np.random.default_rng(6)
    n, k = 96, 512
    raw = rng.integers(0, 256, (n, k // 256 * 144), dtype=np.uint8)
    blocks = raw.reshape(n, k // 256, 144)
    d = (rng.uniform(2.0**-12, 2.0**-6, (n, k // 256, 2)) * rng.choice([-1, 1], (n, k // 256, 2)))
    d[0, 0, 0], d[1, 1, 1] = 2.0**-20, 0.0
    blocks[..., :4] = d.astype(np.float16).view(np.uint8).reshape(n, k // 256, 4)
    t = gguf.ReaderTensor(name="w", tensor_type=gguf.GGMLQuantizationType.Q4_K,
                          shape=np.array([k, n], np.uint64), n_elements=n * k,
                          n_bytes=raw.nbytes, data_offset=0, data=raw, field=None)
    codes = quant.split_blocks(t)
    want_x = (torch.randn(70, k, generator=torch.Generator().manual_seed(4))).to(torch.bfloat16)
    want = kern.tiles(quant.pack_q4(codes), 0, n, k).matmul(want_x)
    assert want.isfinite().all()
    one = kern.file_rows([raw], 7, k)
    two = kern.file_rows([raw[:48], raw[48:].copy()], 7, k)
    for size in (1, 3, 70):
        for mat in (one, two):
            got = torch.cat([mat.matmul(want_x[i:i + size].contiguous())
                             for i in range(0, 70, size)])
            assert torch.equal(got, want), size
    with pytest.raises(ValueError, match="row blocks"):
        kern.file_rows([raw[:, :72]], 7, 256 + 32)


def test_codes_outside_a_formats_range_are_refused() -> None:
    """The builds' integer sums are exact only for each format's codes (AVX2 takes Q6_K's as
    c + 32 into vpmaddubsw, and Q5's as unsigned): pack_i8 refuses any other."""
    d, m = np.ones((16, 2), F32), np.zeros((16, 1), F32)
    for fmt, bad in ((2, 32), (2, -33), (3, -1), (3, 32)):
        c = np.zeros((16, 32), np.int8)
        c[3, 5] = bad
        with pytest.raises(ValueError, match=f"tile format {fmt} holds codes"):
            quant.pack_i8(c, d, m if fmt == 3 else np.zeros_like(m), fmt)
    quant.pack_i8(np.full((16, 32), -32, np.int8), d, np.zeros((16, 1), F32), 2)


def test_unpacked_weights_are_the_codes_times_the_scales() -> None:
    """tile_codes inverts both packs; tile_weights is d c + m."""
    for case in CASES:
        fmt, tiles, c, d, m = make_tiles(case, 32, 64, seed=2)
        assert np.array_equal(quant.tile_codes(tiles.numpy(), fmt), c)
        want = c.reshape(32, 4, 16).astype(F32) * d.reshape(32, 4, 1) + np.repeat(m, 2, 1)[..., None]
        assert np.array_equal(quant.tile_weights(tiles, fmt).numpy(), want.reshape(32, 64))


@pytest.mark.parametrize("variant", VARIANTS)
def test_non_finite_activations_give_nan_and_refusals(variant: str) -> None:
    kern = variant_kernels(variant)
    fmt, tiles, *_ = make_tiles("q8_0", 16, 64)
    mat = kern.tiles(tiles, fmt, 16, 64)
    x = torch.ones(3, 64, dtype=torch.bfloat16)
    x[1, 3] = float("inf")
    x[2, 40] = float("nan")
    y = mat.matmul(x)
    assert y[0].isfinite().all() and y[1:].isnan().all()
    assert mat.matmul(torch.zeros(0, 64, dtype=torch.bfloat16)).shape == (0, 16)
    with pytest.raises(ValueError):
        mat.matmul(torch.zeros(2, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        kern.tiles(tiles, 2, 16, 64)  # another format's block size
    with pytest.raises(ValueError):
        kern.tiles(tiles[:, :1].contiguous(), fmt, 16, 64)
