"""csrc/delta_net.c (Kernels.gdn_step): one Gated DeltaNet layer step (Qwen3.5's linear
attention) against a plain torch f32 reference that follows the kernel's math step by step (the
reference's delta rule itself checked against transformers' torch_recurrent_gated_delta_rule),
and its bit-exact invariances: a token's output and state bits are the same whether its
sequence's tokens come in one call or several, alone or beside other sequences, on 1 or 2
threads, and in every x86 variant; the read cell is never written, read == -1 is the zero
state, and buffers C cannot read are refused before the call."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tests.model.kernel_variants import kern, threads  # noqa: F401 (fixtures)
from tests.model.state_step_checks import (LONG, SEQS, check_against_reference,
                                           check_beside_others, check_chunks_equal_one_call,
                                           check_every_variant, check_plan_refusals,
                                           check_read_cell_untouched,
                                           conv_state, matrices)

BF = torch.bfloat16
EPS = 1e-6


@dataclass(frozen=True)
class Dims:
    nk: int
    nv: int
    dk: int
    dv: int
    K: int

    @property
    def cc(self) -> int:  # the conv channels: q | k | v
        return 2 * self.nk * self.dk + self.nv * self.dv

    @property
    def p(self) -> int:  # proj's width: conv channels | z | beta logits | alpha
        return self.cc + self.nv * self.dv + 2 * self.nv

    @property
    def ha(self) -> int:  # v-heads whose matrices live in k's row
        return (self.nv + 1) // 2

    @property
    def w(self) -> int:  # a cell's width in k and v
        return (self.K - 1) * self.cc + self.ha * self.dk * self.dv


SMALL = Dims(nk=2, nv=4, dk=16, dv=16, K=4)
WIDE = Dims(nk=2, nv=2, dk=128, dv=128, K=4)
ODD = Dims(nk=1, nv=3, dk=8, dv=24, K=3)  # odd nv (v's row padded), K = 3
# two conv groups, a k head in the second, dv not a multiple of the sweeps' column block
MANY = Dims(nk=6, nv=12, dk=96, dv=80, K=4)
DIMS = [SMALL, WIDE, ODD, MANY]
IDS = ["small", "wide", "odd", "many"]


@dataclass
class Layer:
    """A layer's weights and its state stores, random but of a trained layer's sizes."""

    d: Dims
    conv_w: torch.Tensor
    ssm_a: torch.Tensor
    dt_bias: torch.Tensor
    norm_w: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    def run(self, kern, proj, n_new, read, write) -> torch.Tensor:
        d = self.d
        return kern.gdn_step(proj, self.k, self.v, torch.tensor(n_new), torch.tensor(read),
                             torch.tensor(write), self.conv_w, self.ssm_a, self.dt_bias,
                             self.norm_w, d.nk, d.nv, d.dk, d.dv, EPS)

    def clone(self) -> Layer:
        return Layer(self.d, self.conv_w, self.ssm_a, self.dt_bias, self.norm_w,
                     self.k.clone(), self.v.clone())


def make_layer(d: Dims, n_cells: int, seed: int) -> Layer:
    """Weights, and every cell filled with a random state (conv rows as bf16 inputs are, the
    matrices of the size a decayed delta rule keeps: |S| below ~1)."""
    gen = torch.Generator().manual_seed(seed)
    conv_w = torch.randn(d.cc, d.K, generator=gen) * 0.5
    ssm_a = -torch.empty(d.nv).uniform_(0.01, 16, generator=gen)
    dt_bias = torch.randn(d.nv, generator=gen)
    norm_w = 1 + 0.2 * torch.randn(d.dv, generator=gen)
    k = torch.randn(n_cells, d.w, generator=gen) * 0.3
    v = torch.randn(n_cells, d.w, generator=gen) * 0.3
    conv = (d.K - 1) * d.cc
    k[:, :conv] = k[:, :conv].to(BF).float()  # the conv state holds widened bf16 inputs
    return Layer(d, conv_w, ssm_a, dt_bias, norm_w, k, v)


def make_proj(d: Dims, T: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(T, d.p, generator=gen)
    proj[:, d.cc + d.nv * d.dv + d.nv:] *= 3  # alpha: decays from ~1 to ~0 (and softplus > 20)
    proj[0, -1] = 25.0
    return proj.to(BF)


def exp32(x: torch.Tensor) -> torch.Tensor:
    """e^x correctly rounded to f32 (but for rare ties): the kernel's exp is within 0.51 ulp."""
    return torch.exp(x.double()).float()


def sqrt32(x: torch.Tensor) -> torch.Tensor:
    """sqrt rounded as C's sqrtf (IEEE: correctly); torch's f32 sqrt is not on every CPU."""
    return torch.sqrt(x.double()).float()


