"""Packed 4-bit weights: what each 4-bit kernel multiplies (ours, csrc/q4_gemv.c, and torch's
int4) equals gguf-py's dequantization up to the rounding of its scale dtype, for every packed
type; large chunks read the same numbers through the unpacked path; mixed-type layers still
fuse. Our kernels' checks run in every variant (tests/model/kernel_variants.py): builds without
AVX512-BF16 have no 4-bit or bf16 kernel, and there the torch paths must take over."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from radixserve.model.kernels import kernels
from radixserve.model.quant import (
    DENSE_FROM_ROWS, PACKED_TYPES, Codes, ConcatLinear, DenseLinear, Int4Linear, Linear, Q4Linear,
    packed_linear, split_blocks, tile_layout_known,
)
from tests.model import kernel_variants
from tests.model.kernel_variants import HAS, VARIANTS

variant = kernel_variants.variant  # the fixture: a test's kernels() in each variant in turn

Q = gguf.GGMLQuantizationType
N, K = 128, 512  # rows, row length (Q4_K needs K % 256 == 0)


def raw_tensor(qtype: Q, seed: int) -> SimpleNamespace:
    """A random tensor of `qtype` as the GGUF reader gives it (shape reversed, raw blocks)."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(N, K // block, size), dtype=np.uint8)
    f16 = lambda a: a.astype(np.float16).view(np.uint8).reshape(*a.shape[:-1], -1)  # noqa: E731
    scales = rng.uniform(-0.05, 0.05, size=(N, K // block, 2))
    n_f16 = 1 if qtype == Q.Q4_0 else 2  # d (and m / dmin) lead every block
    raw[..., : 2 * n_f16] = f16(scales[..., :n_f16])
    return SimpleNamespace(name=f"w.{qtype.name}", tensor_type=qtype,
                           shape=np.array([K, N]), data=raw.reshape(N, -1))


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda q: q.name)
def test_packed_times_identity_equals_gguf_dequantization(qtype: Q):
    t = raw_tensor(qtype, seed=int(qtype))
    ref = gguf.quants.dequantize(t.data, qtype).reshape(N, K).astype(np.float32)
    codes = split_blocks(t)
    assert codes.q.min() >= 0 and codes.q.max() <= 15
    # the affine form is gguf-py's formula rearranged: equal in f32 up to one rounding
    np.testing.assert_allclose(codes.dequantize(), ref, rtol=0, atol=1e-6)

    lin = Int4Linear(codes, None, torch.bfloat16)
    eye = torch.eye(K, dtype=torch.bfloat16)
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, lin.packed, 32, lin.scales_zeros)
    got = kernel.t().float().numpy()
    # bf16 rounding of scale and zero (= offset + 8 scale), then of the product written as bf16
    g = lambda a: np.repeat(a, 32, axis=1)  # noqa: E731
    zero = np.abs(g(codes.offset + 8 * codes.scale))
    tol = (np.abs(codes.q.astype(np.float32) - 8) * np.abs(g(codes.scale)) + zero
           + np.abs(ref)) * 2.0**-8 * 1.01
    assert (np.abs(got - ref) <= tol + 1e-12).all()
    assert np.abs(got - ref).max() > 0  # bf16 really rounds: the tolerance is not vacuous
    # the prefill path unpacks to the kernel's own values, bit for bit
    assert tile_layout_known()
    assert torch.equal(lin.weight(), kernel.t())


# the tests of a tile kernel's own properties run on the build that has the tiles; the other
# builds' fallback (torch's int4 layout, F.linear) is checked once a variant below
ON_TILES = pytest.mark.parametrize("variant", ["avx512bf16"], indirect=True)


def q4_here() -> bool:
    """Whether the kernels under test (kernels(): the `variant` fixture's) have our Q4 kernel:
    the AVX512-BF16 build does, and must (this project's machines have a compiler and
    AVX512-BF16, so its absence fails rather than skips). Builds without it must fall back to
    torch's int4 layout and kernel, checked here: then False."""
    kern = kernels()
    assert kern is not None, "the kernels did not build (compiler?)"
    assert kern.has_q4 == HAS[kern.variant][0], f"Q4 kernel in the {kern.variant} build?"
    if kern.has_q4:
        return True
    codes = split_blocks(raw_tensor(Q.Q4_1, seed=7))
    assert isinstance(packed_linear(codes, None, torch.bfloat16), Int4Linear)
    with pytest.raises(ValueError, match="q4 kernels need"):
        Q4Linear(codes, None, kern)
    return False


