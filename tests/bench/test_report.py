"""Report rendering: the Markdown table has a row per mode and every column; PNGs exist."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.bench.report import (
    COLUMNS,
    host_ratio,
    markdown_report,
    summarize,
    turn_table,
    write_report,
)
from radixserve.bench.stats import RequestRecord, summarize_run


def _run(scenario: str, mode: str, repeat: int, hit: float, ttft: float) -> dict:
    return {"scenario": scenario, "mode": mode, "repeat": repeat, "figures": {
        "n_requests": 4, "n_errors": 0, "hit_rate": hit, "ttft_p50_ms": ttft,
        "ttft_p95_ms": 2 * ttft, "e2e_p50_ms": 3 * ttft, "e2e_p95_ms": 4 * ttft,
        "req_per_s": 1.5, "gen_tok_per_s": 24.0, "prompt_tokens_reused": 100 * hit,
        "prompt_tokens_computed": 100 * (1 - hit),
        "host_cache_mib": None if mode == "no-cache" else 12.5,
        "unique_tokens": None if mode == "no-cache" else 300,
        "logical_tokens": None if mode == "no-cache" else 900, "rss_peak_mib": 800.0,
        "hit_rate_by_group": {"hot": hit, "cold": 0.0}}}


RESULTS = [
    *[_run("s1", m, k, h, t) for k in range(3)
      for m, h, t in (("no-cache", 0.0, 100.0 + k), ("radix", 0.5 + 0.1 * k, 20.0 * (k + 1)))],
    _run("s2", "radix", 0, 0.9, 10.0),
    {"scenario": "s2", "mode": "no-cache", "repeat": 0, "error": "RuntimeError: boom"},
]


def test_summary_takes_medians_and_skips_failed_runs() -> None:
    s = summarize(RESULTS)
    assert s["s1"]["radix"]["repeats"] == 3
    assert s["s1"]["radix"]["hit_rate"] == 0.6
    assert s["s1"]["radix"]["ttft_p50_ms"] == 40.0
    assert s["s1"]["no-cache"]["host_cache_mib"] is None
    assert s["s1"]["radix"]["hit_rate_by_group"] == {"hot": 0.6, "cold": 0.0}
    assert s["s2"]["no-cache"] == {"repeats": 0}


def test_markdown_table_rows_and_columns() -> None:
    md = markdown_report(summarize(RESULTS), RESULTS, {"s1": "first scenario"})
    lines = md.splitlines()
    header = next(line for line in lines if line.startswith("| mode |"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    assert cells == ["mode", "runs", *(title for title, _ in COLUMNS)]
    n_cols = header.count("|")
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| mode")]
    rows = [r for r in rows if not r.startswith("| ---")]
    assert all(r.count("|") == n_cols for r in rows)
    assert "## s1" in md and "## s2" in md and "first scenario" in md
    radix_s1 = next(r for r in rows if r.startswith("| radix | 3 |"))
    assert "| 60.0% |" in radix_s1 and "| 40.0 |" in radix_s1 and "| 300 / 900 |" in radix_s1
    no_cache = next(r for r in rows if r.startswith("| no-cache | 3 |"))
    assert "| 0.0% |" in no_cache and "| - |" in no_cache  # no host cache: unknown, not 0
    assert "hot 60.0%" in md
    assert "## Failed runs" in md and "RuntimeError: boom" in md


def test_write_report_creates_files(tmp_path: Path) -> None:
    paths = write_report(RESULTS, tmp_path)
    for name in ("summary.json", "summary.md", "ttft.png", "hit_rate.png", "host_mib.png"):
        p = paths[name]
        assert p.is_file() and p.stat().st_size > 0, name
    for name in ("ttft.png", "hit_rate.png", "host_mib.png"):
        assert paths[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(paths["summary.json"].read_text())["s1"]["radix"]["hit_rate"] == 0.6


def test_issue5_lines_bound_and_host_ratio() -> None:
    runs = [_run("s", m, 0, 0.5, 10.0) for m in ("no-cache", "legacy", "radix")]
    for r, mib in zip(runs, (None, 30.0, 9.0)):
        r["figures"] |= {"host_cache_mib": mib, "prompt_tokens_bound": 60}
    s = summarize(runs)
    assert host_ratio(s["s"]) == 0.3
    md = markdown_report(s, runs)
    assert "- host cache bytes radix / legacy: 0.30" in md
    assert "- radix: prompt tokens computed 50, bound 60" in md
    assert "- legacy: prompt tokens computed 50, bound 60" in md
    assert "- no-cache: prompt tokens computed" not in md  # computes everything by design
    assert host_ratio(summarize(runs[:1] + runs[2:])["s"]) is None  # no legacy run


def _turn_run(mode: str, repeat: int, ttft_scale: float) -> dict:
    """Two conversations x 2 turns: turn 1 computes the prompt, turn 2 reuses the history."""
    recs = [RequestRecord(f"c{c}", "chat", t, 0.0, 1.0, ttft_s=ttft_scale * (t + 1) * (c + 1),
                          prompt_n=(100 + 10 * c) if t == 0 else 20 + c,
                          cache_n=0 if t == 0 else 100 + c)
            for c in range(2) for t in range(2)]
    recs.append(RequestRecord("c2", "chat", 1, 0.0, 1.0, error="HTTP 500"))  # not counted
    return {"scenario": "chat", "mode": mode, "repeat": repeat,
            "figures": summarize_run(recs, wall_s=2.0)}


def test_turn_table_per_turn_medians() -> None:
    runs = [_turn_run("legacy", k, 0.1 * (k + 1)) for k in range(3)] + [_turn_run("radix", 0, 0.1)]
    s = summarize(runs)
    # per run: the medians over the turn's requests; over repeats: their medians
    assert s["chat"]["legacy"]["by_turn"][1] == {
        "n": 2, "prompt_n_p50": 105, "cache_n_p50": 0, "ttft_p50_ms": pytest.approx(300.0)}
    assert s["chat"]["radix"]["by_turn"][2]["prompt_n_p50"] == 20.5
    table = turn_table(s["chat"])
    assert table is not None
    lines = table.splitlines()
    assert lines[0] == ("| turn | legacy computed / reused | legacy TTFT p50 ms "
                        "| radix computed / reused | radix TTFT p50 ms |")
    assert lines[2] == "| 1 | 105 / 0 | 300.0 | 105 / 0 | 150.0 |"
    # turn 2: a median between two requests' counts keeps its half
    assert lines[3] == "| 2 | 20.5 / 100.5 | 600.0 | 20.5 / 100.5 | 300.0 |"
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    # summary.json's turn keys are strings: the same table
    again = json.loads(json.dumps(s))["chat"]
    assert turn_table(again) == table
    md = markdown_report(s, runs)
    assert table in md and "Per turn" in md


def test_turn_table_absent_for_single_turn_scenarios() -> None:
    s = summarize(RESULTS)
    assert all("by_turn" not in f for modes in s.values() for f in modes.values())
    assert turn_table(s["s1"]) is None
    assert "Per turn" not in markdown_report(s, RESULTS)