def softplus(x: torch.Tensor) -> torch.Tensor:
    """torch's softplus (threshold 20) on exp32."""
    return torch.where(x > 20, x, torch.log1p(exp32(x).double()).float())


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + exp32(-x))


def ordered_sum(terms) -> torch.Tensor:
    """sum of the terms in order, the first term the start (as the kernel sums)."""
    it = iter(terms)
    acc = next(it)
    for t in it:
        acc = acc + t
    return acc


def reference_seq(lay: Layer, proj: torch.Tensor, read: int):
    """One sequence's step in plain torch f32, the kernel's math in its order: (the output
    before its bf16 rounding [n, nv dv], the delta rule's output before the norm [n, nv, dv],
    the conv state after [K-1, Cc], the matrices after [nv, dk, dv], and what the delta rule was
    given: q and k after the L2 norm (q unscaled) per v-head [n, nv, dk], v [n, nv, dv], g and
    beta [n, nv], the matrices before)."""
    d = lay.d
    n = proj.shape[0]
    x = proj[:, :d.cc].float()
    old = conv_state(d, lay.k, read) if read >= 0 else torch.zeros(d.K - 1, d.cc)
    xs = torch.cat([old, x])
    conv = silu(ordered_sum(lay.conv_w[:, j] * xs[j:j + n] for j in range(d.K)))
    q = conv[:, :d.nk * d.dk].view(n, d.nk, d.dk)
    kk = conv[:, d.nk * d.dk:2 * d.nk * d.dk].view(n, d.nk, d.dk)
    vv = conv[:, 2 * d.nk * d.dk:].view(n, d.nv, d.dv)

    def l2(t: torch.Tensor) -> torch.Tensor:
        ss = ordered_sum([torch.zeros(t.shape[:-1])] + [t[..., i] ** 2 for i in range(d.dk)])
        return t * (1 / sqrt32(ss + EPS))[..., None]

    heads = [h % d.nk for h in range(d.nv)]  # v-head h's q/k head: tiled, not grouped
    qn, kn = l2(q)[:, heads], l2(kk)[:, heads]
    qs = qn * (1 / sqrt32(torch.tensor(float(d.dk))))
    zc = d.cc
    z = proj[:, zc:zc + d.nv * d.dv].float().view(n, d.nv, d.dv)
    b = proj[:, zc + d.nv * d.dv:zc + d.nv * d.dv + d.nv].float()
    a = proj[:, zc + d.nv * d.dv + d.nv:].float()
    beta = 1 / (1 + exp32(-b))
    g = lay.ssm_a * softplus(a + lay.dt_bias)
    decay = exp32(g)
    S0 = matrices(d, lay.k, lay.v, read) if read >= 0 else torch.zeros(d.nv, d.dk, d.dv)
    S = S0.clone()
    o = torch.empty(n, d.nv, d.dv)
    for u in range(n):
        S = S * decay[u][:, None, None]
        kv = ordered_sum(S[:, i] * kn[u, :, i, None] for i in range(d.dk))
        delta = (vv[u] - kv) * beta[u][:, None]
        S = S + kn[u][:, :, None] * delta[:, None, :]
        o[u] = ordered_sum(S[:, i] * qs[u, :, i, None] for i in range(d.dk))
    ss = ordered_sum([torch.zeros(n, d.nv)] + [o[..., j] ** 2 for j in range(d.dv)])
    inv = 1 / sqrt32(ss / d.dv + EPS)
    y = o * inv[..., None] * lay.norm_w * silu(z)
    new_conv = xs[n:]
    return y.reshape(n, -1), o, new_conv, S, (qn, kn, vv, g, beta, S0)


def reference(lay: Layer, proj: torch.Tensor, read: int):
    """reference_seq's output, conv state and matrices: the shared checks' reference."""
    y, _, conv, S, _ = reference_seq(lay, proj, read)
    return y, conv, S


@pytest.mark.parametrize("d", DIMS, ids=IDS)
def test_gdn_step_matches_the_torch_reference(kern, threads, d):
    """Three sequences in one call (a prefill of 5 reading a state, a first token from the zero
    state, 3 tokens) against the reference (check_against_reference)."""
    check_against_reference(kern, make_layer, make_proj, reference, d, SEQS, d.dk + d.nv)


def test_long_sequences_match_the_torch_reference(kern, threads):
    """Sequences of 40 and 17 tokens (several conv chunks each) beside one of 3, two of them
    reading the same cell, against the reference."""
    check_against_reference(kern, make_layer, make_proj, reference, SMALL, LONG, 4)


