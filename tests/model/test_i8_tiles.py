"""The 8-bit tiles as a layer (quant.py's I8Linear on csrc/i8act.c): Q5_0, Q5_1, Q8_0, Q5_K and
Q6_K weights as int8 codes with f32 scales, multiplied through 8-bit activations, in every
kernel variant.

Blocks are made here (tests/model/test_qmm.py's random codes and scales written as the type's
bytes). The weights the tiles hold, d c + m evaluated in f32, are gguf-py's dequantization bit
for bit, the affine types too (gguf-py's d c then + m: the same two roundings); the products,
whose activations are rounded to 8 bits a group, are within that rounding's error of the exact
product with gguf-py's weights (kernel_variants.act8_tolerance), which a weight in the wrong
lane or under the wrong group's scale exceeds; a row's bits never depend on the rows or threads
sharing the call; the loader picks them for those types in every kernel build. The kernel's
arithmetic itself, bit for bit on every variant: tests/model/test_i8act.py."""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch

from radixserve.model import qmm
from radixserve.model.quant import I8_FORMATS, I8Linear, pack_i8, tile_weights
from tests.model.kernel_variants import (  # noqa: F401 (fixture)
    VARIANTS,
    act8_tolerance,
    permuted_lanes,
    variant,
    variant_kernels,
)
from tests.model.test_qmm import random_blocks

Q = gguf.GGMLQuantizationType
TYPES = list(I8_FORMATS)
_gemma_reader = functools.cache(gguf.GGUFReader)  # ~11 s: its 262k-token vocabulary


def linear(v: str, t: Q, n: int = 48, k: int = 512, bias: torch.Tensor | None = None
           ) -> tuple[I8Linear, torch.Tensor, np.ndarray]:
    """An I8Linear of random `t` blocks on variant `v`'s kernels, gguf-py's f32 weights of them,
    and the blocks."""
    raw = random_blocks(t, n, k, seed=int(t))
    ref = torch.from_numpy(gguf.quants.dequantize(raw, t).reshape(n, k).astype(np.float32))
    return I8Linear([(t, raw)], k, bias, variant_kernels(v)), ref, raw


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("v", VARIANTS)
def test_weights_are_gguf_dequantization(v: str, t: Q) -> None:
    """qmm.c's codes (each build's) and the tiles packed from them hold gguf-py's weights: d c +
    m in f32 equal to them exactly, and weight() is their bf16."""
    lin, ref, raw = linear(v, t)
    assert lin.route == "i8-tiles" and lin.mat.fmt == I8_FORMATS[t]
    assert np.array_equal(tile_weights(lin.mat.tiles, lin.mat.fmt).numpy(), ref.numpy())
    assert torch.equal(lin.weight(), ref.to(torch.bfloat16))
    # the codes and maps themselves: d c + m in f32 is gguf-py's weight, exactly
    c, d, m = qmm.codes(variant_kernels(v).lib, int(t), raw, 512)
    w = c.astype(np.float32) * np.repeat(d, 16, axis=1) + np.repeat(m, 32, axis=1)
    assert np.array_equal(w, ref.numpy())


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("v", VARIANTS)
def test_rows_invariant_and_close(v: str, t: Q) -> None:
    lin, ref, raw = linear(v, t, bias=torch.randn(48).to(torch.bfloat16))
    g = torch.Generator().manual_seed(1)
    # rows of varied magnitudes, one with a group of zeros
    scale = torch.exp2(torch.randint(-6, 7, (140, 1), generator=g).float())
    x = (torch.randn(140, lin.n_in, generator=g) * scale).to(torch.bfloat16)
    x[7, 64:96] = 0
    full = lin(x)
    # few rows (1-4: the tiles ahead prefetched) and many (a row block, as many as it holds)
    for size in (1, 3, 4, 7, 33, 128):
        parts = torch.cat([lin(x[i:i + size].contiguous()) for i in range(0, 140, size)])
        assert torch.equal(parts, full), f"rows of {size} differ"
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(lin(x), full), f"{threads} threads differ"
    finally:
        torch.set_num_threads(before)
    xw, tol = act8_tolerance(x, ref)
    want = xw + lin.bias.double()
    # the 8-bit activations' bound on the product, then one bf16 rounding of the bias add
    tol = tol + want.abs() * 2.0**-8
    assert ((full.double() - want).abs() <= tol).all()
    # the bound is no blanket: the same weights a lane off, or under another group's scales
    # and offsets, exceed it
    wrong, _ = act8_tolerance(x, permuted_lanes(ref))
    assert ((full.double() - (wrong + lin.bias.double())).abs() > tol).any()
    c, d, m = qmm.codes(variant_kernels(v).lib, int(t), raw, lin.n_in)
    d, m = np.roll(d, 2, axis=1), np.roll(m, 1, axis=1)  # each group the next one's maps
    other = c.astype(np.float32) * np.repeat(d, 16, axis=1) + np.repeat(m, 32, axis=1)
    wrong, _ = act8_tolerance(x, torch.from_numpy(other))
    assert ((full.double() - (wrong + lin.bias.double())).abs() > tol).any()


