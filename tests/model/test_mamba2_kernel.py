"""csrc/mamba2.c (Kernels.mamba2_step): one Mamba2 layer step (Granite 4.0-H's SSM layers)
against a plain torch f32 reference that follows the kernel's math step by step (the reference
itself checked against model/mamba2.py's torch path), and its bit-exact invariances: a token's
output and state bits are the same whether its sequence's tokens come in one call or several,
alone or beside other sequences, on 1 or 2 threads, and in every x86 variant; the read cell is
never written, read == -1 is the zero state, and buffers C cannot read are refused before the
call."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch

from radixserve.model import mamba2
from radixserve.model.delta_net import DeltaPlan
from radixserve.model.hparams import SsmDims
from tests.model.kernel_variants import kern, threads  # noqa: F401 (fixtures)
from tests.model.state_step_checks import (LONG, SEQS, check_against_reference,
                                           check_beside_others, check_chunks_equal_one_call,
                                           check_every_variant, check_plan_refusals,
                                           check_read_cell_untouched,
                                           conv_state, matrices)
from tests.model.test_delta_net_kernel import exp32, ordered_sum, silu, softplus, sqrt32

BF = torch.bfloat16
EPS = 1e-6


@dataclass(frozen=True)
class Dims:
    nk: int  # B/C groups
    nv: int  # heads
    dk: int  # the state size
    dv: int  # the head size
    K: int
    bias: bool  # whether the conv has a bias

    @property
    def vd(self) -> int:
        return self.nv * self.dv

    @property
    def cc(self) -> int:  # the conv channels: x | B | C
        return self.vd + 2 * self.nk * self.dk

    @property
    def p(self) -> int:  # proj's width: z | x B C | dt
        return self.vd + self.cc + self.nv

    @property
    def ha(self) -> int:  # heads whose matrices live in k's row
        return (self.nv + 1) // 2

    @property
    def w(self) -> int:  # a cell's width in k and v
        return (self.K - 1) * self.cc + self.ha * self.dk * self.dv

    @property
    def ssm(self) -> SsmDims:
        return SsmDims(nk=self.nk, nv=self.nv, dk=self.dk, dv=self.dv, conv=self.K)


SMALL = Dims(nk=1, nv=4, dk=16, dv=16, K=4, bias=True)
GRANITE = Dims(nk=1, nv=8, dk=128, dv=64, K=4, bias=True)  # Granite 4.0-H's dk, dv, K
ODD = Dims(nk=1, nv=3, dk=8, dv=24, K=3, bias=False)  # odd nv (v's row padded), K = 3
# two groups of 3 heads; two conv channel groups (1216 channels); dv not a multiple of the
# scan's column block on AVX-512
GROUPS = Dims(nk=2, nv=6, dk=64, dv=160, K=4, bias=False)
DIMS = [SMALL, GRANITE, ODD, GROUPS]
IDS = ["small", "granite", "odd", "groups"]


@dataclass
class Layer:
    """A layer's weights and its state stores, random but of a trained layer's sizes."""

    d: Dims
    conv_w: torch.Tensor
    conv_b: torch.Tensor | None
    ssm_a: torch.Tensor
    dt_bias: torch.Tensor
    ssm_d: torch.Tensor
    norm_w: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    def run(self, kern, proj, n_new, read, write) -> torch.Tensor:
        d = self.d
        return kern.mamba2_step(proj, self.k, self.v, torch.tensor(n_new), torch.tensor(read),
                                torch.tensor(write), self.conv_w, self.conv_b, self.ssm_a,
                                self.dt_bias, self.ssm_d, self.norm_w, d.nk, d.nv, d.dk, d.dv,
                                EPS)

    def clone(self) -> Layer:
        return replace(self, k=self.k.clone(), v=self.v.clone())


def make_layer(d: Dims, n_cells: int, seed: int) -> Layer:
    """Weights, and every cell filled with a random state (conv rows as bf16 inputs are)."""
    gen = torch.Generator().manual_seed(seed)
    conv_w = torch.randn(d.cc, d.K, generator=gen) * 0.5
    conv_b = torch.randn(d.cc, generator=gen) * 0.2 if d.bias else None
    ssm_a = -torch.empty(d.nv).uniform_(0.5, 16, generator=gen)
    dt_bias = torch.randn(d.nv, generator=gen)
    ssm_d = 1 + 0.5 * torch.randn(d.nv, generator=gen)
    norm_w = 1 + 0.2 * torch.randn(d.vd, generator=gen)
    k = torch.randn(n_cells, d.w, generator=gen) * 0.3
    v = torch.randn(n_cells, d.w, generator=gen) * 0.3
    conv = (d.K - 1) * d.cc
    k[:, :conv] = k[:, :conv].to(BF).float()  # the conv state holds widened bf16 inputs
    return Layer(d, conv_w, conv_b, ssm_a, dt_bias, ssm_d, norm_w, k, v)


def make_proj(d: Dims, T: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(T, d.p, generator=gen)
    proj[:, -d.nv:] *= 3  # dt: decays from ~1 to ~0 (and softplus > 20)
    proj[0, -1] = 25.0
    return proj.to(BF)


def reference_seq(lay: Layer, proj: torch.Tensor, read: int):
    """One sequence's step in plain torch f32, the kernel's math in its order: (the output
    before its bf16 rounding [n, nv dv], the conv state after [K-1, Cc], the matrices after
    [nv, dk, dv])."""
    d = lay.d
    n, vd, rep = proj.shape[0], d.vd, d.nv // d.nk
    z = proj[:, :vd].float().view(n, d.nv, d.dv)
    x = proj[:, vd:vd + d.cc].float()
    dt_raw = proj[:, vd + d.cc:].float()
    old = conv_state(d, lay.k, read) if read >= 0 else torch.zeros(d.K - 1, d.cc)
    xs = torch.cat([old, x])
    acc = ordered_sum(lay.conv_w[:, j] * xs[j:j + n] for j in range(d.K))
    if lay.conv_b is not None:
        acc = acc + lay.conv_b
    conv = silu(acc)
    xh = conv[:, :vd].view(n, d.nv, d.dv)
    group = [h // rep for h in range(d.nv)]  # contiguous runs of heads share a group
    B = conv[:, vd:vd + d.nk * d.dk].view(n, d.nk, d.dk)[:, group]
    C = conv[:, vd + d.nk * d.dk:].view(n, d.nk, d.dk)[:, group]
    dt = softplus(dt_raw + lay.dt_bias)  # [n, nv]
    dA = exp32(dt * lay.ssm_a)
    S = matrices(d, lay.k, lay.v, read) if read >= 0 else torch.zeros(d.nv, d.dk, d.dv)
    y = torch.empty(n, d.nv, d.dv)
    for u in range(n):
        xdt = xh[u] * dt[u][:, None]
        S = S * dA[u][:, None, None] + B[u][:, :, None] * xdt[:, None, :]
        y[u] = ordered_sum(S[:, i] * C[u, :, i, None] for i in range(d.dk))
    y = y + lay.ssm_d[:, None] * xh
    y = y * silu(z)
    g = y.reshape(n, d.nk, rep * d.dv)
    ss = ordered_sum([torch.zeros(n, d.nk)] + [g[..., i] ** 2 for i in range(rep * d.dv)])
    inv = 1 / sqrt32(ss / (rep * d.dv) + EPS)
    out = g * inv[..., None] * lay.norm_w.view(d.nk, rep * d.dv)
    return out.reshape(n, vd), xs[n:], S


@pytest.mark.parametrize("d", DIMS, ids=IDS)
def test_mamba2_step_matches_the_torch_reference(kern, threads, d):
    """Three sequences in one call (a prefill of 5 reading a state, a first token from the zero
    state, 3 tokens) against the reference (check_against_reference)."""
    check_against_reference(kern, make_layer, make_proj, reference_seq, d, SEQS, d.dk + d.nv)


def test_long_sequences_match_the_torch_reference(kern, threads):
    """Sequences of 40 and 17 tokens (several conv chunks each) beside one of 3, two of them
    reading the same cell, against the reference."""
    check_against_reference(kern, make_layer, make_proj, reference_seq, SMALL, LONG, 4)


def torch_path(lay: Layer, proj: torch.Tensor, seqs, kern=None) -> torch.Tensor:
    """model/mamba2.py's run on the layer's stores (in place), through a DeltaPlan whose kern
    is `kern` (None: its torch path, in f32 for f32 proj)."""
    d = lay.d
    n_new, read, write = map(list, zip(*seqs, strict=True))
    plan = DeltaPlan(d.ssm, EPS, lay.k.view(1, 1, *lay.k.shape), lay.v.view(1, 1, *lay.v.shape),
                     n_new, read, write, kern)
    m = SimpleNamespace(conv=lay.conv_w, conv_bias=lay.conv_b, ssm_a=lay.ssm_a,
                        dt_bias=lay.dt_bias, ssm_d=lay.ssm_d, norm=lay.norm_w)
    return mamba2.run(plan, 0, m, proj)


@pytest.mark.parametrize("d", DIMS, ids=IDS)
def test_the_reference_is_mamba2_torch_path(d):
    """The reference against model/mamba2.py's torch path (its own exp, softplus, SiLU and sum
    orders) on the same f32 inputs: the same outputs and states, to f32 roundings."""
    lay = make_layer(d, 7, seed=d.dv)
    proj = make_proj(d, 9, seed=5)
    before = lay.clone()
    got = torch_path(lay, proj.float(), SEQS)
    assert got.dtype == torch.float32
    t0 = 0
    for n, rd, wr in SEQS:
        y, new_conv, S = reference_seq(before, proj[t0:t0 + n], rd)
        torch.testing.assert_close(got[t0:t0 + n], y, atol=1e-4, rtol=1e-4)
        assert torch.equal(conv_state(d, lay.k, wr), new_conv)
        torch.testing.assert_close(matrices(d, lay.k, lay.v, wr), S, atol=1e-5, rtol=1e-5)
        t0 += n


def test_mamba2_run_calls_the_kernel(kern):
    """mamba2.run with the kernels and bf16 rows is the kernel's call (the arguments it passes
    in the kernel's order: the same bits as a direct call), close to its torch path."""
    d = GRANITE
    proj = make_proj(d, 9, seed=6)
    direct, via_run, torch_f32 = (make_layer(d, 7, seed=7) for _ in range(3))
    want = direct.run(kern, proj, *map(list, zip(*SEQS, strict=True)))
    got = torch_path(via_run, proj, SEQS, kern)
    assert torch.equal(got, want)
    assert torch.equal(via_run.k, direct.k) and torch.equal(via_run.v, direct.v)
    ref = torch_path(torch_f32, proj.float(), SEQS)
    torch.testing.assert_close(got.float(), ref.to(BF).float(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(via_run.k, torch_f32.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(via_run.v, torch_f32.v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d,splits", [
    (SMALL, ([7], [1] * 7, [3, 4])), (GRANITE, ([7], [1] * 7, [3, 4])),
    (ODD, ([7], [1] * 7, [1, 6])), (GROUPS, ([7], [1] * 7, [3, 4])),
    (SMALL, ([37], [16, 5, 16], [1, 2, 34], [20, 17])),
], ids=["small", "granite", "odd", "groups", "small-37"])
def test_chunks_equal_one_call_bitwise(kern, threads, d, splits):
    """A sequence's tokens in one call, one call a token (write -> read cells chained), and in
    other splits (3 + 4, 1 + 6: fewer than the conv's K-1 rows; for 37 tokens splits across the
    conv's chunks of 16): the same output bits and the same final state bits; from a read state
    and from read == -1."""
    check_chunks_equal_one_call(kern, make_layer, make_proj, d, splits)


@pytest.mark.parametrize("d", [SMALL, GROUPS], ids=["small", "groups"])
def test_a_sequence_beside_others_is_bitwise_the_same(kern, d):
    """A sequence's outputs and state alone, after another sequence, before two others, on 1
    and on 2 threads: the same bits (the norm's token blocks fall differently in each)."""
    check_beside_others(kern, make_layer, make_proj, d, 3)


def test_read_cell_is_untouched_and_minus_one_is_the_zero_state(kern):
    """The read cell keeps its bits (both stores, the whole row); read == -1 gives the bits a
    read of an all-zero cell gives, also with fewer tokens than the conv's K-1 state rows."""
    check_read_cell_untouched(kern, make_layer, make_proj, SMALL, (5, 2))


def test_a_short_step_keeps_the_older_conv_rows(kern):
    """With fewer new tokens than the conv's K-1 state rows, the write cell's conv state is the
    read cell's newest rows, then the new inputs (exactly)."""
    d = SMALL
    lay = make_layer(d, 3, seed=8)
    proj = make_proj(d, 2, seed=9)
    old = conv_state(d, lay.k, 1).clone()
    lay.run(kern, proj, [2], [1], [0])
    x = proj[:, d.vd:d.vd + d.cc].float()
    assert torch.equal(conv_state(d, lay.k, 0), torch.cat([old[2:], x]))


def test_every_variant_gives_the_same_bits():
    """The file is built without reassociation or contraction and with its own exp, so every
    x86 variant computes the same bits (a contraction or a reordered sum would show), with and
    without the conv bias, one group and two."""
    check_every_variant(make_layer, make_proj, [SMALL, GROUPS])


def test_mamba2_step_refuses_what_it_cannot_read(kern):
    """Wrong dtypes, shapes, layouts, token counts and cells are refused before C sees them."""
    d = SMALL
    lay = make_layer(d, 4, seed=9)
    proj = make_proj(d, 3, seed=1)
    nn, rd, wr = torch.tensor([3]), torch.tensor([1]), torch.tensor([2])

    def call(**kw):
        args = dict(proj=proj, k=lay.k, v=lay.v, n_new=nn, read=rd, write=wr,
                    conv_w=lay.conv_w, conv_b=lay.conv_b, ssm_a=lay.ssm_a,
                    dt_bias=lay.dt_bias, ssm_d=lay.ssm_d, norm_w=lay.norm_w, nk=d.nk, nv=d.nv,
                    dk=d.dk, dv=d.dv, eps=EPS)
        args.update(kw)
        return kern.mamba2_step(**args)

    call()  # the good call runs
    call(conv_b=None)  # as does one without the bias
    bad_values = [
        dict(proj=proj.float()), dict(proj=proj[:, :-1]), dict(proj=make_proj(d, 6, 1)[::2]),
        dict(k=lay.k.to(BF)), dict(k=lay.k[:, :-1]), dict(v=lay.v[:3]),
        dict(k=lay.k.t().contiguous().t()), dict(conv_w=lay.conv_w.t()),
        dict(conv_w=lay.conv_w[:, :3]), dict(conv_b=lay.conv_b[:-1]),
        dict(conv_b=lay.conv_b.double()), dict(conv_b=torch.zeros(2 * d.cc)[::2]),
        dict(ssm_a=lay.ssm_a[:3]), dict(dt_bias=lay.dt_bias.to(BF)),
        dict(ssm_d=lay.ssm_d[:3]), dict(norm_w=lay.norm_w.double()),
        dict(norm_w=lay.norm_w[:d.dv]),
        dict(nv=3), dict(dk=0), dict(nk=3, nv=4),
    ]
    for kw in bad_values:
        with pytest.raises(ValueError):
            call(**kw)
    check_plan_refusals(call)


def test_softplus_threshold_and_decay_edges(kern):
    """dt + dt_bias above softplus's threshold of 20 (dt = x: dA = exp(a x), near 0) and far
    below it (dt near 0, dA near 1): the kernel stays with the reference."""
    d = SMALL
    lay = make_layer(d, 3, seed=12)
    lay.dt_bias = torch.zeros(d.nv)  # softplus's argument is dt itself
    proj = make_proj(d, 2, seed=13).float()
    proj[0, -d.nv:] = torch.tensor([19.5, 20.5, 30.0, -30.0])
    proj[1, -d.nv:] = torch.tensor([-5.0, 0.0, 20.0, 21.0])
    proj = proj.to(BF)
    before = lay.clone()
    out = lay.run(kern, proj, [2], [1], [0])
    y, _, S = reference_seq(before, proj, 1)
    torch.testing.assert_close(out.float(), y.to(BF).float(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(matrices(d, lay.k, lay.v, 0), S, atol=1e-6, rtol=1e-6)
    assert math.isfinite(out.float().abs().max().item())