@ON_TILES
@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda q: q.name)
def test_q4_kernel_times_identity_equals_gguf_dequantization(variant: str, qtype: Q):
    assert q4_here()
    t = raw_tensor(qtype, seed=int(qtype))
    ref = gguf.quants.dequantize(t.data, qtype).reshape(N, K).astype(np.float32)
    codes = split_blocks(t)
    lin = packed_linear(codes, None, torch.bfloat16)
    assert isinstance(lin, Q4Linear)
    # the kernel itself (lin() would send K >= DENSE_FROM_ROWS rows to the unpack path)
    got = lin.mat.matmul(torch.eye(K, dtype=torch.bfloat16)).t().float().numpy()
    unpacked = lin.weight().float().numpy()  # what large chunks multiply
    bf16_ref = torch.from_numpy(ref).to(torch.bfloat16).float().numpy()
    if qtype in (Q.Q4_0, Q.Q4_1):
        # f16 scales and offsets are the file's own: only the bf16 output rounds, so every
        # weight is bf16(w) (the kernel's f32 partial sums are exact here)
        assert np.array_equal(got, bf16_ref) and np.array_equal(unpacked, bf16_ref)
        tol = np.abs(ref) * 2.0**-8 + 1e-12
    else:  # Q4_K's scale d * sc rounds to f16 (11 bits) too
        g = lambda a: np.repeat(a, 32, axis=1)  # noqa: E731
        tol = ((codes.q * np.abs(g(codes.scale)) + np.abs(g(codes.offset))) * 2.0**-11
               + np.abs(ref) * 2.0**-8) * 1.01 + 1e-12
    assert (np.abs(got - ref) <= tol).all() and (np.abs(unpacked - ref) <= tol).all()
    assert np.abs(got - ref).max() > 0  # bf16 really rounds: the tolerance is not vacuous


def test_q4_layout_only_where_it_holds_the_weights(variant: str):
    """Scales beyond f16's range, or f32 compute: torch's int4 layout (bf16 / f32 scales), never
    silently wrong f16 ones; rows not in tiles of 16 (neither layout holds them): dense. Without
    the Q4 kernel (builds without AVX512-BF16), torch's int4 layout for all but the odd rows."""
    has_q4 = q4_here()
    codes = split_blocks(raw_tensor(Q.Q4_1, seed=7))
    assert isinstance(packed_linear(codes, None, torch.bfloat16),
                      Q4Linear if has_q4 else Int4Linear)
    assert isinstance(packed_linear(codes, None, torch.float32), Int4Linear)
    odd = codes.rows(np.arange(N - 8))
    dense = packed_linear(odd, None, torch.bfloat16)
    assert isinstance(dense, DenseLinear)
    assert torch.equal(dense.weight(), torch.from_numpy(odd.dequantize()).to(torch.bfloat16))
    big = split_blocks(raw_tensor(Q.Q4_1, seed=7))
    big.scale[3, 2] = 1e6  # beyond f16's 65504
    lin = packed_linear(big, None, torch.bfloat16)
    assert isinstance(lin, Int4Linear)
    assert torch.isfinite(lin(torch.ones(1, K, dtype=torch.bfloat16))).all()


def q4_or_int4(kind: str, codes, bias):
    """torch's int4 layout ("int4"), or what packed_linear picks ("q4"): our Q4 kernel where
    the variant under test has it, torch's int4 layout again where not."""
    if kind == "int4":
        return Int4Linear(codes, bias, torch.bfloat16)
    lin = packed_linear(codes, bias, torch.bfloat16)
    assert isinstance(lin, Q4Linear if q4_here() else Int4Linear)
    return lin


# torch's int4 layout once; packed_linear's choice in every variant of our kernels
KINDS = pytest.mark.parametrize("kind,variant", [("int4", "avx512bf16"),
                                                 *(("q4", v) for v in VARIANTS)],
                                indirect=["variant"])


