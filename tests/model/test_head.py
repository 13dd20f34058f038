"""The output head's certified shortlist gives every sampler exactly what the full f32 head gives:
the greedy token, the top-k tokens and their values, with penalties and bans applied."""

from __future__ import annotations

import pytest
import torch

from radixserve.model.head import MAX_TOP, OutputHead, RowNeed, split_int8
from radixserve.sampling.chain import Sampler, SamplingParams
from tests.model.kernel_variants import VARIANTS, default_kernels, variant_kernels

V, D = 8192, 64
# the approximate pass: our int8 kernel (model/csrc/int8_head.c) or torch's int8 kernel
pytestmark = pytest.mark.parametrize("vnni", [True, False], ids=["vnni", "torch-int8"])


def make_head(seed: int = 0, vnni: bool = False) -> OutputHead:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, D, generator=g) * 0.05
    w[torch.randint(0, V, (64,), generator=g)] *= 8  # outlier rows, like real embeddings
    w[:, 3] *= 6  # an outlier dimension
    return set_path(OutputHead(w, shortlist=True, kern=default_kernels()), vnni)


def set_path(head: OutputHead, vnni: bool) -> OutputHead:
    if vnni:
        assert head.kern is not None, "our int8 head pass did not build"
    else:
        head.kern = None
    return head


def hidden(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed)) * 6


def test_greedy_and_top_k_equal_the_full_head(vnni):
    head = make_head(vnni=vnni)
    h = hidden(64, 1)
    full = head.full(h)
    for k in (1, 5, 40, MAX_TOP):
        got = head.logits(h, [RowNeed(k)] * len(h))
        want = torch.topk(full, k, dim=1)
        have = torch.topk(got, k, dim=1)
        assert torch.equal(have.indices, want.indices), k
        assert torch.allclose(have.values, want.values, rtol=1e-6, atol=1e-5), k
    assert head.stats.rows_short == 4 * len(h) and head.stats.rows_full == 0
    # the point of it: far fewer rows re-scored than the vocabulary
    assert head.stats.rescored < 4 * len(h) * V / 4


def test_near_ties_are_resolved_exactly(vnni):
    head = make_head(2, vnni)
    h = hidden(1, 3)
    full = head.full(h)[0]
    a, b = torch.topk(full, 2).indices.tolist()
    # make the runner-up tie the winner to within 1e-4: int8 alone cannot tell them apart
    head.w[b] += (full[a] - full[b] - 1e-4) * h[0] / h[0].dot(h[0])
    head.__init__(head.w, shortlist=True, kern=default_kernels())
    set_path(head, vnni)
    full = head.full(h)[0]
    assert 0 < (full[a] - full[b]).item() < 1e-3
    got = head.logits(h, [RowNeed(1)])[0]
    assert int(got.argmax()) == int(full.argmax()) == a


def test_samplers_with_penalties_and_bans_draw_what_the_full_head_gives(vnni):
    head = make_head(4, vnni)
    h = hidden(24, 5)
    full = head.full(h)
    history = torch.topk(full[0], 30).indices.tolist()[::3]  # penalize some of the best tokens
    for params in (
        SamplingParams(temperature=0, repeat_penalty=1.5),
        SamplingParams(temperature=0, repeat_penalty=0.7),  # < 1 raises penalized logits
        SamplingParams(temperature=0.8, top_k=40, seed=7, presence_penalty=2.0),
        SamplingParams(temperature=1.0, top_k=10, top_p=0.9, min_p=0.02, seed=3),
    ):
        for r in range(len(h)):
            banned = torch.topk(full[r], 2).indices.tolist()[1:]  # ignore_eos-like ban
            a = Sampler(params, V, history, banned=banned)
            b = Sampler(params, V, history, banned=banned)
            need = a.head_need()
            row = head.logits(h[r : r + 1], [need])[0]
            want = full[r].clone()
            row[banned] = -torch.inf
            want[banned] = -torch.inf
            assert a.sample(row) == b.sample(want), (params, r)
            got_p, want_p = a.top_probs(row, 5), b.top_probs(want, 5)
            assert [t for t, _ in got_p] == [t for t, _ in want_p]
            assert all(abs(p - q) < 1e-5 for (_, p), (_, q) in zip(got_p, want_p))


