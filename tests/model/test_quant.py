"""Packed 4-bit weights, for every packed type: the weights each 4-bit layout holds equal
gguf-py's dequantization up to the rounding of its scale dtype (our tiles, csrc/i8act.c: f16
scales and offsets; torch's int4: scale and zero in the compute dtype); torch's int4 kernel
times the identity gives those weights, and large chunks read the same numbers through the
unpacked path; our tiles multiply through 8-bit activations, so their products are checked
against the exact product within that rounding's error (kernel_variants.act8_tolerance) and
bit for bit against themselves at any row count; mixed-type layers still fuse. Dense bf16
weights: our row-invariant kernel (csrc/bf16_gemm.c). Our kernels' checks run in every variant
(tests/model/kernel_variants.py): every build packs 4-bit weights in our tiles; builds without
AVX512-BF16 have no bf16 kernel, and there F.linear must take over; without kernels
(RADIXSERVE_KERNELS=0), torch's int4 layout."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from radixserve.model.quant import (
    DENSE_FROM_ROWS, PACKED_TYPES, Codes, ConcatLinear, DenseLinear, Int4Linear, Linear, Q4Linear,
    packed_linear, split_blocks, tile_layout_known, tile_weights,
)
from tests.model import kernel_variants
from tests.model.kernel_variants import (
    HAS, NO_KERNELS, VARIANTS, act8_tolerance, permuted_lanes, variant_kernels,
)

variant = kernel_variants.variant  # the fixture: a test in each variant in turn

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
    """torch's int4 layout (Int4Linear): its kernel times the identity is gguf-py's weights
    up to bf16 roundings of scale, zero and output, and the unpack is the kernel's values."""
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


# the tests of the bf16 kernel's own properties run on the build that has it; the other
# builds' fallback (F.linear) is checked once a variant below
ON_BF16 = pytest.mark.parametrize("variant", ["avx512bf16"], indirect=True)


def q4_here(kern) -> None:
    """The kernels under test (`kern`: the `variant` fixture's) pack 4-bit weights in our
    tiles: every build does, and must (this project's machines have a compiler, so a missing
    build fails rather than skips)."""
    assert kern is not None, "the kernels did not build (compiler?)"
    lin = packed_linear(split_blocks(raw_tensor(Q.Q4_1, seed=7)), None, torch.bfloat16, kern)
    assert isinstance(lin, Q4Linear) and lin.route == "q4-tiles", kern.variant


def f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda q: q.name)
def test_q4_tiles_hold_the_f16_maps_and_multiply_within_8bit_activations(variant: str,
                                                                           qtype: Q):
    """The tiles hold scale q + offset with scale and offset rounded to f16 (tile_weights, f32;
    weight() its bf16): Q4_0's and Q4_1's are the file's own f16s, so those are gguf-py's
    weights exactly; Q4_K's scale d sc and offset dmin mn round to f16. The kernel's products,
    few rows and many, are within 8-bit activations' error of the exact product with those
    weights."""
    kern = variant_kernels(variant)
    q4_here(kern)
    t = raw_tensor(qtype, seed=int(qtype))
    ref = gguf.quants.dequantize(t.data, qtype).reshape(N, K).astype(np.float32)
    codes = split_blocks(t)
    lin = packed_linear(codes, None, torch.bfloat16, kern)
    assert isinstance(lin, Q4Linear)
    held = Codes(codes.q, f16(codes.scale), f16(codes.offset)).dequantize()
    assert np.array_equal(tile_weights(lin.mat.tiles, 0).numpy(), held)
    assert torch.equal(lin.weight(), torch.from_numpy(held).to(torch.bfloat16))
    if qtype in (Q.Q4_0, Q.Q4_1):
        assert np.array_equal(held, ref)
    else:  # Q4_K's scale d * sc and offset dmin * mn round to f16 (11 bits)
        g = lambda a: np.repeat(a, 32, axis=1)  # noqa: E731
        tol = (codes.q * np.abs(g(codes.scale)) + np.abs(g(codes.offset))) * 2.0**-11 * 1.01
        assert (np.abs(held - ref) <= tol + 1e-12).all()
        assert np.abs(held - ref).max() > 0  # f16 really rounds: the tolerance is not vacuous
    g = torch.Generator().manual_seed(int(qtype))
    x = torch.randn(DENSE_FROM_ROWS + 5, K, generator=g).to(torch.bfloat16)
    w = torch.from_numpy(held)
    want, tol = act8_tolerance(x, w)
    for rows in (1, 3, x.shape[0]):  # the kernel itself: lin() too, as it never switches
        y = lin.mat.matmul(x[:rows]).double()
        assert torch.equal(lin(x[:rows]).double(), y)
        assert ((y - want[:rows]).abs() <= tol[:rows]).all()
    wrong, _ = act8_tolerance(x, permuted_lanes(w))  # a lane slip exceeds the tolerance
    assert ((y - wrong).abs() > tol).any()


