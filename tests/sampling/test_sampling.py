"""Tests for radixserve.sampling.chain: llama.cpp sampler-chain semantics and reproducibility."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.sampling.chain import Sampler, SamplingParams, sample_batch

# Probabilities chosen so cumulative sums avoid float boundary cases: 0.5, 0.8, 0.95, 1.0.
PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = torch.log(torch.tensor(PROBS))


def plain(**kw: object) -> SamplingParams:
    """Params with every filter off, so each test switches on only what it checks."""
    base: dict[str, object] = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    base.update(kw)
    return SamplingParams(**base)  # type: ignore[arg-type]


def survivors(params: SamplingParams, logits: torch.Tensor) -> list[int]:
    return [t for t, _ in Sampler(params, logits.numel()).top_probs(logits, logits.numel())]


def draw(params: SamplingParams, logits: torch.Tensor, n: int) -> torch.Tensor:
    s = Sampler(params, logits.numel())
    return torch.tensor([s.sample(logits) for _ in range(n)])


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("temp", [0.0, -1.0])
def test_greedy_is_argmax(temp: float) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(1000, generator=g)
        # Filters must not matter: greedy is argmax after penalties only.
        s = Sampler(SamplingParams(temperature=temp, top_k=3, min_p=0.5), 1000)
        assert s.sample(logits) == int(logits.argmax())


def test_greedy_ties_pick_lowest_id() -> None:
    assert Sampler(plain(temperature=0.0), 4).sample(torch.tensor([0.0, 3.0, 3.0, 1.0])) == 1


# ---------------------------------------------------------------- filters in isolation


def test_top_k_keeps_exactly_k() -> None:
    logits = torch.randn(100, generator=torch.Generator().manual_seed(1))
    expected = set(torch.topk(logits, 7).indices.tolist())
    assert set(survivors(plain(top_k=7), logits)) == expected
    assert set(draw(plain(top_k=7, temperature=50.0), logits, 2000).tolist()) == expected


def test_top_k_disabled_or_larger_than_vocab_keeps_all() -> None:
    assert len(survivors(plain(top_k=0), LOGITS)) == 4
    assert len(survivors(plain(top_k=-1), LOGITS)) == 4
    assert len(survivors(plain(top_k=10), LOGITS)) == 4


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.0, [0]), (0.4, [0]), (0.75, [0, 1]), (0.9, [0, 1, 2]), (0.99, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])],
)
def test_top_p_keeps_smallest_prefix_reaching_p(top_p: float, kept: list[int]) -> None:
    assert survivors(plain(top_p=top_p), LOGITS) == kept


def test_top_p_renormalises_survivors() -> None:
    probs = dict(Sampler(plain(top_p=0.75), 4).top_probs(LOGITS, 4))
    assert probs[0] == pytest.approx(0.5 / 0.8, abs=1e-5)
    assert probs[1] == pytest.approx(0.3 / 0.8, abs=1e-5)


@pytest.mark.parametrize(
    ("min_p", "kept"),
    [(0.0, [0, 1, 2, 3]), (0.09, [0, 1, 2, 3]), (0.25, [0, 1, 2]), (0.5, [0, 1]), (0.61, [0]), (1.0, [0])],
)
def test_min_p_cuts_relative_to_max_prob(min_p: float, kept: list[int]) -> None:
    assert survivors(plain(min_p=min_p), LOGITS) == kept
    # Relative to the max: a constant logit shift (same distribution) keeps the same set.
    assert survivors(plain(min_p=min_p), LOGITS + 17.0) == kept


def test_top_p_mass_is_measured_before_min_p_prunes() -> None:
    # min_p keeps {0, 1, 2}; top_p=0.52 must use the full distribution (0.5 < 0.52 -> keep two),
    # not the pruned one (0.5 / 0.95 >= 0.52 -> keep one).
    assert survivors(plain(top_p=0.52, min_p=0.25), LOGITS) == [0, 1]
    # ...whereas top_k *does* run first, so there top_p sees 0.5 / 0.95 and keeps one.
    assert survivors(plain(top_p=0.52, min_p=0.25, top_k=3), LOGITS) == [0]


def test_filters_run_before_temperature() -> None:
    # llama.cpp applies top_p/min_p to the unscaled distribution; a hot temperature must not
    # widen the set, and must still flatten the survivors.
    probs = Sampler(plain(top_p=0.75, temperature=10.0), 4).top_probs(LOGITS, 4)
    assert [t for t, _ in probs] == [0, 1]
    expected = torch.softmax(LOGITS[:2] / 10.0, 0).tolist()
    assert [p for _, p in probs] == pytest.approx(expected, abs=1e-5)
    assert survivors(plain(min_p=0.5, temperature=10.0), LOGITS) == [0, 1]


# ---------------------------------------------------------------- temperature distribution


@pytest.mark.parametrize("temp", [0.5, 1.0, 2.5])
def test_sampling_frequencies_follow_softmax_over_temperature(temp: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    samples = draw(plain(temperature=temp, seed=42), logits, 20000)
    expected = torch.softmax(logits / temp, 0)
    # df = 4; the 0.1% critical value is 18.47. Fixed seed, so this is deterministic.
    assert chi_square(samples, expected) < 18.47
    # And clearly not matching the T=1 distribution when T != 1.
    if temp != 1.0:
        assert chi_square(samples, torch.softmax(logits, 0)) > 100.0


def test_masked_tokens_are_never_sampled() -> None:
    logits = torch.tensor([0.0, float("-inf"), 0.0, float("-inf")])
    assert set(draw(plain(), logits, 500).tolist()) == {0, 2}


# ---------------------------------------------------------------- seeds


def _run(seed: int, steps: int = 50) -> list[int]:
    g = torch.Generator().manual_seed(7)
    s = Sampler(plain(seed=seed, temperature=1.5), 500)
    out = []
    for _ in range(steps):
        tok = s.sample(torch.randn(500, generator=g))
        s.accept(tok)
        out.append(tok)
    return out


def test_same_seed_reproduces_and_different_seeds_differ() -> None:
    assert _run(123) == _run(123)
    assert _run(123) != _run(124)


def test_random_seed_is_reported_and_reproducible() -> None:
    a, b = Sampler(plain(seed=-1), 10), Sampler(plain(seed=-1), 10)
    assert 0 <= a.seed < 2**32 and a.seed != b.seed
    replay = Sampler(plain(seed=a.seed), 10)
    logits = torch.zeros(10)
    assert [a.sample(logits) for _ in range(30)] == [replay.sample(logits) for _ in range(30)]


# ---------------------------------------------------------------- penalties


def test_penalties_change_logits_as_llama_cpp() -> None:
    logits = torch.tensor([1.0, 4.0, -1.0, 0.0, 3.0])
    p = plain(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = Sampler(p, 5, prompt_tokens=[1, 1, 2, 3]).penalize(logits)
    # positive: /2 ; non-positive: *2 ; then - count*freq - presence
    expected = [1.0, 4.0 / 2 - 2 * 0.5 - 0.25, -1.0 * 2 - 0.5 - 0.25, 0.0 - 0.5 - 0.25, 3.0]
    assert out.tolist() == pytest.approx(expected)
    assert logits.tolist() == [1.0, 4.0, -1.0, 0.0, 3.0]  # input untouched


def test_penalty_window_slides_with_accept() -> None:
    logits = torch.ones(6)
    s = Sampler(plain(presence_penalty=1.0, repeat_last_n=2), 6, prompt_tokens=[5, 1, 2])
    assert s.penalize(logits).tolist() == [1, 0, 0, 1, 1, 1]  # 5 is outside the window
    s.accept(3)  # evicts 1
    assert s.penalize(logits).tolist() == [1, 1, 0, 0, 1, 1]
    s.accept(3)  # evicts 2; 3 now counted twice (presence counts once)
    assert s.penalize(logits).tolist() == [1, 1, 1, 0, 1, 1]


def test_frequency_counts_accumulate_over_whole_context() -> None:
    s = Sampler(plain(frequency_penalty=1.0, repeat_last_n=-1), 3, prompt_tokens=[0] * 100)
    for _ in range(5):
        s.accept(2)
    assert s.penalize(torch.zeros(3)).tolist() == [-100, 0, -5]


def test_penalties_disabled_are_noops() -> None:
    logits = torch.tensor([1.0, 2.0, 3.0])
    off_window = Sampler(plain(repeat_penalty=1.3, repeat_last_n=0), 3, [0, 1, 2])
    assert torch.equal(off_window.penalize(logits), logits)
    assert torch.equal(Sampler(plain(), 3, [0, 1, 2]).penalize(logits), logits)


def test_out_of_vocab_history_tokens_are_ignored() -> None:
    s = Sampler(plain(presence_penalty=1.0), 3, prompt_tokens=[7, 1])
    assert s.penalize(torch.zeros(3)).tolist() == [0, -1, 0]


def test_repeat_penalty_steers_greedy_choice() -> None:
    logits = torch.tensor([2.0, 1.9, 0.0])
    s = Sampler(plain(temperature=0.0, repeat_penalty=1.1), 3)
    assert s.sample(logits) == 0
    s.accept(0)
    assert s.sample(logits) == 1


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "bad",
    [
        dict(top_p=-0.1), dict(top_p=1.01), dict(top_p=math.nan),
        dict(min_p=-0.01), dict(min_p=1.5),
        dict(repeat_last_n=-2), dict(n_probs=-1), dict(n_probs=101),
        dict(repeat_penalty=0.0), dict(repeat_penalty=-1.0), dict(repeat_penalty=math.nan),
        dict(temperature=math.nan), dict(temperature=math.inf),
        dict(presence_penalty=math.inf), dict(frequency_penalty=math.nan),
        dict(seed=-2), dict(seed=2**64),
    ],
)
def test_validate_rejects_bad_values(bad: dict[str, object]) -> None:
    params = SamplingParams(**bad)  # type: ignore[arg-type]
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        params.validate()
    with pytest.raises(ValueError, match=field):
        Sampler(params, 10)


@pytest.mark.parametrize(
    "ok",
    [
        dict(), dict(temperature=-1.0), dict(top_k=-5), dict(top_p=0.0),
        dict(seed=0), dict(n_probs=100), dict(repeat_last_n=-1),
    ],
)
def test_validate_accepts_llama_cpp_values(ok: dict[str, object]) -> None:
    SamplingParams(**ok).validate()  # type: ignore[arg-type]


def test_bad_shapes_and_vocab_rejected() -> None:
    with pytest.raises(ValueError):
        Sampler(SamplingParams(), 0)
    with pytest.raises(ValueError):
        Sampler(SamplingParams(), 4).sample(torch.zeros(2, 4))
    with pytest.raises(ValueError):
        sample_batch([Sampler(SamplingParams(), 4)], torch.zeros(2, 4))


# ---------------------------------------------------------------- top_probs, batching, dtypes


def test_top_probs_sorted_truncated_and_greedy() -> None:
    s = Sampler(plain(), 4)
    probs = s.top_probs(LOGITS, 3)
    assert [t for t, _ in probs] == [0, 1, 2]
    assert [p for _, p in probs] == pytest.approx(PROBS[:3], abs=1e-5)
    assert s.top_probs(LOGITS, 0) == []
    assert Sampler(plain(temperature=0.0), 4).top_probs(LOGITS, 5) == [(0, 1.0)]


def _samplers() -> list[Sampler]:
    kinds = [
        plain(temperature=0.0),
        plain(temperature=0.0, repeat_penalty=1.5, presence_penalty=0.5),
        SamplingParams(seed=1),
        plain(temperature=1.2, seed=2, frequency_penalty=0.3),
        plain(temperature=0.0, frequency_penalty=2.0),
    ]
    return [Sampler(p, 300, prompt_tokens=[3, 4, 5]) for p in kinds]


def test_sample_batch_equals_per_row_sample() -> None:
    batched, single = _samplers(), _samplers()
    g = torch.Generator().manual_seed(3)
    for _ in range(40):
        logits = torch.randn(len(batched), 300, generator=g) * 3
        got = sample_batch(batched, logits)
        want = [s.sample(logits[i]) for i, s in enumerate(single)]
        assert got == want
        for sb, ss, tok in zip(batched, single, got):
            sb.accept(tok)
            ss.accept(tok)


def test_half_precision_logits_accepted() -> None:
    logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    greedy, hot = Sampler(plain(temperature=0.0), 1000), Sampler(SamplingParams(seed=9), 1000)
    assert sample_batch([greedy, hot], logits)[0] == int(logits[0].float().argmax())
    assert 0 <= hot.sample(logits[1]) < 1000


def reference_chain(logits: list[float], p: SamplingParams) -> list[tuple[int, float]]:
    """Naive line-by-line port of llama.cpp's top_k -> top_p -> min_p -> temp on a list."""
    cur = sorted(enumerate(logits), key=lambda tl: (-tl[1], tl[0]))
    if p.top_k > 0:
        cur = cur[: p.top_k]
    if p.top_p < 1.0:
        m = max(v for _, v in cur)
        z = sum(math.exp(v - m) for _, v in cur)
        cum = 0.0
        for i, (_, v) in enumerate(cur):
            cum += math.exp(v - m) / z
            if cum >= p.top_p:
                cur = cur[: i + 1]
                break
    if p.min_p > 0.0:
        cur = [(t, v) for t, v in cur if v >= cur[0][1] + math.log(p.min_p)]
    m = max(v for _, v in cur) / p.temperature
    w = [math.exp(v / p.temperature - m) for _, v in cur]
    return [(t, x / sum(w)) for (t, _), x in zip(cur, w)]