def test_whole_distribution_rows_get_the_full_head(vnni):
    head = make_head(6, vnni)
    h = hidden(3, 7)
    needs = [RowNeed(0), RowNeed(1), RowNeed(MAX_TOP + 1)]
    got = head.logits(h, needs)
    full = head.full(h)
    assert torch.equal(got[0], full[0]) and torch.equal(got[2], full[2])
    assert torch.isinf(got[1]).sum() > V // 2  # a shortlist row
    assert int(got[1].argmax()) == int(full[1].argmax())
    # the dequant path: always the full head
    dense = OutputHead(head.w, shortlist=False, kern=default_kernels())
    assert torch.equal(dense.logits(h, needs), full)


def test_vnni_pass_is_within_its_bound(vnni):
    """The approximate logits of either pass stay within the bound the shortlist trusts, on
    hidden states with outliers and with exact zeros (a zero row must not divide by zero)."""
    head = make_head(8, vnni)
    h = hidden(9, 9)
    h[0] = 0
    h[1, 3] = 300.0  # one huge element: the int8 split's scale follows it
    y, c_a, rel = head._approx(h)
    z = head.full(h)
    c_w = h.abs().sum(1, keepdim=True)
    bound = torch.addcmul(head.err * c_w, head.amax, c_a) + rel * y.abs()
    assert ((z - y).abs() <= bound).all()
    assert torch.equal(y[0], torch.zeros(V))
    if vnni:  # the split itself: parts stand for h to ~max|h| / 64516 per element
        a, sc, approx, _ = split_int8(h)
        assert a.dtype == torch.uint8 and a.shape == (18, D)
        assert ((approx - h).abs() <= h.abs().amax(1, keepdim=True) / 64516 * 1.01).all()


def test_head_passes_are_row_invariant(vnni):
    """The head's kernels checked row by row: the int8 pass and the exact f32 logits give a row
    the same bits whatever rows share the call, and an exact logit is the same whichever
    tokens are re-scored with it (torch's f32 matmul fails both)."""
    head = make_head(6, vnni)
    h = hidden(9, 7)
    y_alone = torch.cat([head._approx(h[i : i + 1])[0] for i in range(len(h))])
    full_alone = torch.cat([head.full(h[i : i + 1]) for i in range(len(h))])
    for m in (2, 3, 4, 9):
        assert torch.equal(head._approx(h[:m])[0], y_alone[:m])
        assert torch.equal(head.full(h[:m]), full_alone[:m])
    for top in (1, 40):
        short = head.logits(h, [RowNeed(top)] * len(h))
        seen = torch.isfinite(short)
        assert torch.equal(short[seen], full_alone[seen])


def test_bound_pass_equals_the_torch_bound(vnni):
    """The VNNI pass with the bound applied in C (int8_head_bound) gives the upper and lower
    bounds of the torch formula over _approx's y (to f32 rounding, far inside _MARGIN), each
    row's largest lower bound exactly, and bounds that hold; the candidates it keeps for
    grammar rows (allowed tokens) are exact too."""
    head = make_head(10, vnni)
    h = hidden(5, 11)
    h[2] = 0
    z = head.full(h)
    if vnni:
        upper, lower, lomax = head._bounds(h, True)
        y, c_a, rel = head._approx(h)
        c_w = h.abs().sum(1, keepdim=True)
        bound = (torch.addcmul(head.err * c_w, head.amax, c_a) + rel * y.abs()) * 1.01
        near = 1e-5 * (y.abs() + bound)
        assert ((upper - (y + bound)).abs() <= near).all()
        assert lower is not None and ((lower - (y - bound)).abs() <= near).all()
        assert torch.equal(lomax, lower.max(1).values)
        assert (lower <= z).all() and (z <= upper).all()
        assert head._bounds(h, False)[1] is None
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[::7] = True
    for only in (True, False):
        got = head.logits(h, [RowNeed(3, allowed=allowed, allowed_only=only)] * len(h))
        want = z.masked_fill(~allowed, -torch.inf)
        top = torch.topk(want, 3, dim=1)
        assert torch.equal(torch.topk(got.masked_fill(~allowed, -torch.inf), 3, dim=1).indices,
                           top.indices)
        assert torch.equal(got.gather(1, top.indices), top.values)


