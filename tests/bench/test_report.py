"""Report rendering: the Markdown table has a row per mode and every column; PNGs exist."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from radixserve.bench.report import (
    COLUMNS,
    compare_outputs,
    host_ratio,
    markdown_report,
    markdown_table,
    restart_table,
    summarize,
    turn_table,
    write_report,
)
from radixserve.bench.stats import MIB, RequestRecord, summarize_run


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


def test_a_run_whose_requests_all_failed_still_gets_its_report(tmp_path: Path) -> None:
    """No TTFT anywhere (every request failed: the server was not up): the log-scaled TTFT
    plot is drawn on a linear axis instead of raising."""
    failed = [_run("s", "radix", 0, 0.0, 0.0)]
    paths = write_report(failed, tmp_path)
    assert paths["ttft.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_issue5_lines_bound_and_host_ratio() -> None:
    runs = [_run("s", m, 0, 0.5, 10.0) for m in ("no-cache", "legacy", "radix")]
    for r, mib in zip(runs, (None, 30.0, 9.0)):
        r["figures"] |= {"host_cache_mib": mib, "prompt_tokens_bound": 60,
                         "prompt_tokens_min": 40}
    s = summarize(runs)
    assert host_ratio(s["s"]) == 0.3
    md = markdown_report(s, runs)
    assert "- host cache bytes radix / legacy: 0.30" in md
    assert "- radix: prompt tokens computed 50, bound 60" in md
    assert "- legacy: prompt tokens computed 50, bound 60" in md
    assert "- no-cache: prompt tokens computed 50, bound" not in md  # all computed by design
    for m in ("no-cache", "legacy", "radix"):  # the unshared minimum: every mode
        assert f"- {m}: prompt tokens computed 50 = 1.25x the unshared minimum 40 (" in md
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


def _spec_run(mode: str, repeat: int, replies: list[str], drafts: list[tuple[int, int] | None],
              pps: list[float]) -> dict:
    """A run of 3 requests (64 tokens each) as run_one writes it: figures and requests."""
    recs = [RequestRecord(f"d0p{i}", "doc0", 0, 0.0, 1.0, ttft_s=0.1, prompt_n=50, cache_n=50,
                          predicted_n=64, prompt_ms=5.0, predicted_ms=500.0, reply=text,
                          draft_n=None if d is None else d[0],
                          draft_n_accepted=None if d is None else d[1],
                          predicted_per_second=v)
            for i, (text, d, v) in enumerate(zip(replies, drafts, pps))]
    return {"scenario": "rag", "mode": mode, "repeat": repeat,
            "figures": summarize_run(recs, wall_s=2.0),
            "requests": [dataclasses.asdict(r) for r in recs]}


SAME = ["quote one", "quote two", "quote three"]
SPEC_RESULTS = [
    _spec_run("radix", 0, SAME, [None, None, None], [100.0, 110.0, 90.0]),
    # drafts on 2 of 3 requests: (proposed, accepted); 63 decode steps less the accepted
    _spec_run("radix+ngram-simple", 0, SAME, [(40, 30), (20, 5), None], [200.0, 150.0, 120.0]),
]


def _row(md: str, mode: str) -> list[str]:
    line = next(x for x in md.splitlines() if x.startswith(f"| {mode} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_spec_columns_from_timings_and_dashes_without_speculation() -> None:
    s = summarize(SPEC_RESULTS)
    titles = [t for t, _ in COLUMNS]
    table = markdown_table(s["rag"])
    plain, spec = _row(table, "radix"), _row(table, "radix+ngram-simple")
    col = {t: i + 2 for i, t in enumerate(titles)}  # after "mode" and "runs"
    assert spec[col["decode tok/s p50"]] == "150.0" and plain[col["decode tok/s p50"]] == "100.0"
    assert spec[col["draft accept"]] == "58.3%"  # 35 / 60
    assert spec[col["acc / step"]] == f"{35 / (63 * 3 - 35):.2f}" == "0.23"
    assert plain[col["draft accept"]] == "-" and plain[col["acc / step"]] == "-"
    assert s["rag"]["radix+ngram-simple"]["draft_n"] == 60
    assert s["rag"]["radix"]["draft_acceptance"] is None
    md = markdown_report(s, SPEC_RESULTS)
    assert "- radix+ngram-simple: draft tokens accepted / proposed 35 / 60" in md
    assert "- radix: draft tokens" not in md


def test_outputs_identical_across_modes_line() -> None:
    md = markdown_report(summarize(SPEC_RESULTS), SPEC_RESULTS)
    assert "- outputs identical across modes: yes (3 requests, 2 modes)" in md
    s = summarize(SPEC_RESULTS)
    assert s["rag"]["radix+ngram-simple"]["outputs_differ"] == 0
    assert s["rag"]["radix+ngram-simple"]["outputs_compared"] == 3


def test_outputs_that_differ_are_counted_per_request_and_mode() -> None:
    other = ["quote one", "quote 2", "quote three"]
    runs = [*SPEC_RESULTS,
            _spec_run("radix+ngram-mod", 0, other, [(9, 9)] * 3, [1.0] * 3),
            # a second repeat of a mode that differs on another request
            _spec_run("radix+ngram-simple", 1, ["quote one", "quote two", "3"], [None] * 3,
                      [1.0] * 3)]
    failed = _spec_run("llama-server", 0, ["x", "y", "z"], [None] * 3, [1.0] * 3)
    for q in failed["requests"]:
        q["error"] = "HTTP 500"  # failed requests are not compared
    runs.append(failed)
    cmp = compare_outputs(runs)["rag"]
    assert cmp["reference"] == "radix" and cmp["n_requests"] == 3
    assert cmp["n_differ"] == 2 and cmp["differ"] == ["d0p1/0", "d0p2/0"]
    # llama-server answered nothing: not compared, not counted as identical
    assert cmp["by_mode"] == {"radix": 0, "radix+ngram-simple": 1, "radix+ngram-mod": 1}
    assert cmp["n_compared"] == {"radix": 3, "radix+ngram-simple": 3, "radix+ngram-mod": 3}
    md = markdown_report(summarize(runs), runs)
    assert ("- outputs identical across modes: no (2 of 3 requests differ from radix: "
            "radix+ngram-simple 1, radix+ngram-mod 1)") in md
    # one mode alone: nothing to compare, no line
    assert compare_outputs(SPEC_RESULTS[:1]) == {}
    assert "outputs identical" not in markdown_report(summarize(SPEC_RESULTS[:1]),
                                                      SPEC_RESULTS[:1])


def test_write_report_writes_the_output_comparison(tmp_path: Path) -> None:
    paths = write_report(SPEC_RESULTS, tmp_path)
    cmp = json.loads(paths["outputs.json"].read_text())
    assert cmp["rag"]["n_differ"] == 0 and cmp["rag"]["by_mode"]["radix+ngram-simple"] == 0
    summary = json.loads(paths["summary.json"].read_text())
    assert summary["rag"]["radix+ngram-simple"]["draft_acceptance"] == pytest.approx(35 / 60)


def _restart_run(mode: str, repeat: int, first_after: tuple[int, int, float],
                 disk: tuple[float, float] | None = None, first_fails: bool = False) -> dict:
    """restart-shared-prefix as run_one writes it: 2 requests before the restart, 3 after.
    `first_after` = (prompt_n, cache_n, prompt_ms) of the first request after the restart
    (sent first, at t=10 s; the others reuse 4000 tokens); `disk` = (bytes, tokens) of the
    second server's disk tier, None for a server without one."""
    before = [RequestRecord(f"d{d}q0", f"doc{d}", 0, float(d), 1.0, ttft_s=4.0,
                            prompt_n=4050, cache_n=0, prompt_ms=3900.0, reply=f"a{d}")
              for d in range(2)]
    n, c, ms = first_after
    after = [RequestRecord("d0q1", "doc0", 0, 10.0, 1.0, ttft_s=ms / 1e3 + 0.05, prompt_n=n,
                           cache_n=c, prompt_ms=ms, reply="b0", phase=1),
             RequestRecord("d1q1", "doc1", 0, 11.0, 1.0, ttft_s=0.3, prompt_n=50, cache_n=4000,
                           prompt_ms=40.0, reply="b1", phase=1),
             RequestRecord("d0q2", "doc0", 0, 12.0, 1.0, ttft_s=0.1, prompt_n=50, cache_n=4000,
                           prompt_ms=40.0, reply="c0", phase=1)]
    if first_fails:
        after[0].error, after[0].reply = "HTTP 500", None
    recs = before + after
    figures = summarize_run(recs[::-1], wall_s=20.0)  # the order of completion must not matter
    figures["restart_start_s"] = 3.5
    if disk is not None:
        figures |= {"disk_bytes": disk[0], "disk_tokens": disk[1],
                    "disk_bytes_per_token": disk[0] / disk[1], "disk_hit_tokens": 4000.0,
                    "disk_writes": 130.0, "disk_bad_files": 0.0,
                    "disk_dir_files": 128, "disk_dir_bytes": disk[0]}
    return {"scenario": "restart", "mode": mode, "repeat": repeat, "figures": figures,
            "requests": [dataclasses.asdict(r) for r in recs]}