def test_q4_layout_only_where_it_holds_the_weights(variant: str):
    """Scales beyond f16's range, or f32 compute: torch's int4 layout (bf16 / f32 scales), never
    silently wrong f16 ones; rows not in tiles of 16 (neither layout holds them): dense (the
    loader sends those to qmm.c's blocks first where it has our kernels:
    tests/model/test_routes.py). Otherwise our tiles, in every build."""
    kern = variant_kernels(variant)
    q4_here(kern)
    codes = split_blocks(raw_tensor(Q.Q4_1, seed=7))
    assert isinstance(packed_linear(codes, None, torch.bfloat16, kern), Q4Linear)
    assert isinstance(packed_linear(codes, None, torch.float32, kern), Int4Linear)
    odd = codes.rows(np.arange(N - 8))
    dense = packed_linear(odd, None, torch.bfloat16, kern)
    assert isinstance(dense, DenseLinear)
    assert torch.equal(dense.weight(), torch.from_numpy(odd.dequantize()).to(torch.bfloat16))
    big = split_blocks(raw_tensor(Q.Q4_1, seed=7))
    big.scale[3, 2] = 1e6  # beyond f16's 65504
    lin = packed_linear(big, None, torch.bfloat16, kern)
    assert isinstance(lin, Int4Linear)
    assert torch.isfinite(lin(torch.ones(1, K, dtype=torch.bfloat16))).all()


def test_without_kernels_4bit_weights_take_torch_int4():
    """RADIXSERVE_KERNELS=0: no tiles, so torch's int4 layout at bf16 as at f32."""
    kern = NO_KERNELS.load()
    assert kern is None
    codes = split_blocks(raw_tensor(Q.Q4_1, seed=7))
    for dtype in (torch.bfloat16, torch.float32):
        lin = packed_linear(codes, None, dtype, kern)
        assert isinstance(lin, Int4Linear) and lin.route == "torch-int4", dtype


def q4_or_int4(kind: str, codes, bias, kern):
    """torch's int4 layout ("int4"), or what packed_linear picks ("q4"): our tiles, in every
    variant."""
    if kind == "int4":
        return Int4Linear(codes, bias, torch.bfloat16)
    lin = packed_linear(codes, bias, torch.bfloat16, kern)
    assert isinstance(lin, Q4Linear)
    return lin


# torch's int4 layout once; packed_linear's choice in every variant of our kernels
KINDS = pytest.mark.parametrize("kind,variant", [("int4", "avx512bf16"),
                                                 *(("q4", v) for v in VARIANTS)],
                                indirect=["variant"])


@KINDS
def test_small_and_large_batches_use_the_same_weights(kind: str, variant: str):
    kern = variant_kernels(variant)
    t = raw_tensor(Q.Q4_1, seed=3)
    lin = q4_or_int4(kind, split_blocks(t), torch.randn(N).to(torch.bfloat16), kern)
    x = torch.randn(DENSE_FROM_ROWS + 5, K).to(torch.bfloat16)
    big = lin(x)  # int4: dense GEMM on unpacked weights; q4: the kernel's many-rows path
    small = torch.cat([lin(x[i : i + 1]) for i in range(x.shape[0])])  # the 4-bit kernel
    if isinstance(lin, Q4Linear):  # every row the same bits however many rows share the call
        assert torch.equal(big, small)
        # the tiles' own weights (f32), through 8-bit activations, then the bias add's bf16
        # rounding; a wrong code, scale or layout errs by the size of the values themselves
        xw, tol = act8_tolerance(x, tile_weights(lin.mat.tiles, 0))
        ref = xw + lin.bias.double()
        tol = tol + ref.abs() * 2.0**-8
    else:
        xw = torch.nn.functional.linear(x.float(), lin.weight().float()).double()
        ref = xw + lin.bias.double()
        # bf16 roundings only (the int4 kernel rounds partial sums too: ~2 ulps of the row's
        # scale); a wrong code, scale or layout errs by the size of the values themselves
        tol = xw.abs().amax(1, keepdim=True) * 2.0**-6
    for y in (big, small):
        assert y.dtype == torch.bfloat16 and y.shape == (x.shape[0], N)
        assert ((y.double() - ref).abs() <= tol).all()


