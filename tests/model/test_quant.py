"""Packed 4-bit weights: what each 4-bit kernel multiplies (ours, csrc/q4_gemv.c, and torch's
int4) equals gguf-py's dequantization up to the rounding of its scale dtype, for every packed
type; large chunks read the same numbers through the unpacked path; mixed-type layers still
fuse."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from radixserve.model.kernels import kernels
from radixserve.model.quant import (
    DENSE_FROM_ROWS, PACKED_TYPES, ConcatLinear, DenseLinear, Int4Linear, Q4Linear,
    packed_linear, split_blocks, tile_layout_known,
)

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


def require_q4() -> None:
    """Our Q4 kernel needs a C compiler and AVX512-BF16; this project's machines have both, so
    their absence fails rather than skips."""
    kern = kernels()
    assert kern is not None and kern.has_q4, "Q4 kernel unavailable (compiler? AVX512-BF16?)"


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda q: q.name)
def test_q4_kernel_times_identity_equals_gguf_dequantization(qtype: Q):
    require_q4()
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


def test_q4_layout_only_where_it_holds_the_weights():
    """Scales beyond f16's range, or f32 compute: torch's int4 layout (bf16 / f32 scales), never
    silently wrong f16 ones; rows not in tiles of 16 (neither layout holds them): dense."""
    require_q4()
    codes = split_blocks(raw_tensor(Q.Q4_1, seed=7))
    assert isinstance(packed_linear(codes, None, torch.bfloat16), Q4Linear)
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
    if kind == "int4":
        return Int4Linear(codes, bias, torch.bfloat16)
    require_q4()
    return packed_linear(codes, bias, torch.bfloat16)


@pytest.mark.parametrize("kind", ["int4", "q4"])
def test_small_and_large_batches_use_the_same_weights(kind: str):
    t = raw_tensor(Q.Q4_1, seed=3)
    lin = q4_or_int4(kind, split_blocks(t), torch.randn(N).to(torch.bfloat16))
    assert isinstance(lin, Int4Linear if kind == "int4" else Q4Linear)
    x = torch.randn(DENSE_FROM_ROWS + 5, K).to(torch.bfloat16)
    big = lin(x)  # dense GEMM on unpacked weights
    small = torch.cat([lin(x[i : i + 1]) for i in range(x.shape[0])])  # the 4-bit kernel
    xw = torch.nn.functional.linear(x.float(), lin.weight().float())
    ref = xw + lin.bias.float()
    for y in (big, small):
        assert y.dtype == torch.bfloat16 and y.shape == (x.shape[0], N)
        # bf16 roundings only (the int4 kernel rounds partial sums too: ~2 ulps of the row's
        # scale); a wrong code, scale or layout errs by the size of the values themselves
        scale = xw.abs().amax(1, keepdim=True)
        assert ((y.float() - ref).abs() <= scale * 2.0**-6).all()


@pytest.mark.parametrize("kind", ["int4", "q4"])
def test_concat_linear_of_mixed_types(kind: str):
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