@KINDS
def test_small_and_large_batches_use_the_same_weights(kind: str, variant: str):
    t = raw_tensor(Q.Q4_1, seed=3)
    lin = q4_or_int4(kind, split_blocks(t), torch.randn(N).to(torch.bfloat16))
    x = torch.randn(DENSE_FROM_ROWS + 5, K).to(torch.bfloat16)
    big = lin(x)  # int4: dense GEMM on unpacked weights; q4: the kernel's many-rows path
    small = torch.cat([lin(x[i : i + 1]) for i in range(x.shape[0])])  # the 4-bit kernel
    if isinstance(lin, Q4Linear):  # every row the same bits however many rows share the call
        assert torch.equal(big, small)
    xw = torch.nn.functional.linear(x.float(), lin.weight().float())
    ref = xw + lin.bias.float()
    for y in (big, small):
        assert y.dtype == torch.bfloat16 and y.shape == (x.shape[0], N)
        # bf16 roundings only (the int4 kernel rounds partial sums too: ~2 ulps of the row's
        # scale); a wrong code, scale or layout errs by the size of the values themselves
        scale = xw.abs().amax(1, keepdim=True)
        assert ((y.float() - ref).abs() <= scale * 2.0**-6).all()


@KINDS
def test_concat_linear_of_mixed_types(kind: str, variant: str):
    packed = q4_or_int4(kind, split_blocks(raw_tensor(Q.Q4_0, seed=5)), None)
    dense = DenseLinear(torch.randn(64, K).to(torch.bfloat16))
    both = ConcatLinear([packed, dense])
    x = torch.randn(3, K).to(torch.bfloat16)
    assert both.n_out == N + 64
    assert torch.equal(both(x), torch.cat([packed(x), dense(x)], dim=1))
    assert torch.equal(both.weight(), torch.cat([packed.weight(), dense.weight()]))
    assert both.nbytes == packed.nbytes + dense.nbytes


def test_other_types_are_rejected_by_the_packer():
    t = raw_tensor(Q.Q4_0, seed=1)
    t.tensor_type = Q.Q8_0
    with pytest.raises(ValueError, match="not a packed 4-bit type"):
        split_blocks(t)


# the default model's matrices, and k of one or two groups (no group loop to speak of)
Q4_SHAPES = [(960, 576), (3072, 576), (576, 1536), (48, 64), (32, 32)]
# every remainder of the kernel's rows in flight, both sides of its many-rows switch and of
# quant.py's DENSE_FROM_ROWS, and more rows than one of the kernel's row blocks
Q4_ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 16, 63, 64, 95, 96, 97, 128, 200, 513]