def test_refuses_what_it_cannot_hold() -> None:
    """The codes exist for the 5- to 8-bit types only (the 4-bit ones have their tiles of 4-bit
    codes); a tile format too narrow for a type's maps is refused, not truncated."""
    lib = variant_kernels("avx512bf16").lib
    raw = random_blocks(Q.Q4_0, 16, 64)
    with pytest.raises(ValueError):
        qmm.codes(lib, int(Q.Q4_0), raw, 64)
    c, d, m = qmm.codes(lib, int(Q.Q5_1), random_blocks(Q.Q5_1, 16, 64), 64)
    assert m.any()
    with pytest.raises(ValueError, match="without offsets"):
        pack_i8(c, d, m, 1)  # a format without offsets
    assert pack_i8(c, d, m, 3).shape == (1, 2, 640)
    c, d, m = qmm.codes(lib, int(Q.Q6_K), random_blocks(Q.Q6_K, 16, 256), 256)
    with pytest.raises(ValueError, match="one scale a group"):
        pack_i8(c, d, m, 1)  # Q6_K's two scales a group in a one-scale format
    assert pack_i8(c, d, m, 2).shape == (1, 8, 640)


@pytest.mark.parametrize("v", VARIANTS)
def test_types_of_one_format_share_a_matrix(v: str) -> None:
    """Q5_0 rows above Q8_0 rows (Gemma 3's q/k and v) in one matrix: each row's bits are
    those of its own type's matrix; a Q6_K part (two scales a group) is refused beside them."""
    kern = variant_kernels(v)
    a, b = random_blocks(Q.Q5_0, 32, 512, seed=5), random_blocks(Q.Q8_0, 16, 512, seed=8)
    both = I8Linear([(Q.Q5_0, a), (Q.Q8_0, b)], 512, None, kern)
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    want = torch.cat([I8Linear([(Q.Q5_0, a)], 512, None, kern)(x),
                      I8Linear([(Q.Q8_0, b)], 512, None, kern)(x)], dim=1)
    assert both.n_out == 48 and torch.equal(both(x), want)
    with pytest.raises(ValueError, match="tile format"):
        I8Linear([(Q.Q5_0, a), (Q.Q6_K, random_blocks(Q.Q6_K, 16, 512))], 512, None, kern)


def test_loader_runs_them_on_8bit_tiles_in_every_kernel_build(variant: str) -> None:
    """Gemma 3's Q4_K_M mixes Q4_K, Q5_0, Q6_K and Q8_0 (its layer 0: Q5_0 q/k, Q8_0 v, Q6_K
    down): in every build of our kernels none of its layer matrices is dense, and the 5-8-bit
    ones are 8-bit tiles (RADIXSERVE_KERNELS=0 leaves them dense: tests/model/test_routes.py)."""
    from radixserve.model.default_model import gemma3_model_path
    from radixserve.model.quant import ConcatLinear
    from radixserve.model.tensors import TensorLoader

    reader = _gemma_reader(gemma3_model_path())
    load = TensorLoader(reader, torch.bfloat16, packed=True, kern=variant_kernels(variant))
    assert load.build == variant
    names = [f"blk.0.{n}.weight" for n in ("attn_q", "attn_k", "attn_v", "ffn_down")]
    types = {reader_t.tensor_type for reader_t in reader.tensors if reader_t.name in names}
    assert {Q.Q5_0, Q.Q8_0, Q.Q6_K} <= types
    parts = []
    for lin in (load.linear(names[:3], [None] * 3), load.linear(names[3:], [None])):
        parts += lin.parts if isinstance(lin, ConcatLinear) else [lin]
    assert all(type(p) is I8Linear for p in parts), [type(p) for p in parts]
    # q/k (Q5_0) and v (Q8_0) share a tile format, so one matrix, one call; down (Q6_K) its own
    assert [p.mat.fmt for p in parts] == [1, 2]