@KINDS
def test_concat_linear_of_mixed_types(kind: str, variant: str):
    kern = variant_kernels(variant)
    packed = q4_or_int4(kind, split_blocks(raw_tensor(Q.Q4_0, seed=5)), None, kern)
    dense = DenseLinear(torch.randn(64, K).to(torch.bfloat16), None, kern)
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
# few rows (1-4: the kernel prefetches tiles ahead) and more, both sides of quant.py's
# DENSE_FROM_ROWS (which Q4Linear ignores), and more rows than one of the kernel's row blocks
# (128)
Q4_ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 16, 63, 64, 95, 96, 97, 128, 200, 513]


def random_q4(n: int, k: int, seed: int, kern) -> tuple[Q4Linear, torch.Tensor, torch.Tensor]:
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
    return Q4Linear(codes, None, kern), w, x


@pytest.mark.parametrize("n,k", Q4_SHAPES, ids=lambda v: str(v))
def test_q4_many_rows_equal_each_row_alone_bitwise(variant: str, n: int, k: int):
    """Deterministic mode's premise: a row's product through the 4-bit tiles is the same bits
    whatever the number of rows multiplied with it (the few-row prefetch, the row blocks; each
    row's activations quantized on their own) and the number of threads, in every build."""
    kern = variant_kernels(variant)
    q4_here(kern)
    lin, _, x = random_q4(n, k, seed=n + k, kern=kern)
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