@pytest.mark.parametrize("variant", VARIANTS)
def test_bound_kernels_in_every_variant(vnni, variant):
    """csrc/int8_head.c in every build (VNNI, AVX2, plain C) for 1 to 5 vectors (the pass takes
    4 at a time): int8_head's y is the exact integer sums' formula (checked against float64
    sums), the bound pass gives y with the bound added and the largest lower bound exactly;
    and head_candidates picks up >= floor in order and fills -inf."""
    from radixserve.model.cabi import bind

    kern = variant_kernels(variant)
    bound, cand = bind(kern.lib).int8_head_bound, bind(kern.lib).head_candidates
    g = torch.Generator().manual_seed(5)
    rows, d = 4099, 128
    q8 = torch.randint(-128, 128, (rows, d), dtype=torch.int8, generator=g)
    rowsum = q8.sum(1, dtype=torch.int32).to(torch.int32)
    scale, err, amax = (torch.rand(rows, generator=g) for _ in range(3))
    for n in (1, 4, 5):
        a, s, _, _ = split_int8(torch.randn(n, d, generator=g))
        cw, ca = torch.rand(n, generator=g), torch.rand(n, generator=g)
        up, lo, lomax = torch.empty(n, rows), torch.empty(n, rows), torch.empty(n)
        rc = bound(q8.data_ptr(), rowsum.data_ptr(), scale.data_ptr(), err.data_ptr(),
                   amax.data_ptr(), a.data_ptr(), s.data_ptr(), rows, d, n, cw.data_ptr(),
                   ca.data_ptr(), 2.0**-20, 1.01, up.data_ptr(), lo.data_ptr(),
                   lomax.data_ptr())
        assert rc == 0
        y = kern.int8_head(q8, rowsum, scale, a, s)
        sums = (a.double() - 128).view(n, 2, d) @ q8.double().t()  # exact in float64
        terms = s.double().view(n, 2, 1) * sums * scale.double()
        want = terms.sum(1)
        # three f32 roundings after the exact sums, each within 2^-24 of the terms' size
        assert ((y.double() - want).abs() <= 2.0**-21 * terms.abs().sum(1)).all(), n
        b = 1.01 * (err * cw[:, None] + amax * ca[:, None] + 2.0**-20 * y.abs())
        assert ((up - (y + b)).abs() <= 1e-6 * (y.abs() + b)).all(), n
        assert ((lo - (y - b)).abs() <= 1e-6 * (y.abs() + b)).all(), n
        assert torch.equal(lomax, lo.max(1).values), n
    up = torch.randn(rows, generator=g)
    ids, fill = torch.empty(rows, dtype=torch.int64), torch.zeros(rows)
    for floor in (0.5, 10.0, -10.0):
        count = cand(up.data_ptr(), rows, floor, ids.data_ptr(), fill.data_ptr())
        assert torch.equal(ids[:count], (up >= floor).nonzero().squeeze(1)), floor
        assert torch.isinf(fill).all() and (fill < 0).all()


def test_a_head_wider_than_the_int8_sums_keep_exact_is_refused(vnni):
    """INT8_HEAD_MAX_WIDTH: the widest head whose int8 pass sums fit int32 (head.py's
    derivation); one wider is refused at load naming the limit, never summed with overflow."""
    from radixserve.model.head import INT8_HEAD_MAX_WIDTH
    from radixserve.model.hparams import UnsupportedModelError

    assert INT8_HEAD_MAX_WIDTH * 255 * 128 <= 2**31 - 1 < (INT8_HEAD_MAX_WIDTH + 1) * 255 * 128
    with pytest.raises(UnsupportedModelError, match=str(INT8_HEAD_MAX_WIDTH)):
        OutputHead(torch.zeros(2, INT8_HEAD_MAX_WIDTH + 64), shortlist=True)


def test_a_logit_scale_divides_every_path(vnni):
    """Granite's logits_scaling: the full head, the shortlist rows and the rows beside them
    all give the unscaled head's logits divided by the scale (the hidden rows divided first,
    in f32: within an f32 rounding)."""
    plain = make_head(vnni=vnni)
    scaled = set_path(OutputHead(plain.w, shortlist=True, kern=default_kernels(),
                                 logit_scale=4.0), vnni)
    h = hidden(16, 2)
    want = plain.full(h) / 4.0
    assert torch.allclose(scaled.full(h), want, rtol=1e-6, atol=1e-6)
    got = scaled.logits(h, [RowNeed(5)] * 8 + [RowNeed(0)] * 8)
    assert torch.allclose(got[8:], want[8:], rtol=1e-6, atol=1e-6)
    top = torch.topk(got[:8], 5, dim=1)
    assert torch.equal(top.indices, torch.topk(want[:8], 5, dim=1).indices)
    assert torch.allclose(top.values, torch.topk(want[:8], 5, dim=1).values, rtol=1e-6,
                          atol=1e-6)
