"""Each llama.cpp sampler against a direct re-implementation of its formula
(src/llama-sampler.cpp) on small hand-made logits, the chain order, min_keep, the RNG, and which
rows may use the output head's shortlist."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from radixserve.sampling.chain import (
    Sampler,
    SamplingParams,
    dry_breakers,
    parse_logit_bias,
    sample_batch,
    samplers_from_chars,
    samplers_from_names,
)
from radixserve.sampling.ops import MT19937

X = np.array([2.0, 1.5, 1.2, 0.3, 0.2, -0.5, -1.0, -3.0], dtype=np.float32)


def only(*samplers: str, **kw: object) -> SamplingParams:
    base: dict[str, object] = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7,
                                   samplers=list(samplers))
    base.update(kw)
    return SamplingParams(**base)  # type: ignore[arg-type]


def chain(params: SamplingParams, x: np.ndarray = X, prompt: list[int] | None = None
          ) -> dict[int, float]:
    s = Sampler(params, x.size, prompt or [])
    return dict(s.top_probs(torch.tensor(x), x.size))


def softmax(ids: list[int], x: np.ndarray) -> dict[int, float]:
    e = np.exp(x[ids].astype(np.float64) - x[ids].max())
    return dict(zip(ids, (e / e.sum()).tolist()))


def close(a: dict[int, float], b: dict[int, float]) -> None:
    assert set(a) == set(b), (a, b)
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k


# ---------------------------------------------------------------- names, RNG, parsing


def test_sampler_names_and_chars_as_llama_cpp() -> None:
    assert samplers_from_names(["Top-K", "topp", "nucleus", "typ", "temp", "min_p", "DRY",
                                "top-n-sigma", "xtc", "penalties", "adaptive-p"]) == [
        "top_k", "top_p", "top_p", "typ_p", "temperature", "min_p", "dry", "top_n_sigma", "xtc",
        "penalties", "adaptive_p"]
    assert samplers_from_chars("edskypmxta") == [
        "penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
        "temperature", "adaptive_p"]
    with pytest.raises(ValueError):
        samplers_from_names(["top_q"])
    with pytest.raises(ValueError):
        samplers_from_chars("kz")
    assert samplers_from_names(["top_q", "k", "top_k"], strict=False) == ["top_k"]


def test_mt19937_matches_libstdcxx() -> None:
    """Values printed by g++/libstdc++: mt19937(42) raw, uniform_real_distribution<double>,
    <float>, discrete_distribution({.1, .2, .7})."""
    r = MT19937(42)
    assert [r.u32() for _ in range(3)] == [1608637542, 3421126067, 4083286876]
    r = MT19937(42)
    assert [r.uniform() for _ in range(3)] == [0.796542984287846, 0.18343478789336848,
                                               0.7796909976126613]
    r = MT19937(42)
    assert [round(r.uniform_f32(), 7) for _ in range(3)] == [0.3745401, 0.796543, 0.9507143]
    r = MT19937(42)
    p = np.array([0.1, 0.2, 0.7], dtype=np.float32)
    assert [r.discrete(p) for _ in range(10)] == [2, 1, 2, 2, 2, 0, 2, 2, 1, 2]
    r = MT19937(7)
    for _ in range(700):
        r.u32()
    assert r.u32() == 3181053478


def test_logit_bias_parsing() -> None:
    def tok(s: str) -> list[int]:
        return [ord(c) for c in s]
    assert parse_logit_bias([[5, 1.5], [5, False], ["ab", -1], [99, 1], [1, True], [2]], 50,
                            tok) == [(5, 1.5), (5, -math.inf), (97, -1.0), (98, -1.0)]
    assert parse_logit_bias({"3": 2, " 4": False, "x": 1, "77": 1, "": 0.5}, 100, tok) == [
        (3, 2.0), (4, -math.inf), (120, 1.0), (77, 1.0), (0, 0.5)]


# ---------------------------------------------------------------- samplers in isolation


@pytest.mark.parametrize("k", [1, 3, 8, 20])
def test_top_k(k: int) -> None:
    close(chain(only("top_k", top_k=k)), softmax(list(range(min(k, 8))), X))


@pytest.mark.parametrize("p,min_keep", [(0.5, 0), (0.8, 0), (0.5, 4), (0.99, 0), (0.0, 0)])
def test_top_p_with_min_keep(p: float, min_keep: int) -> None:
    q = softmax(list(range(8)), X)
    cum, keep = 0.0, 8
    for i in range(8):  # llama.cpp: stop at the first i with cum >= p and i + 1 >= min_keep
        cum += q[i]
        if cum >= p and i + 1 >= min_keep:
            keep = i + 1
            break
    close(chain(only("top_p", top_p=p, min_keep=min_keep)), softmax(list(range(keep)), X))


@pytest.mark.parametrize("p,min_keep", [(0.3, 0), (0.5, 0), (0.5, 5), (0.9, 2)])
def test_min_p_with_min_keep(p: float, min_keep: int) -> None:
    cut = X.max() + np.log(np.float32(p))
    keep = [i for i in range(8) if X[i] >= cut]
    if len(keep) < min_keep:  # the sorted fallback keeps min_keep
        keep = list(range(min_keep))
    close(chain(only("min_p", min_p=p, min_keep=min_keep)), softmax(keep, X))


@pytest.mark.parametrize("p", [0.3, 0.6, 0.9])
def test_typical(p: float) -> None:
    q = softmax(list(range(8)), X)
    ent = -sum(v * math.log(v) for v in q.values())
    order = sorted(range(8), key=lambda i: abs(-math.log(q[i]) - ent))
    cum, keep = 0.0, order
    for i, t in enumerate(order):
        cum += q[t]
        if cum > p:
            keep = order[: i + 1]
            break
    close(chain(only("typ_p", typical_p=p)), softmax(keep, X))


@pytest.mark.parametrize("n", [0.5, 1.0, 2.0])
def test_top_n_sigma(n: float) -> None:
    keep = [i for i in range(8) if X[i] >= X.max() - n * X.std()]
    close(chain(only("top_n_sigma", top_n_sigma=n)), softmax(keep, X))


def test_xtc_removes_all_but_the_least_likely_top_choice() -> None:
    q = softmax(list(range(8)), X)
    above = [i for i in range(8) if q[i] >= 0.1]
    keep = list(range(above[-1], 8))
    close(chain(only("xtc", xtc_probability=1.0, xtc_threshold=0.1)), softmax(keep, X))
    # min_keep larger than what would remain: XTC does nothing
    close(chain(only("xtc", xtc_probability=1.0, xtc_threshold=0.1, min_keep=8)),
          softmax(list(range(8)), X))


@pytest.mark.parametrize("temp", [0.5, 2.0])
def test_temperature_and_order(temp: float) -> None:
    close(chain(only("temperature", temperature=temp)), softmax(list(range(8)), X / temp))
    # min_p after temperature sees the scaled distribution, before it the raw one
    after = chain(only("temperature", "min_p", temperature=temp, min_p=0.3))
    before = chain(only("min_p", "temperature", temperature=temp, min_p=0.3))
    cut = np.log(0.3)
    keep_after = [i for i in range(8) if X[i] / temp >= X.max() / temp + cut]
    keep_before = [i for i in range(8) if X[i] >= X.max() + cut]
    close(after, softmax(keep_after, X / temp))
    close(before, softmax(keep_before, X / temp))
    assert set(after) != set(before)


def test_dynamic_temperature() -> None:
    t, d, e = 1.0, 0.5, 1.5
    q = np.array(list(softmax(list(range(8)), X).values()))
    ent = -(q * np.log(q)).sum() / math.log(8)
    dyn = max(0.0, t - d) + 2 * d * ent**e
    close(chain(only("temperature", temperature=t, dynatemp_range=d, dynatemp_exponent=e)),
          softmax(list(range(8)), X / dyn))


def test_temperature_zero_keeps_only_the_best() -> None:
    assert chain(only("top_k", "temperature", top_k=4, temperature=0.0)) == {0: 1.0}


def test_penalties_and_logit_bias() -> None:
    hist = [1, 1, 2, 5]
    rp, f, pr = 1.3, 0.2, 0.1
    y = X.copy()
    for t, c in {1: 2, 2: 1, 5: 1}.items():
        y[t] = y[t] / rp if y[t] > 0 else y[t] * rp
        y[t] -= c * f + pr
    y[0] += -1.0
    y[3] += 2.0
    got = chain(only("penalties", repeat_penalty=rp, frequency_penalty=f, presence_penalty=pr,
                     logit_bias=[(0, -1.0), (3, 2.0)]), prompt=hist)
    close(got, softmax(list(range(8)), y))
    # the window: only the last repeat_last_n tokens count
    got = chain(only("penalties", repeat_penalty=2.0, repeat_last_n=1), prompt=hist)
    y = X.copy()
    y[5] *= 2.0
    close(got, softmax(list(range(8)), y))


def test_dry_penalises_the_token_that_extends_a_repeat() -> None:
    # history: 3 4 5 6 | 3 4 5 -> emitting 6 extends a repeat of length 3
    hist = [3, 4, 5, 6, 7, 3, 4, 5]
    mult, base, allowed = 0.8, 1.75, 2
    y = X.copy()
    y[6] -= mult * base ** (3 - allowed)
    p = only("dry", dry_multiplier=mult, dry_base=base, dry_allowed_length=allowed,
             dry_breaker_tokens={})
    close(chain(p, prompt=hist), softmax(list(range(8)), y))
    # a breaker inside the repeat limits its length: 7 3 4 5 with 4 breaking -> length 1
    p.dry_breaker_tokens = {4: [()]}
    close(chain(p, prompt=hist), softmax(list(range(8)), X))


def test_dry_breaker_processing_as_llama_cpp() -> None:
    pieces = [b"a", b"b:", b"x", b" the", b"t", b"he", b"q"]
    table = dry_breakers(["the", ":"], len(pieces), lambda t: pieces[t],
                         lambda s: {"he": [5], "e": [6]}.get(s, []))
    # " the" contains "the"; "t" ends with the head of "the" -> tail tokenize("he");
    # "b:" contains ":"
    assert table == {3: [()], 4: [(5,)], 1: [()]}


def test_mirostat_2_truncates_by_surprise() -> None:
    p = only(mirostat=2, mirostat_tau=2.0, temperature=1.0)
    q = softmax(list(range(8)), X)
    mu = 2 * 2.0
    keep = [i for i in range(8) if -math.log2(q[i]) <= mu]
    close(chain(p), softmax(keep, X))


def test_same_seed_same_draws_and_batched_equals_alone() -> None:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 300, generator=g) * 2
    ps = [SamplingParams(seed=5, top_k=0), SamplingParams(temperature=0),
          SamplingParams(seed=9, mirostat=2)]
    alone = [[Sampler(p, 300).sample(rows[i]) for _ in range(1)] for i, p in enumerate(ps)]
    ss = [Sampler(p, 300) for p in ps]
    assert [[t] for t in sample_batch(ss, rows)] == alone


# ---------------------------------------------------------------- head fast paths


def test_head_need_by_chain() -> None:
    v = 100
    assert Sampler(SamplingParams(), v).head_need().top == 40
    assert Sampler(SamplingParams(temperature=0), v).head_need().top == 1
    n = Sampler(SamplingParams(repeat_penalty=1.2, logit_bias=[(7, 1.0)]), v, [3, 4]).head_need()
    assert n.top == 40 and set(n.extra) == {3, 4, 7} and n.adjust is not None
    # pre-sampling n_probs need the whole row; post-sampling ones do not
    assert Sampler(SamplingParams(n_probs=5), v).head_need().top == 0
    assert Sampler(SamplingParams(n_probs=5, post_sampling_probs=True), v).head_need().top == 40
    # a sampler reading the whole distribution before top_k, or no top_k at all
    assert Sampler(SamplingParams(top_n_sigma=1.0), v).head_need().top == 0
    assert Sampler(SamplingParams(samplers=["top_p", "top_k", "temperature"]), v
                   ).head_need().top == 0
    assert Sampler(SamplingParams(mirostat=2), v).head_need().top == 0
    # greedy: XTC or typical could drop the best token -> the full chain
    s = Sampler(SamplingParams(temperature=0, xtc_probability=1.0), v)
    assert not s.greedy and s.head_need().top == 40


def test_ignore_eos_ban_leaves_raw_row_and_n_probs_alone() -> None:
    x = torch.tensor([5.0, 1.0, 0.0, -1.0])
    s = Sampler(SamplingParams(temperature=0, n_probs=2), 4, banned=[0])
    assert sample_batch([s], x[None])[0] == 1
    prob, top = s.token_probs(1, x, 2)
    assert [t for t, _ in top] == [0, 1] and prob == pytest.approx(
        float(torch.softmax(x, 0)[1]))


@pytest.mark.parametrize("top_p,min_p", [(0.95, 0.05), (0.5, 0.01), (0.99, 0.3)])
def test_top_p_then_min_p_shortcut_equals_the_two_samplers(top_p: float, min_p: float) -> None:
    """The large-vocabulary shortcut for top_p -> min_p (min_keep 0) gives what the two
    samplers give one after the other (min_keep 1 takes the general path, same semantics)."""
    x = torch.randn(6000, generator=torch.Generator().manual_seed(1)) * 3
    fast = Sampler(SamplingParams(top_k=0, top_p=top_p, min_p=min_p, seed=3), 6000)
    slow = Sampler(SamplingParams(top_k=0, top_p=top_p, min_p=min_p, min_keep=1, seed=3), 6000)
    assert fast.top_probs(x, 6000) == slow.top_probs(x, 6000)
    assert [fast.sample(x) for _ in range(20)] == [slow.sample(x) for _ in range(20)]
