"""Percentiles, hit rate, /metrics parsing and medians, against hand-computed values."""

from __future__ import annotations

import math

import pytest

from radixserve.bench.stats import (
    MIB,
    RequestRecord,
    aggregate,
    draft_figures,
    hit_rate,
    host_cache_figures,
    median_of,
    parse_prometheus,
    percentile,
    prefix_bound,
    unshared_minimum,
    series_key,
    sum_counter_figures,
    summarize_run,
    tier_figures,
)


def test_percentile_hand_computed() -> None:
    xs = [15, 20, 35, 40, 50]
    assert percentile(xs, 0) == 15 and percentile(xs, 100) == 50
    assert percentile(xs, 50) == 35
    # rank (5-1)*0.4 = 1.6 -> 20 + 0.6*(35-20) = 29
    assert percentile(xs, 40) == pytest.approx(29.0)
    # rank 4*0.95 = 3.8 -> 40 + 0.8*10 = 48
    assert percentile(xs, 95) == pytest.approx(48.0)
    assert percentile([3, 1, 2], 50) == 2  # unsorted input
    assert percentile([7.0], 95) == 7.0
    assert math.isnan(percentile([], 50))
    # even count: the median is the mean of the middle two
    assert percentile([1, 2, 3, 4], 50) == 2.5
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_hit_rate() -> None:
    assert hit_rate(0, 0) == 0.0
    assert hit_rate(3, 1) == 0.75
    assert hit_rate(0, 10) == 0.0


def test_summarize_run() -> None:
    recs = [
        RequestRecord("a", "g1", 0, 0.0, 1.0, ttft_s=0.1, prompt_n=100, cache_n=0, predicted_n=8,
                      prompt_ms=200.0, predicted_ms=100.0),
        RequestRecord("b", "g1", 0, 0.0, 2.0, ttft_s=0.3, prompt_n=10, cache_n=90, predicted_n=8,
                      prompt_ms=50.0, predicted_ms=400.0),
        RequestRecord("c", "g2", 0, 0.0, 3.0, ttft_s=0.2, prompt_n=50, cache_n=50, predicted_n=8),
        RequestRecord("d", "g2", 0, 0.0, 9.0, error="HTTP 500"),
    ]
    s = summarize_run(recs, wall_s=4.0)
    assert s["n_requests"] == 4 and s["n_errors"] == 1
    assert s["ttft_p50_ms"] == pytest.approx(200.0)
    assert s["ttft_p95_ms"] == pytest.approx(290.0)  # 0.2 + 0.9*(0.3-0.2)
    assert s["e2e_p50_ms"] == pytest.approx(2000.0)
    assert s["req_per_s"] == pytest.approx(0.75) and s["gen_tok_per_s"] == pytest.approx(6.0)
    assert s["prompt_tokens_reused"] == 140 and s["prompt_tokens_computed"] == 160
    assert s["hit_rate"] == pytest.approx(140 / 300)
    assert s["hit_rate_by_group"] == {"g1": pytest.approx(0.45), "g2": pytest.approx(0.5)}
    # engine rates from the server's timings, only where it reported them: 500 and 200 tok/s
    # of prompt, 80 and 20 tok/s of generation -> medians
    assert s["prefill_tok_s_p50"] == pytest.approx(350.0)
    assert s["decode_tok_s_p50"] == pytest.approx(50.0)


METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1234.0
radixserve:bytes 2.097152e+06
radixserve:unique_tokens 90.0
radixserve:logical_tokens 300.0
radixserve:saves 7.0
radixserve:loads 5.0
radixserve:hit_tokens 400.0
radixserve:evictions 2.0
radixserve:fallbacks 0.0
labelled{a="b"} 3
garbage
"""


def test_parse_prometheus() -> None:
    m = parse_prometheus(METRICS)
    assert m["llamacpp:prompt_tokens_total"] == 1234.0
    assert m["radixserve:bytes"] == 2 * MIB
    assert m["labelled"] == 3.0 and "garbage" not in m
    assert m['labelled{a="b"}'] == 3.0


TIERS = """# HELP radixserve:cache_tier_bytes Bytes held per cache tier
# TYPE radixserve:cache_tier_bytes gauge
radixserve:cache_tier_bytes{tier="ram"} 4.6e+06
radixserve:cache_tier_bytes{tier="disk"} 9.2e+07
radixserve:cache_tier_tokens{tier="ram"} 200.0
radixserve:cache_tier_tokens{ tier = "disk" } 4000.0
radixserve:cache_tier_hits_total{tier="disk"} 3.0
radixserve:cache_tier_hit_tokens_total{tier="disk",model="a b}c"} 4032.0 1700000000
radixserve:cache_tier_writes_total{tier="disk"} 70.0
radixserve:cache_tier_bad_files_total{tier="disk"} 1.0
radixserve:cache_tier_writes_total{tier="ram"} 12.0
"""


def test_parse_prometheus_keeps_one_series_per_label_set() -> None:
    m = parse_prometheus(TIERS)
    assert m[series_key("radixserve:cache_tier_bytes", {"tier": "disk"})] == 9.2e7
    assert m['radixserve:cache_tier_bytes{tier="ram"}'] == 4.6e6
    assert m['radixserve:cache_tier_tokens{tier="disk"}'] == 4000.0  # blanks around labels
    # labels sorted in the key; a '}' inside a quoted value; a timestamp after the value
    assert m['radixserve:cache_tier_hit_tokens_total{model="a b}c",tier="disk"}'] == 4032.0


def test_tier_figures_and_their_absence() -> None:
    before = parse_prometheus('radixserve:cache_tier_writes_total{tier="disk"} 6\n'
                              'radixserve:cache_tier_hits_total{tier="disk"} 1\n')
    f = tier_figures(before, parse_prometheus(TIERS))
    assert (f["disk_bytes"], f["disk_tokens"]) == (9.2e7, 4000.0)
    assert f["disk_bytes_per_token"] == 23000.0 and f["ram_bytes_per_token"] == 23000.0
    assert f["disk_writes"] == 64 and f["disk_hits"] == 2 and f["disk_bad_files"] == 1
    assert f["ram_writes"] == 12 and "ram_bad_files" not in f and "ram_dropped" not in f
    assert f["disk_misses"] is None and f["disk_hit_tokens"] is None  # other labels than tier
    # a server without the families: every figure unknown, never 0
    none = tier_figures({}, parse_prometheus(METRICS))
    assert set(none.values()) == {None}
    # no tokens on disk yet: no ratio
    empty = tier_figures({}, {'radixserve:cache_tier_bytes{tier="disk"}': 0.0,
                              'radixserve:cache_tier_tokens{tier="disk"}': 0.0})
    assert empty["disk_bytes"] == 0 and empty["disk_bytes_per_token"] is None


def test_counters_are_summed_over_a_restart_and_sizes_are_the_last_servers() -> None:
    first = {"host_saves": 3.0, "host_loads": 1.0, "host_cache_mib": 90.0}
    second = {"host_saves": 4.0, "host_loads": None, "host_cache_mib": 50.0}
    f = sum_counter_figures([first, second], ("host_saves", "host_loads"))
    assert f == {"host_saves": 7.0, "host_loads": None, "host_cache_mib": 50.0}


def test_host_cache_figures_radix_deltas() -> None:
    before = {"radixserve:saves": 2.0, "radixserve:loads": 1.0, "radixserve:hit_tokens": 100.0,
              "radixserve:evictions": 0.0, "radixserve:fallbacks": 0.0}
    f = host_cache_figures(before, parse_prometheus(METRICS))
    assert f["host_cache_mib"] == 2.0
    assert f["unique_tokens"] == 90 and f["logical_tokens"] == 300
    assert f["host_saves"] == 5 and f["host_loads"] == 4 and f["host_hit_tokens"] == 300
    assert f["host_evictions"] == 2


def test_host_cache_figures_legacy_and_none() -> None:
    # the legacy backend reports under the same names (every entry whole: logical == unique)
    after = {"radixserve:bytes": float(MIB), "radixserve:unique_tokens": 50.0,
             "radixserve:logical_tokens": 50.0, "radixserve:saves": 3.0,
             "radixserve:evictions": 2.0}
    f = host_cache_figures({}, after)
    assert f["host_cache_mib"] == 1.0
    assert f["unique_tokens"] == f["logical_tokens"] == 50
    assert f["host_saves"] == 3 and f["host_evictions"] == 2
    empty = host_cache_figures({}, {})  # no-cache, or llama-server without --metrics
    assert all(v is None for v in empty.values())


def test_medians_over_repeats() -> None:
    assert median_of([3, None, 1, float("nan"), 2]) == 2
    assert median_of([None]) is None
    runs = [{"a": 1.0, "b": None, "g": {"x": 0.1}}, {"a": 5.0, "b": None, "g": {"x": 0.3}},
            {"a": 2.0, "b": None, "g": {"x": 0.2}}]
    agg = aggregate(runs)
    assert agg == {"repeats": 3, "a": 2.0, "b": None, "g": {"x": 0.2}}


def test_prefix_bound_counts_what_no_earlier_prompt_shared() -> None:
    doc_a, doc_b = [1, 2, 3, 4], [1, 9, 9]
    prompts = [doc_a + [5], doc_a + [6, 7], doc_b + [8], doc_a + [5]]
    # 5 new; 2 past the 4 shared with the first; 3 past the [1] shared; 0 (exact repeat)
    assert prefix_bound(prompts) == (5 + 2 + 3 + 0) + 4
    assert prefix_bound([]) == 0
    # the longest match counts, whichever earlier prompt it is with
    assert prefix_bound([[1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5]]) == (2 + 2 + 1) + 3


def test_unshared_minimum_counts_decoded_answers_as_computed() -> None:
    tools = [1, 2, 3, 4]
    sent = [
        (tools + [10], [11, 12, 13]),  # 5 new
        (tools + [20], [21]),  # 1 past the shared tools
        (tools + [10, 11, 12, 13, 14], [15]),  # the answer's fed-back KV (11, 12): 13, 14 new
        (tools + [20], [21]),  # an exact repeat still computes its last token
        (tools + [20, 21, 22], []),  # a one-token answer was never fed back: 21, 22 new
    ]
    assert unshared_minimum(sent) == 5 + 1 + 2 + 1 + 2
    assert unshared_minimum([]) == 0
    # the answers counted as new: [11, 12, 13, 14] past the first prompt, [21, 22] past the 2nd
    assert unshared_minimum([(p, []) for p, _ in sent]) == 5 + 1 + 4 + 1 + 2


def _rec(name: str, predicted_n: int, draft_n: int | None = None, accepted: int | None = None,
         pps: float | None = None, error: str | None = None) -> RequestRecord:
    return RequestRecord(name, "g", 0, 0.0, 1.0, ttft_s=0.1, prompt_n=10, cache_n=0,
                         predicted_n=predicted_n, prompt_ms=10.0, predicted_ms=1000.0,
                         draft_n=draft_n, draft_n_accepted=accepted, predicted_per_second=pps,
                         error=error)


def test_draft_figures_from_timings() -> None:
    recs = [_rec("a", 101, draft_n=80, accepted=60, pps=150.0),
            _rec("b", 51, draft_n=20, accepted=5, pps=60.0),
            _rec("c", 21),  # speculation on but nothing drafted: llama-server sends no fields
            _rec("d", 99, draft_n=1000, accepted=1000, error="HTTP 500")]  # not counted
    s = summarize_run(recs, wall_s=1.0)
    assert s["draft_n"] == 100 and s["draft_n_accepted"] == 65
    assert s["draft_acceptance"] == pytest.approx(0.65)
    # decode steps: a 100 - 60 = 40, b 50 - 5 = 45, c 20 (the first token comes with the prompt)
    assert s["draft_accepted_per_step"] == pytest.approx(65 / 105)
    # decode tok/s is the server's predicted_per_second where sent (150, 60), else n / ms (21)
    assert s["decode_tok_s_p50"] == pytest.approx(60.0)
    assert recs[2].decode_tok_s == pytest.approx(21.0) and recs[0].decode_steps == 40


def test_draft_figures_absent_without_speculation() -> None:
    s = summarize_run([_rec("a", 11, pps=30.0), _rec("b", 11)], wall_s=1.0)
    assert s["draft_n"] is None and s["draft_n_accepted"] is None
    assert s["draft_acceptance"] is None and s["draft_accepted_per_step"] is None
    assert draft_figures([]) == {"draft_n": None, "draft_n_accepted": None,
                                 "draft_acceptance": None, "draft_accepted_per_step": None}
    # drafts proposed but none accepted: 0%, not unknown
    z = draft_figures([_rec("a", 11, draft_n=4, accepted=0)])
    assert z["draft_acceptance"] == 0.0 and z["draft_accepted_per_step"] == 0.0