DISK = (4050 * 23040.0, 4050.0)
RESTART_RESULTS = [
    _restart_run("no-cache", 0, (4060, 0, 3800.0)),
    _restart_run("radix", 0, (4060, 0, 4000.0)),
    _restart_run("radix-disk", 0, (60, 4000, 120.0), DISK),
    _restart_run("radix-disk", 1, (60, 4000, 140.0), DISK),
]


def test_after_restart_figures_from_the_requests_after_the_restart() -> None:
    f = summarize(RESTART_RESULTS)["restart"]
    disk = f["radix-disk"]["after_restart"]
    assert disk["n_requests"] == 3 and disk["n_errors"] == 0
    # the 3 requests after the restart only: TTFTs 0.17 / 0.19 (repeats), 0.3, 0.1 s
    assert disk["ttft_p50_ms"] == pytest.approx(180.0)
    assert disk["prompt_tokens_computed"] == 160 and disk["prompt_tokens_reused"] == 12000
    # the first request after the restart on its own (median over the 2 repeats)
    assert (disk["first_prompt_ms"], disk["first_prompt_n"], disk["first_cache_n"]) == (
        130.0, 60, 4000)
    radix = f["radix"]["after_restart"]
    assert (radix["first_prompt_ms"], radix["first_cache_n"]) == (4000.0, 0)
    assert radix["prompt_tokens_computed"] == 4160 and radix["prompt_tokens_reused"] == 8000
    # the whole run's figures still count both halves
    assert f["radix"]["n_requests"] == 5
    assert f["radix-disk"]["disk_bytes_per_token"] == 23040.0