def random_q4(n: int, k: int, seed: int) -> tuple[Q4Linear, torch.Tensor, torch.Tensor]:
    """A Q4Linear of random codes, its weights in f64 (exact: its scales and offsets are f16
    already), and bf16 rows of varied magnitudes for it."""
    g = torch.Generator().manual_seed(seed)
    codes = Codes(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8).numpy(),
                  (torch.rand(n, k // 32, generator=g) * 0.02).half().float().numpy(),
                  (torch.randn(n, k // 32, generator=g) * 0.05).half().float().numpy())
    scale = torch.exp2(torch.randint(-6, 7, (max(Q4_ROWS), 1), generator=g).float())
    x = (torch.randn(max(Q4_ROWS), k, generator=g) * scale).to(torch.bfloat16)
    w = (torch.from_numpy(codes.q).double() * torch.from_numpy(codes.scale).double()
         .repeat_interleave(32, 1) + torch.from_numpy(codes.offset).double()
         .repeat_interleave(32, 1))
    return Q4Linear(codes, None, kernels()), w, x


@ON_TILES
@pytest.mark.parametrize("n,k", Q4_SHAPES, ids=lambda v: str(v))
def test_q4_many_rows_equal_each_row_alone_bitwise(variant: str, n: int, k: int):
    """Deterministic mode's premise: a row's product through the 4-bit kernel is the same bits
    whatever the number of rows multiplied with it (the kernel's few- and many-rows paths) and
    the number of threads."""
    assert q4_here()
    lin, _, x = random_q4(n, k, seed=n + k)
    assert_rows_alone(lin.kernel, x, Q4_ROWS)


def assert_rows_alone(mul, x: torch.Tensor, row_counts) -> None:
    """Every row of mul(x[:rows]) is bitwise mul(x[i:i+1]), for each row count, on 1 and 2
    threads."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([mul(x[i : i + 1]) for i in range(max(row_counts))])
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in row_counts:
                y = mul(x[:rows])
                assert y.shape == (rows, alone.shape[1])
                assert torch.equal(y.view(torch.int16), alone[:rows].view(torch.int16)), (
                    f"{rows} rows, {threads} threads")
    finally:
        torch.set_num_threads(before)


@ON_TILES
@pytest.mark.parametrize("n,k", Q4_SHAPES, ids=lambda v: str(v))
def test_q4_many_rows_within_bf16_of_f64(variant: str, n: int, k: int):
    """The many-rows product against f64 with the kernel's own weights: bf16 output rounding,
    plus f32 sums relative to the products' magnitudes (outputs near 0)."""
    assert q4_here()
    lin, w, x = random_q4(n, k, seed=2 * n + k)
    y = lin.kernel(x).double()
    ref = x.double() @ w.T
    mag = x.double().abs() @ w.abs().T
    assert ((y - ref).abs() <= ref.abs() * 2.0**-8 + mag * 2.0**-16).all()
    assert (y - ref).abs().max() > 0  # bf16 really rounds: the tolerance is not vacuous



ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 16, 63, 64, 95, 96, 97, 128, 200, 513)


@pytest.mark.parametrize("kind,variant", [("int4", "avx512bf16"),
                                          *(("dense", v) for v in VARIANTS)],
                         indirect=["variant"])
def test_torch_kernels_deterministic_mode_keeps_are_row_invariant(kind: str, variant: str):
    """The other kernels deterministic mode runs, checked row by row on this build: torch's
    int4 kernel without its dense switch, and DenseLinear's bf16 path, our kernel
    (csrc/bf16_gemm.c; torch's bf16 GEMM fails this on torch 2.13, as does its f32 GEMM: f32 has
    no deterministic mode), on shapes of the default model's layers: every row of an M-row
    product equals the row alone, bitwise."""
    g = torch.Generator().manual_seed(5)
    for n, k in ((960, 576), (576, 1536)):
        if kind == "int4":
            rng = np.random.default_rng(n)
            codes = Codes(rng.integers(0, 16, (n, k)).astype(np.uint8),
                          (rng.random((n, k // 32)) * 0.01).astype(np.float32),
                          (-rng.random((n, k // 32)) * 0.08).astype(np.float32))
            lin: Linear = Int4Linear(codes, None, torch.bfloat16)
        else:
            lin = DenseLinear((torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16))
            if not bf16_here():  # F.linear: not row-invariant, deterministic mode refuses it
                assert lin.mat is None and not lin.row_invariant
                continue
            assert lin.mat is not None  # our kernel, not F.linear
        x = torch.randn(max(ROW_COUNTS), k, generator=g).to(torch.bfloat16)
        assert_rows_alone(lambda a, lin=lin: lin(a, invariant=True), x, ROW_COUNTS)


def bf16_here() -> bool:
    """Whether the kernels under test have our bf16 kernel: like the Q4 one (q4_here) the
    AVX512-BF16 build must; builds without it must leave bf16 weights to F.linear (not
    row-invariant), checked here: then False."""
    kern = kernels()
    assert kern is not None, "the kernels did not build (compiler?)"
    assert kern.has_bf16_gemm == HAS[kern.variant][1], f"bf16 kernel in the {kern.variant} build?"
    if kern.has_bf16_gemm:
        return True
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 33, generator=g).to(torch.bfloat16)
    lin = DenseLinear(w)
    assert lin.mat is None and lin.w is w and not lin.row_invariant
    x = torch.randn(5, 33, generator=g).to(torch.bfloat16)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, w))
    with pytest.raises(ValueError, match="bf16 kernel needs"):
        kern.bf16(torch.zeros(2, 32, 32, 2, dtype=torch.bfloat16), 40, 33)
    return False


# the default model's matrices, n and k off the 32-row panels and 32-weight padding (odd k:
# a pair half-padded), and a single weight
BF16_SHAPES = [(960, 576), (576, 1536), (48, 64), (40, 40), (100, 33), (17, 7), (1, 1)]


def random_dense(n: int, k: int, seed: int) -> tuple[DenseLinear, torch.Tensor, torch.Tensor]:
    """A bf16 DenseLinear on our kernel, its weights, and bf16 rows of varied magnitudes."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    scale = torch.exp2(torch.randint(-6, 7, (max(ROW_COUNTS), 1), generator=g).float())
    x = (torch.randn(max(ROW_COUNTS), k, generator=g) * scale).to(torch.bfloat16)
    lin = DenseLinear(w)
    assert lin.mat is not None and lin.w is None  # the panels are the only copy kept
    return lin, w, x


@ON_TILES
@pytest.mark.parametrize("n,k", BF16_SHAPES, ids=lambda v: str(v))
def test_bf16_many_rows_equal_each_row_alone_bitwise(variant: str, n: int, k: int):
    """Deterministic mode's premise for dense weights: a row's product through the bf16 kernel
    is the same bits whatever the number of rows multiplied with it (its few- and many-rows
    paths, every remainder of its row blocks) and the number of threads."""
    assert bf16_here()
    lin, _, x = random_dense(n, k, seed=n + k)
    assert_rows_alone(lambda a: lin(a, invariant=True), x, ROW_COUNTS)


@ON_TILES
@pytest.mark.parametrize("n,k", BF16_SHAPES, ids=lambda v: str(v))
def test_bf16_within_bf16_of_f64(variant: str, n: int, k: int):
    """Against f64: the bf16 output rounding, plus f32 sums (at most one rounding per product,
    relative to the products' magnitudes: outputs near 0). The same weights with the two halves
    of every pair swapped (a layout slip) fail that tolerance."""
    assert bf16_here()
    lin, w, x = random_dense(n, k, seed=2 * n + k)
    ref = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    tol = ref.abs() * 2.0**-8 + mag * (k + 1) * 2.0**-24
    for rows in (3, x.shape[0]):  # both paths
        y = lin(x[:rows]).double()
        assert ((y - ref[:rows]).abs() <= tol[:rows]).all()
    assert (y - ref).abs().max() > 0  # bf16 really rounds: the tolerance is not vacuous
    if k > 1:
        swapped = w.clone()
        swapped[:, : k // 2 * 2] = w[:, : k // 2 * 2].view(n, -1, 2).flip(-1).reshape(n, -1)
        wrong = DenseLinear(swapped)(x).double()
        assert ((wrong - ref).abs() > tol).any()


def test_dense_linear_paths(variant: str):
    """bf16: our kernel (F.linear in builds without it), W unpacked bit for bit, the bias added
    after, any leading dims; f32 (and f16): torch's F.linear on the weights as given."""
    has_bf16 = bf16_here()
    g = torch.Generator().manual_seed(11)
    w = torch.randn(70, 45, generator=g).to(torch.bfloat16)
    b = torch.randn(70, generator=g).to(torch.bfloat16)
    lin = DenseLinear(w, b)
    assert torch.equal(lin.weight(), w)
    x = torch.randn(2, 5, 45, generator=g).to(torch.bfloat16)
    y = lin(x)
    if not has_bf16:
        assert lin.mat is None and torch.equal(y, torch.nn.functional.linear(x, w, b))
        return
    assert lin.mat is not None and lin.nbytes == lin.mat.panels.nbytes + b.nbytes
    assert y.shape == (2, 5, 70) and y.dtype == torch.bfloat16
    assert torch.equal(y, DenseLinear(w)(x.view(10, 45)).view(2, 5, 70) + b)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert ((y.float() - ref).abs() <= ref.abs() * 2.0**-7 + 1e-2).all()
    for dtype in (torch.float32, torch.float16):
        wd = w.to(dtype)
        plain = DenseLinear(wd, b.to(dtype))
        assert plain.mat is None and plain.weight() is wd
        assert torch.equal(plain(x.to(dtype)),
                           torch.nn.functional.linear(x.to(dtype), wd, b.to(dtype)))


def test_builds_without_tiles_fall_back(variant: str):
    """Where the build has no 4-bit or bf16 tiles (avx512, avx2, generic), the 4-bit layout
    falls back to torch's int4 kernel and bf16 weights to F.linear (q4_here, bf16_here); the
    tile build has both."""
    assert q4_here() == bf16_here() == (variant == "avx512bf16")