@pytest.mark.parametrize("n,k", Q4_SHAPES, ids=lambda v: str(v))
def test_q4_many_rows_within_8bit_activations_of_f64(variant: str, n: int, k: int):
    """The many-rows product against f64 with the kernel's own weights, rows of magnitudes
    2^-6 to 2^6: within 8-bit activations' error (act8_tolerance: each group of 32 rounded to
    amax / 127 steps), which the same weights a lane off exceed."""
    kern = variant_kernels(variant)
    q4_here(kern)
    lin, w, x = random_q4(n, k, seed=2 * n + k, kern=kern)
    y = lin.kernel(x).double()
    ref, tol = act8_tolerance(x, w)
    assert ((y - ref).abs() <= tol).all()
    wrong, _ = act8_tolerance(x, permuted_lanes(w))
    assert ((y - wrong).abs() > tol).any()



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
    kern = variant_kernels(variant)
    g = torch.Generator().manual_seed(5)
    for n, k in ((960, 576), (576, 1536)):
        if kind == "int4":
            rng = np.random.default_rng(n)
            codes = Codes(rng.integers(0, 16, (n, k)).astype(np.uint8),
                          (rng.random((n, k // 32)) * 0.01).astype(np.float32),
                          (-rng.random((n, k // 32)) * 0.08).astype(np.float32))
            lin: Linear = Int4Linear(codes, None, torch.bfloat16)
        else:
            lin = DenseLinear((torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16), None,
                              kern)
            if not bf16_here(kern):  # F.linear: not row-invariant, deterministic mode refuses it
                assert lin.mat is None and not lin.row_invariant
                continue
            assert lin.mat is not None  # our kernel, not F.linear
        x = torch.randn(max(ROW_COUNTS), k, generator=g).to(torch.bfloat16)
        assert_rows_alone(lambda a, lin=lin: lin(a, invariant=True), x, ROW_COUNTS)


def bf16_here(kern) -> bool:
    """Whether the kernels under test (`kern`) have our bf16 kernel: the AVX512-BF16 build
    does, and must (its absence fails rather than skips); builds without it must leave bf16
    weights to F.linear (not row-invariant), checked here: then False."""
    assert kern is not None, "the kernels did not build (compiler?)"
    assert kern.has_bf16_gemm == HAS[kern.variant][0], f"bf16 kernel in the {kern.variant} build?"
    if kern.has_bf16_gemm:
        return True
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 33, generator=g).to(torch.bfloat16)
    lin = DenseLinear(w, None, kern)
    assert lin.mat is None and lin.w is w and not lin.row_invariant
    x = torch.randn(5, 33, generator=g).to(torch.bfloat16)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, w))
    with pytest.raises(ValueError, match="bf16 kernel needs"):
        kern.bf16(torch.zeros(2, 32, 32, 2, dtype=torch.bfloat16), 40, 33)
    return False


# the default model's matrices, n and k off the 32-row panels and 32-weight padding (odd k:
# a pair half-padded), and a single weight
BF16_SHAPES = [(960, 576), (576, 1536), (48, 64), (40, 40), (100, 33), (17, 7), (1, 1)]


def random_dense(n: int, k: int, seed: int,
                 kern) -> tuple[DenseLinear, torch.Tensor, torch.Tensor]:
    """A bf16 DenseLinear on our kernel, its weights, and bf16 rows of varied magnitudes."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    scale = torch.exp2(torch.randint(-6, 7, (max(ROW_COUNTS), 1), generator=g).float())
    x = (torch.randn(max(ROW_COUNTS), k, generator=g) * scale).to(torch.bfloat16)
    lin = DenseLinear(w, None, kern)
    assert lin.mat is not None and lin.w is None  # the panels are the only copy kept
    return lin, w, x


@ON_BF16
@pytest.mark.parametrize("n,k", BF16_SHAPES, ids=lambda v: str(v))
def test_bf16_many_rows_equal_each_row_alone_bitwise(variant: str, n: int, k: int):
    """Deterministic mode's premise for dense weights: a row's product through the bf16 kernel
    is the same bits whatever the number of rows multiplied with it (its few- and many-rows
    paths, every remainder of its row blocks) and the number of threads."""
    kern = variant_kernels(variant)
    assert bf16_here(kern)
    lin, _, x = random_dense(n, k, seed=n + k, kern=kern)
    assert_rows_alone(lambda a: lin(a, invariant=True), x, ROW_COUNTS)


@ON_BF16
@pytest.mark.parametrize("n,k", BF16_SHAPES, ids=lambda v: str(v))
def test_bf16_within_bf16_of_f64(variant: str, n: int, k: int):
    """Against f64: the bf16 output rounding, plus f32 sums (at most one rounding per product,
    relative to the products' magnitudes: outputs near 0). The same weights with the two halves
    of every pair swapped (a layout slip) fail that tolerance."""
    kern = variant_kernels(variant)
    assert bf16_here(kern)
    lin, w, x = random_dense(n, k, seed=2 * n + k, kern=kern)
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
        wrong = DenseLinear(swapped, None, kern)(x).double()
        assert ((wrong - ref).abs() > tol).any()


def test_dense_linear_paths(variant: str):
    """bf16: our kernel (F.linear in builds without it), W unpacked bit for bit, the bias added
    after, any leading dims; f32 (and f16): torch's F.linear on the weights as given."""
    kern = variant_kernels(variant)
    has_bf16 = bf16_here(kern)
    g = torch.Generator().manual_seed(11)
    w = torch.randn(70, 45, generator=g).to(torch.bfloat16)
    b = torch.randn(70, generator=g).to(torch.bfloat16)
    lin = DenseLinear(w, b, kern)
    assert torch.equal(lin.weight(), w)
    x = torch.randn(2, 5, 45, generator=g).to(torch.bfloat16)
    y = lin(x)
    if not has_bf16:
        assert lin.mat is None and torch.equal(y, torch.nn.functional.linear(x, w, b))
        return
    assert lin.mat is not None and lin.nbytes == lin.mat.panels.nbytes + b.nbytes
    assert y.shape == (2, 5, 70) and y.dtype == torch.bfloat16
    assert torch.equal(y, DenseLinear(w, None, kern)(x.view(10, 45)).view(2, 5, 70) + b)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert ((y.float() - ref).abs() <= ref.abs() * 2.0**-7 + 1e-2).all()
    for dtype in (torch.float32, torch.float16):
        wd = w.to(dtype)
        plain = DenseLinear(wd, b.to(dtype), kern)
        assert plain.mat is None and plain.weight() is wd
        assert torch.equal(plain(x.to(dtype)),
                           torch.nn.functional.linear(x.to(dtype), wd, b.to(dtype)))


def test_every_build_packs_4bit_tiles_and_only_avx512bf16_has_bf16_panels(variant: str):
    """Every build packs 4-bit weights in our tiles (q4_here); where the build has no bf16
    panels (avx512, avxvnni, avx2, generic), bf16 weights fall back to F.linear (bf16_here);
    the AVX512-BF16 build has both."""
    kern = variant_kernels(variant)
    q4_here(kern)
    assert bf16_here(kern) == (variant == "avx512bf16")
