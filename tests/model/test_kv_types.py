"""KV cache types (memory/pool/kv_types.py, csrc/kv_rows.c, decode_attn.c's typed path): the bytes are
ggml's (gguf-py's reference quantizers), the C store equals the torch one in every kernel
variant, and attention over quantized K/V equals attention over the dequantized values within
the stated bound, with a query's bits independent of how many queries share the call."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from radixserve.memory.pool.pool import KVPool
from radixserve.model.cabi import bind
from radixserve.memory.pool.kv_types import TYPES, resolve, types_name
from tests.model.kernel_variants import VARIANTS, variant_kernels

BF = torch.bfloat16
GGML = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}


def rows(n: int, d: int, seed: int) -> torch.Tensor:
    """bf16 rows [n, d] of every magnitude a K/V row meets, and the edge cases of a block: all
    zeros, one value alone, ties of largest magnitude of both signs, +-8 d exactly."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.exp(torch.randn(n, 1, generator=g) * 2)
    x[0] = 0
    x[1, :] = 0
    x[1, 5] = -3.0
    x[2, :32] = torch.tensor([1.0, -1.0] * 16)
    x[3, :32] = torch.arange(32) - 16.0
    return x.to(BF)


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_torch_quantizer_gives_ggml_reference_bytes(name: str):
    """Ours == gguf-py's quantize (bit-exact with ggml-quants.c's reference), both ways."""
    t = TYPES[name]
    x = rows(400, 128, 1)
    ours = t.quantize(x)
    ref = quants.quantize(x.float().numpy(), GGML[name])
    assert ours.dtype == torch.uint8 and ours.shape == (400, t.width(128)) == ref.shape
    assert np.array_equal(ours.numpy(), ref)
    assert np.array_equal(t.dequantize(ours, torch.float32).numpy(),
                          quants.dequantize(ref, GGML[name]))
    err = (t.dequantize(ours, torch.float32) - x.float()).abs()
    # a value's error: half a step d = amax / 127 plus the f16 scale's rounding (q * d *
    # 2^-11 <= d / 16) for q8_0; for q4_0 a whole step d = amax / 8 (+8 d clamps to 7 d)
    amax = x.float().view(400, 4, 32).abs().amax(-1, keepdim=True)
    bound = amax / 127 * (0.5 + 1 / 16) if name == "q8_0" else amax / 8 * (1 + 2**-10)
    assert (err.view(400, 4, 32) <= bound).all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_c_store_equals_the_torch_quantizer(variant: str):
    """kv_rows.c (what a step stores) gives kv_types.py's bytes for every type, variant by
    variant (no fused multiply-add moves a q4_0 nibble)."""
    c = bind(variant_kernels(variant).lib)
    x = rows(300, 64, 2).contiguous()
    for name, t in TYPES.items():
        want = t.quantize(x).view(torch.uint8).reshape(300, -1)
        got = torch.empty_like(want)
        assert c.kv_store_rows_bf16(t.code, x.data_ptr(), 300, 64, got.data_ptr()) == 0
        assert torch.equal(got, want), (variant, name)
    assert c.kv_store_rows_bf16(TYPES["q8_0"].code, x.data_ptr(), 1, 48, got.data_ptr()) == -1


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int,
              window: int = 0, pos0: int = 0) -> torch.Tensor:
    """Attention in f64 of queries q [n, n_head, d] at the last n of the L keys k, v
    [n_kv, L, d] (positions pos0 ..), causal (and windowed): the dequantize-then-attend
    reference."""
    n_kv, length, d = k.shape
    g = q.shape[1] // n_kv
    out = torch.empty(n, q.shape[1], d, dtype=torch.float64)
    for i in range(n):
        p = length - n + i  # its index among the keys
        lo = max(0, p - window + 1) if window else 0
        for h in range(q.shape[1]):
            kk, vv = k[h // g, lo : p + 1].double(), v[h // g, lo : p + 1].double()
            s = (kk @ q[i, h].double()) / math.sqrt(d)
            out[i, h] = torch.softmax(s, 0) @ vv
    return out.reshape(n, -1)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kv", ["q8_0", "q4_0", "q8_0/f16", "f32/q4_0", "bf16/q8_0", "f16"])
def test_attention_over_stored_rows_equals_dequantize_then_attend(variant: str, kv: str):
    """A decode query and a 20-query prefill over 600 keys in gathered cells (three of the
    kernel's 256-position blocks), plain and windowed: the kernel reading the stored rows
    (converted to bf16 once a call) is within |err| <= 2^-8 |ref| + 2^-10 max|V| of f64
    attention over the dequantized rows in bf16 (the output's bf16 rounding is 2^-9; f32 sums
    and the exp polynomial add far less),
    and each query's bits are those it gets alone (no dependence on the call's other queries)."""
    kern = variant_kernels(variant)
    kt, vt = (TYPES[n] for n in (kv.split("/") * 2)[:2])
    n_kv, g, d, n_cells, length = 2, 3, 64, 700, 600
    gen = torch.Generator().manual_seed(5)
    kx = (torch.randn(n_kv, n_cells, d, generator=gen) * 2).to(BF)
    vx = torch.randn(n_kv, n_cells, d, generator=gen).to(BF)
    kq, vq = kt.quantize(kx).contiguous(), vt.quantize(vx).contiguous()
    cells = torch.randperm(n_cells, generator=gen)[:length]
    # what the kernel reads: the stored rows dequantized, rounded to bf16 (the compute dtype)
    kd, vd = (t.dequantize(s[:, cells], BF).float() for t, s in ((kt, kq), (vt, vq)))
    vmax = vd.abs().max().item()
    q = torch.randn(20, n_kv * g, d, generator=gen).to(BF)
    for window, pos0 in ((0, 0), (100, 37)):
        for n in (1, 20):
            qn = q[-n:].contiguous()
            got = kern.attend_causal(qn, kq, vq, cells, window=window, pos0=pos0,
                                     types=(kt, vt))
            ref = reference(qn, kd, vd, n, window, pos0)
            err = (got.double() - ref).abs()
            assert (err <= ref.abs() * 2**-8 + vmax * 2**-10).all(), (kv, n, err.max())
            if n == 20:  # the last query's row, computed alone above
                assert torch.equal(got[-1], alone)
            alone = got[-1]


def test_pool_sizes_and_refusals():
    """Bytes per cell follow the types (q8_0 34/64 of bf16's, q4_0 18/64); a head size that
    is not whole blocks is refused naming the type; attention refuses rows of another type."""
    def pool(kt: str, vt: str, head_dim: int = 64) -> KVPool:
        return KVPool(2, 3, head_dim, 16, 1, True, BF, lambda k, dl: k,
                      types=resolve(kt, vt, BF))
    bf = pool("", "").bytes_per_cell
    assert bf == 2 * 2 * 3 * 64 * 2
    assert pool("q8_0", "q8_0").bytes_per_cell / bf == 34 / 64
    assert pool("q4_0", "q4_0").bytes_per_cell / bf == 18 / 64
    assert pool("q8_0", "f32").bytes_per_cell / bf == (34 + 128) / 128
    assert types_name(*resolve("q8_0", "f16", BF)) == "q8_0/f16"
    assert types_name(*resolve("", "", BF)) == "bf16"
    with pytest.raises(ValueError, match="q4_0 needs a head size that is a multiple of 32"):
        pool("bf16", "q4_0", head_dim=48)
    kern = variant_kernels(VARIANTS[0])
    p = pool("q8_0", "q8_0")
    with pytest.raises(ValueError, match="q4_0/q4_0 K/V rows"):
        kern.attend_causal(torch.zeros(1, 3, 64, dtype=BF), p.k[0], p.v[0], slice(0, 4),
                           types=resolve("q4_0", "q4_0", BF))


def test_k_shift_requantizes_the_rotated_rows():
    """seq_add on a q8_0 pool: K is dequantized, rotated and stored again (llama.cpp's K-shift
    through f32); V's bytes do not move."""
    def rotate(k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return k * 2  # a stand-in rotation: visible in every value
    types = resolve("q8_0", "q8_0", BF)
    p = KVPool(1, 2, 64, 8, 1, True, BF, rotate, types=types)
    cells = p.alloc(0, [0, 1, 2])
    x = rows(6, 64, 3).view(3, 2, 64).transpose(0, 1)
    p.k[0, :, cells] = types[0].quantize(x)
    p.v[0, :, cells] = types[1].quantize(x)
    v0 = p.v.clone()
    p.seq_add(0, 1, 3, 5)
    moved = p.cells_at(0, [6, 7])
    want = types[0].quantize(types[0].dequantize(types[0].quantize(x[:, 1:]), BF) * 2)
    assert torch.equal(p.k[0, :, moved], want)
    assert torch.equal(p.v, v0)