def test_the_reference_delta_rule_is_transformers():
    """The reference's delta rule against transformers' torch_recurrent_gated_delta_rule on the
    same normalized q, k (per v-head: nk == nv there), v, g, beta and initial state: the same
    outputs before the norm and the same final matrices, to f32 roundings."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    for d, seed in ((SMALL, 1), (WIDE, 2), (ODD, 3), (MANY, 4)):
        lay = make_layer(d, 3, seed)
        proj = make_proj(d, 6, seed)
        _, o, _, S, (qn, kn, vv, g, beta, S0) = reference_seq(lay, proj, 1)
        got, state = torch_recurrent_gated_delta_rule(
            qn[None], kn[None], vv[None], g=g[None], beta=beta[None], initial_state=S0[None],
            output_final_state=True, use_qk_l2norm_in_kernel=False)
        torch.testing.assert_close(got[0], o, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(state[0], S, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("d,splits", [
    (SMALL, ([7], [1] * 7, [3, 4])), (WIDE, ([7], [1] * 7, [3, 4])),
    (MANY, ([7], [1] * 7, [3, 4])), (SMALL, ([37], [16, 5, 16], [1, 2, 34], [20, 17])),
], ids=["small", "wide", "many", "small-37"])
def test_chunks_equal_one_call_bitwise(kern, threads, d, splits):
    """A sequence's tokens in one call, one call a token (write -> read cells chained), and in
    other splits (3 + 4; for 37 tokens splits across the conv's chunks of 16): the same output
    bits and the same final state bits; from a read state and from read == -1."""
    check_chunks_equal_one_call(kern, make_layer, make_proj, d, splits)


def test_a_sequence_beside_others_is_bitwise_the_same(kern):
    """A sequence's outputs and state alone, after another sequence, before two others, on 1
    and on 2 threads: the same bits."""
    check_beside_others(kern, make_layer, make_proj, SMALL, 2)


def test_read_cell_is_untouched_and_minus_one_is_the_zero_state(kern):
    """The read cell keeps its bits (both stores, the whole row); read == -1 gives the bits a
    read of an all-zero cell gives."""
    check_read_cell_untouched(kern, make_layer, make_proj, SMALL, (5,))


def test_every_variant_gives_the_same_bits():
    """The file is built without reassociation or contraction and calls the same libm, so every
    x86 variant computes the same bits (a contraction or a reordered sum would show)."""
    check_every_variant(make_layer, make_proj, [SMALL])


def test_gdn_step_refuses_what_it_cannot_read(kern):
    """Wrong dtypes, shapes, layouts, token counts and cells are refused before C sees them."""
    d = SMALL
    lay = make_layer(d, 4, seed=9)
    proj = make_proj(d, 3, seed=1)
    nn, rd, wr = torch.tensor([3]), torch.tensor([1]), torch.tensor([2])

    def call(**kw):
        args = dict(proj=proj, k=lay.k, v=lay.v, n_new=nn, read=rd, write=wr,
                    conv_w=lay.conv_w, ssm_a=lay.ssm_a, dt_bias=lay.dt_bias,
                    norm_w=lay.norm_w, nk=d.nk, nv=d.nv, dk=d.dk, dv=d.dv, eps=EPS)
        args.update(kw)
        return kern.gdn_step(**args)

    call()  # the good call runs
    bad_values = [
        dict(proj=proj.float()), dict(proj=proj[:, :-1]), dict(proj=make_proj(d, 6, 1)[::2]),
        dict(k=lay.k.to(BF)), dict(k=lay.k[:, :-1]), dict(v=lay.v[:3]),
        dict(k=lay.k.t().contiguous().t()), dict(conv_w=lay.conv_w.t()),
        dict(conv_w=lay.conv_w[:, :3]), dict(ssm_a=lay.ssm_a[:3]), dict(norm_w=lay.norm_w.double()),
        dict(nv=3), dict(dk=0),
    ]
    for kw in bad_values:
        with pytest.raises(ValueError):
            call(**kw)
    check_plan_refusals(call)


def test_softplus_threshold_and_decay_edges(kern):
    """alpha + dt_bias above softplus's threshold of 20 (softplus = x: decay = exp(a x), near 0)
    and far below it (decay near 1): the kernel stays with the reference."""
    d = SMALL
    lay = make_layer(d, 3, seed=12)
    lay.dt_bias = torch.zeros(d.nv)  # softplus's argument is alpha itself
    proj = make_proj(d, 2, seed=13).float()
    a0 = d.cc + d.nv * d.dv + d.nv
    proj[0, a0:] = torch.tensor([19.5, 20.5, 30.0, -30.0])
    proj[1, a0:] = torch.tensor([-5.0, 0.0, 20.0, 21.0])
    proj = proj.to(BF)
    before = lay.clone()
    out = lay.run(kern, proj, [2], [1], [0])
    y, _, _, S, _ = reference_seq(before, proj, 1)
    torch.testing.assert_close(out.float(), y.to(BF).float(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(matrices(d, lay.k, lay.v, 0), S, atol=1e-6, rtol=1e-6)
    assert math.isfinite(out.float().abs().max().item())
