"""csrc/qmm.c on every CPU variant: products with weights in a GGUF type's own blocks.

Blocks are made here (random codes and scales written as the type's bytes): times the identity
the kernel must give gguf-py's dequantization, bit for bit after the bf16 output rounding for
every type on the builds without AVX512-BF16 (integer sums: d c exact, then + m rounded once, as
gguf-py rounds it) and for the symmetric types on AVX512-BF16; there the affine types (Q4_1,
Q5_1, Q4_K, Q5_K) compute d (128 + c) plus m - 128 d, within one f32 ulp or two of the weight,
which the bf16 output rounding hides almost always, so at most a few in ten thousand outputs may
differ by one bf16 step. A row's bits never depend on the rows or threads sharing the call."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from radixserve.model import qmm
from tests.model.kernel_variants import VARIANTS, variant_kernels

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.BF16, Q.F32]
AFFINE = {Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K}


def random_blocks(t: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """n rows of k weights in type t: random code bytes, finite random scales."""
    rng = np.random.default_rng(seed)
    bs, ts = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (n, k // bs * ts), dtype=np.uint8)
    b = raw.reshape(n, k // bs, ts)

    def f16(lo: float, hi: float, at: int) -> None:
        v = rng.uniform(lo, hi, b.shape[:2]) * rng.choice([-1, 1], b.shape[:2])
        b[..., at:at + 2] = v.astype(np.float16).view(np.uint8).reshape(*b.shape[:2], 2)

    if t in (Q.Q4_0, Q.Q5_0, Q.Q8_0):
        f16(1e-4, 0.05, 0)
    elif t in (Q.Q4_1, Q.Q5_1):
        f16(1e-4, 0.05, 0)
        f16(1e-3, 0.5, 2)
    elif t in (Q.Q4_K, Q.Q5_K):
        f16(1e-4, 0.01, 0)
        f16(1e-4, 0.01, 2)
    elif t == Q.Q6_K:
        f16(1e-4, 0.01, 208)
    elif t == Q.F16:
        raw[:] = rng.standard_normal((n, k)).astype(np.float16).view(np.uint8)
    elif t == Q.BF16:
        f = rng.standard_normal((n, k)).astype(np.float32).view(np.uint32) >> 16
        raw[:] = f.astype(np.uint16).view(np.uint8)
    elif t == Q.F32:
        raw[:] = rng.standard_normal((n, k)).astype(np.float32).view(np.uint8)
    return raw


def matrix(variant: str, t: Q, n: int = 50, k: int = 512) -> tuple[qmm.QuantMatrix, torch.Tensor]:
    raw = random_blocks(t, n, k)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, t).reshape(n, k).astype(np.float32))
    return qmm.QuantMatrix(variant_kernels(variant).lib, int(t), torch.from_numpy(raw), k), ref


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("variant", VARIANTS)
def test_identity_is_gguf_dequantization(variant: str, t: Q) -> None:
    m, ref = matrix(variant, t)
    y = m.matmul(torch.eye(m.k, dtype=torch.bfloat16)).t()
    want = ref.to(torch.bfloat16)
    diff = y != want
    if t in AFFINE and variant == "avx512bf16":
        # one bf16 step at most, and rarely (see the module docstring)
        step = (want.float().abs() * 2.0**-7).clamp(min=1e-30)
        assert ((y.float() - want.float()).abs() <= step).all()
        assert diff.sum().item() <= diff.numel() // 1000
    else:
        assert not diff.any(), f"{diff.sum().item()} of {diff.numel()} weights differ"
    # the f32 rows the kernel multiplies: gguf-py's values (the affine ones within an f32 ulp)
    rows = m.rows()
    if t in AFFINE:
        assert torch.allclose(rows, ref, rtol=2.0**-22, atol=0)
    else:
        assert torch.equal(rows, ref)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("variant", VARIANTS)
def test_rows_invariant_and_close(variant: str, t: Q) -> None:
    m, ref = matrix(variant, t)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(140, m.k, generator=g).to(torch.bfloat16)
    full = m.matmul(x)
    # 1 row, the few-rows path (2-4) and the many-rows path (5+, blocks of 128 rows, columns in
    # blocks of 6 and micro-tiles of 3, 50 columns leaving a block of 2; the bf16 dot path's
    # blocks of 32) give the same bits
    for size in (1, 3, 4, 7, 33):
        parts = torch.cat([m.matmul(x[i:i + size].contiguous()) for i in range(0, 140, size)])
        assert torch.equal(parts, full), f"rows of {size} differ"
    torch.set_num_threads(1)
    try:
        assert torch.equal(m.matmul(x), full), "1 thread differs"
    finally:
        torch.set_num_threads(2)
    want = x.float() @ ref.t()
    # f32 sums of exact products, then bf16 rounding of the output
    assert ((full.float() - want).abs() <= want.abs() * 2.0**-7 + 1e-3 * want.abs().max()).all()


def test_refuses_bad_shapes() -> None:
    lib = variant_kernels(VARIANTS[0]).lib
    with pytest.raises(ValueError):
        qmm.row_bytes(lib, int(Q.Q6_K), 300)  # not a multiple of 256
    with pytest.raises(ValueError):
        qmm.QuantMatrix(lib, int(Q.Q8_0), torch.zeros(4, 33, dtype=torch.uint8), 32)
    m = qmm.QuantMatrix(lib, int(Q.Q8_0), torch.zeros(4, 34, dtype=torch.uint8), 32)
    with pytest.raises(ValueError):
        m.matmul(torch.zeros(2, 64, dtype=torch.bfloat16))
    with pytest.raises(IndexError):
        m.rows(torch.tensor([4]))
    with pytest.raises(IndexError):
        m.head_dots(torch.zeros(1, 32), torch.tensor([0, 4]))
    with pytest.raises(ValueError):
        m.head_dots(torch.zeros(1, 64))  # not rows of the matrix's width


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_rows_is_an_empty_product(variant: str) -> None:
    """A product of zero activation rows writes nothing (the kernel's paths assume a row)."""
    for t in (Q.Q4_1, Q.Q8_0, Q.Q6_K, Q.F16):
        m, _ = matrix(variant, t, n=16, k=256)
        y = m.matmul(torch.zeros(0, 256, dtype=torch.bfloat16))
        assert y.shape == (0, 16)
        assert m.head_dots(torch.zeros(0, 256)).shape == (0, 16)
