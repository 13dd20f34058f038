"""ServerMetrics counters and the Prometheus text of GET /metrics (llamacpp: names)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve.engine.counters import ServerMetrics
from radixserve.http.prometheus import metric_name, render_metrics

# captured from a real llama-server
SHAPES = Path(__file__).resolve().parent / "fixtures/llama-server-shapes"


def _families(text: bytes) -> dict[str, tuple[str, str]]:
    """name -> (type, help) from the # HELP / # TYPE lines, names exactly as written."""
    helps = dict(re.findall(r"^# HELP (\S+) (.*)$", text.decode(), re.MULTILINE))
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text.decode(), re.MULTILINE))
    return {n: (types[n], helps[n]) for n in types}


def _samples(text: bytes) -> dict[str, float]:
    return {
        name: float(value)
        for name, value in re.findall(r"^([a-zA-Z_:][\w:]*) (\S+)$", text.decode(), re.MULTILINE)
    }


def test_names_types_and_help_match_llama_server() -> None:
    ref_path = SHAPES / "metrics.txt"
    ref = _families(ref_path.read_bytes())
    ours = {n: f for n, f in _families(render_metrics(ServerMetrics(), {})).items()
            if n.startswith("llamacpp:")}
    assert set(ref) == set(ours)
    for name, (kind, doc) in ref.items():
        # n_tokens_max: prometheus_client cannot type a counter without `_total`; a gauge.
        expected_kind = "gauge" if name == "llamacpp:n_tokens_max" else kind
        assert ours[name] == (expected_kind, doc), name
    assert {n for n in _samples(render_metrics(ServerMetrics(), {}))
            if n.startswith("llamacpp:")} == set(ref)


def test_values_after_engine_events() -> None:
    m = ServerMetrics()
    m.on_prompt_done(n_prompt=25, n_cached=44, seconds=0.5)
    m.on_prompt_done(n_prompt=15, n_cached=0, seconds=0.5)
    m.on_prediction_done(n_tokens=21, seconds=0.2)
    m.on_decode(n_busy_slots=2, n_tokens_max=80)
    m.on_decode(n_busy_slots=1)
    m.requests_processing, m.requests_deferred = 2, 1
    s = _samples(render_metrics(m.scrape(), {}))
    assert s["llamacpp:prompt_tokens_total"] == 40
    assert s["llamacpp:prompt_tokens_cached_total"] == 44
    assert s["llamacpp:prompt_seconds_total"] == pytest.approx(1.0)
    assert s["llamacpp:tokens_predicted_total"] == 21
    assert s["llamacpp:tokens_predicted_seconds_total"] == pytest.approx(0.2)
    assert s["llamacpp:n_decode_total"] == 2
    assert s["llamacpp:n_tokens_max"] == 80  # max(25 + 44, 80)
    assert s["llamacpp:prompt_tokens_seconds"] == pytest.approx(40.0)
    assert s["llamacpp:predicted_tokens_seconds"] == pytest.approx(105.0)
    assert s["llamacpp:n_busy_slots_per_decode"] == pytest.approx(1.5)
    assert s["llamacpp:requests_processing"] == 2
    assert s["llamacpp:requests_deferred"] == 1


def test_throughput_bucket_resets_on_scrape_totals_do_not() -> None:
    m = ServerMetrics()
    m.on_prompt_done(10, 0, 0.1)
    m.on_prediction_done(5, 0.5)
    first = _samples(render_metrics(m.scrape(), {}))
    second = _samples(render_metrics(m.scrape(), {}))
    assert first["llamacpp:prompt_tokens_seconds"] == pytest.approx(100.0)
    assert first["llamacpp:predicted_tokens_seconds"] == pytest.approx(10.0)
    assert second["llamacpp:prompt_tokens_seconds"] == 0
    assert second["llamacpp:predicted_tokens_seconds"] == 0
    assert second["llamacpp:prompt_tokens_total"] == 10
    assert second["llamacpp:tokens_predicted_total"] == 5


def test_no_division_by_zero_when_idle() -> None:
    s = _samples(render_metrics(ServerMetrics(), {}))
    assert all(v == 0 for v in s.values())


def test_cache_stats_are_radixserve_gauges() -> None:
    text = render_metrics(ServerMetrics(), {"bytes": 1024.0, "hit-tokens": 7, "nodes": 3})
    fams = _families(text)
    assert fams["radixserve:bytes"][0] == "gauge"
    assert fams["radixserve:hit_tokens"][0] == "gauge"
    s = _samples(text)
    assert s["radixserve:bytes"] == 1024 and s["radixserve:nodes"] == 3
    assert metric_name("a.b c") == "radixserve:a_b_c"


def test_output_parses_with_prometheus_client() -> None:
    m = ServerMetrics()
    m.on_prompt_done(3, 1, 0.01)
    text = render_metrics(m.scrape(), {"nodes": 2}).decode()
    names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert "llamacpp:prompt_tokens_total" in names
    assert "radixserve:nodes" in names


def test_checkpoint_figures_are_radixserve_families() -> None:
    m = ServerMetrics(checkpoints=3, checkpoint_bytes=4096, checkpoints_created_total=5,
                      checkpoints_restored_total=2)
    text = render_metrics(m, {})
    fam = _families(text)
    assert fam["radixserve:checkpoints"][0] == "gauge"
    assert fam["radixserve:checkpoints_restored_total"][0] == "counter"
    s = _samples(text)
    assert (s["radixserve:checkpoints"], s["radixserve:checkpoint_bytes"]) == (3, 4096)
    assert s["radixserve:checkpoints_created_total"] == 5
    assert s["radixserve:checkpoints_restored_total"] == 2