def test_restart_table_columns_and_dashes() -> None:
    s = summarize(RESTART_RESULTS)["restart"]
    table = restart_table(s)
    assert table is not None
    lines = table.splitlines()
    assert lines[0] == ("| mode | after restart: requests | TTFT p50 ms | computed / reused tok "
                        "| 1st: prompt ms | 1st: computed / reused tok | 1st: TTFT ms "
                        "| server start s | disk MiB | disk tok | disk bytes / tok |")
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in lines[2:]}
    mib = f"{DISK[0] / MIB:.1f}"
    assert rows["radix-disk"] == ["radix-disk", "3", "180.0", "160 / 12000", "130.0",
                                  "60 / 4000", "180.0", "3.5", mib, "4050", "23040"]
    # no disk tier: its figures are unknown, not 0
    assert rows["radix"] == ["radix", "3", "300.0", "4160 / 8000", "4000.0", "4060 / 0",
                             "4050.0", "3.5", "-", "-", "-"]
    md = markdown_report(summarize(RESTART_RESULTS), RESTART_RESULTS)
    assert table in md and "After the restart" in md
    assert "- radix-disk: disk tier during measurement (last server): hit tokens 4000, " \
           "writes 130, bad files 0" in md
    assert f"- radix-disk: --cache-disk directory at the end: 128 files, {mib} MiB" in md
    # greedy replies compared over both halves of the run, every mode
    assert "- outputs identical across modes: yes (5 requests, 3 modes)" in md
    # no restart, no disk tier: no table
    assert restart_table(summarize(RESULTS)["s1"]) is None
    assert "After the restart" not in markdown_report(summarize(RESULTS), RESULTS)


def test_restart_table_when_the_first_request_after_the_restart_failed() -> None:
    runs = [_restart_run("radix-disk", 0, (60, 4000, 120.0), first_fails=True)]
    f = summarize(runs)["restart"]["radix-disk"]
    assert f["after_restart"]["n_errors"] == 1 and f["after_restart"]["first_prompt_ms"] is None
    row = restart_table(summarize(runs)["restart"]).splitlines()[2]
    assert row == ("| radix-disk | 3 | 200.0 | 100 / 8000 | - | - / - | - | 3.5 "
                   "| - | - | - |")
    # summary.json round trip keeps the table
    again = json.loads(json.dumps(summarize(RESTART_RESULTS)))["restart"]
    assert restart_table(again) == restart_table(summarize(RESTART_RESULTS)["restart"])