# Distinct, well-separated logits so float rounding cannot flip a cut-off decision.
_logit_lists = st.lists(st.integers(-400, 400), min_size=1, max_size=64, unique=True).map(
    lambda xs: [x / 20 for x in xs]
)
_probs = st.sampled_from([0.0, 0.05, 0.1, 0.33, 0.5, 0.52, 0.77, 0.9, 0.95, 1.0])


@settings(max_examples=300, deadline=None)
@given(logits=_logit_lists, top_k=st.integers(-1, 70), top_p=_probs, min_p=_probs,
       temperature=st.sampled_from([0.3, 0.8, 1.0, 2.0]))
def test_chain_matches_naive_reference(
    logits: list[float], top_k: int, top_p: float, min_p: float, temperature: float
) -> None:
    params = plain(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    got = Sampler(params, len(logits)).top_probs(torch.tensor(logits), len(logits))
    # post-sampling lists stop at probabilities that are 0 in float32 (llama-server drops them)
    got = [(t, x) for t, x in got if x > 1e-30]
    want = [(t, x) for t, x in reference_chain(logits, params) if x > 1e-30]
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [x for _, x in got] == pytest.approx([x for _, x in want], abs=1e-5)


@settings(max_examples=200, deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20, width=32), min_size=1, max_size=64),
    temperature=st.floats(0.05, 5.0),
    top_k=st.integers(-1, 70),
    top_p=st.floats(0.0, 1.0),
    min_p=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_sampled_token_always_survives_chain(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float, seed: int
) -> None:
    t = torch.tensor(logits)
    params = plain(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    s = Sampler(params, t.numel())
    kept = [tok for tok, _ in s.top_probs(t, t.numel())]
    assert int(t.argmax()) == kept[0] or t[kept[0]] == t.max()  # the max always survives
    for _ in range(5):
        assert s.sample(t) in kept
