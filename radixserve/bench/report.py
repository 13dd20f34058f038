"""Turn run results into the deliverables: summary JSON, a Markdown table, PNG bar charts.

The summary is `{scenario: {mode: medians over the repeats that succeeded}}`; failed runs are
listed, never averaged in. Plots are grouped bars (x: scenario, one bar per mode) so one figure
compares every mode on every scenario that was run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

from radixserve.bench.stats import MIB, aggregate  # noqa: E402

Summary = dict[str, dict[str, dict[str, Any]]]

COLUMNS: tuple[tuple[str, str], ...] = (
    ("hit rate", "hit_rate"),
    ("reused / computed tok", "tokens"),
    ("TTFT p50 ms", "ttft_p50_ms"),
    ("TTFT p95 ms", "ttft_p95_ms"),
    ("E2E p50 ms", "e2e_p50_ms"),
    ("E2E p95 ms", "e2e_p95_ms"),
    ("req/s", "req_per_s"),
    ("gen tok/s", "gen_tok_per_s"),
    ("prefill tok/s p50", "prefill_tok_s_p50"),
    ("decode tok/s p50", "decode_tok_s_p50"),
    ("draft accept", "draft_acceptance"),
    ("acc / step", "draft_accepted_per_step"),
    ("host MiB", "host_cache_mib"),
    ("unique / logical tok", "stored"),
    ("peak RSS MiB", "rss_peak_mib"),
)


def summarize(results: list[dict[str, Any]]) -> Summary:
    """Medians per (scenario, mode) over the runs that produced figures; where two or more
    modes ran, each mode's `outputs_differ` / `outputs_compared` (`compare_outputs`)."""
    grouped: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in results:
        runs = grouped.setdefault(r["scenario"], {}).setdefault(r["mode"], [])
        if "figures" in r:
            runs.append(r["figures"])
    out = {s: {m: aggregate(runs) for m, runs in modes.items()} for s, modes in grouped.items()}
    for s, cmp in compare_outputs(results).items():
        for m, n in cmp["by_mode"].items():
            out[s][m] |= {"outputs_differ": n, "outputs_compared": cmp["n_compared"][m]}
    return out


def compare_outputs(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per scenario run in two or more modes: do the modes generate the same text for the same
    request (session, turn)? Greedy decoding makes the reply a function of the prompt, so a
    cache or a speculation mode that changes it changed the numbers, not just the speed.

    The reference is the first mode's first run. Returns {scenario: {"reference": mode,
    "n_requests": requests the reference answered, "n_differ": those whose reply differs in
    any other run (any mode, any repeat), "differ": their "session/turn" keys, "by_mode":
    {mode: requests whose reply in some run of that mode differs from the reference},
    "n_compared": {mode: requests both answered}}}. Failed requests are left out."""
    per: dict[str, list[tuple[str, dict[tuple[str, int], str]]]] = {}
    for r in results:
        replies = {(q["session"], q["turn"]): q["reply"] for q in r.get("requests") or []
                   if q.get("error") is None and q.get("reply") is not None}
        if replies:
            per.setdefault(r["scenario"], []).append((r["mode"], replies))
    out: dict[str, dict[str, Any]] = {}
    for scenario, runs in per.items():
        modes = list(dict.fromkeys(m for m, _ in runs))
        if len(modes) < 2:
            continue
        ref = runs[0][1]
        differ: set[tuple[str, int]] = set()
        by_mode = {m: set() for m in modes}
        compared = {m: set() for m in modes}
        for m, replies in runs[1:]:
            for key, text in replies.items():
                if key in ref:
                    compared[m].add(key)
                    if text != ref[key]:
                        differ.add(key)
                        by_mode[m].add(key)
        compared[modes[0]] |= set(ref)
        out[scenario] = {
            "reference": modes[0], "n_requests": len(ref), "n_differ": len(differ),
            "differ": [f"{sess}/{turn}" for sess, turn in sorted(differ)],
            "by_mode": {m: len(v) for m, v in by_mode.items()},
            "n_compared": {m: len(v) for m, v in compared.items()},
        }
    return out


def outputs_line(cmp: dict[str, Any]) -> str:
    """The report's one-line verdict of `compare_outputs` for a scenario."""
    if not cmp["n_differ"]:
        return (f"- outputs identical across modes: yes ({cmp['n_requests']} requests, "
                f"{len(cmp['by_mode'])} modes)")
    modes = ", ".join(f"{m} {n}" for m, n in cmp["by_mode"].items() if n)
    return (f"- outputs identical across modes: no ({cmp['n_differ']} of {cmp['n_requests']} "
            f"requests differ from {cmp['reference']}: {modes})")


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _cell(f: dict[str, Any], key: str) -> str:
    if key in ("hit_rate", "draft_acceptance"):
        return _num(None if f.get(key) is None else 100 * f[key], ".1f") + (
            "%" if f.get(key) is not None else "")
    if key == "draft_accepted_per_step":
        return _num(f.get(key), ".2f")
    if key == "tokens":
        return f"{_num(f.get('prompt_tokens_reused'), '.0f')} / " \
               f"{_num(f.get('prompt_tokens_computed'), '.0f')}"
    if key == "stored":
        return f"{_num(f.get('unique_tokens'), '.0f')} / {_num(f.get('logical_tokens'), '.0f')}"
    return _num(f.get(key), ".2f" if key.endswith("per_s") else ".1f")


def markdown_table(modes: dict[str, dict[str, Any]]) -> str:
    """One row per mode, the columns of COLUMNS (medians; '-' where the figure is unknown)."""
    head = "| mode | runs | " + " | ".join(c for c, _ in COLUMNS) + " |"
    sep = "| --- | ---: | " + " | ".join("---:" for _ in COLUMNS) + " |"
    rows = [f"| {m} | {f.get('repeats', 0)} | " + " | ".join(_cell(f, k) for _, k in COLUMNS)
            + " |" for m, f in modes.items()]
    return "\n".join([head, sep, *rows])


def _tok(v: Any) -> str:
    """A median token count: whole, else one decimal (a median between two counts)."""
    return _num(v, ".0f" if v is None or float(v).is_integer() else ".1f")


def turn_table(modes: dict[str, dict[str, Any]]) -> str | None:
    """Multi-turn scenarios: one row per turn, per mode the medians of prompt tokens computed /
    reused (`prompt_n` / `cache_n`) and TTFT over that turn's requests (then over repeats).
    None when no mode has per-turn figures."""
    per = {m: f["by_turn"] for m, f in modes.items() if f.get("by_turn")}
    if not per:
        return None
    # summary.json round trips turn numbers as strings
    turns = sorted({int(t) for bt in per.values() for t in bt})
    head = "| turn | " + " | ".join(f"{m} computed / reused | {m} TTFT p50 ms"
                                    for m in per) + " |"
    sep = "| ---: | " + " | ".join("---: | ---:" for _ in per) + " |"
    rows = []
    for t in turns:
        cells = []
        for bt in per.values():
            f = bt.get(t, bt.get(str(t), {}))
            tokens = f"{_tok(f.get('prompt_n_p50'))} / {_tok(f.get('cache_n_p50'))}"
            cells += [tokens, _num(f.get("ttft_p50_ms"), ".1f")]
        rows.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join([head, sep, *rows])


RESTART_HEAD = ("after restart: requests", "TTFT p50 ms", "computed / reused tok",
                "1st: prompt ms", "1st: computed / reused tok", "1st: TTFT ms",
                "server start s", "disk MiB", "disk tok", "disk bytes / tok")


def restart_table(modes: dict[str, dict[str, Any]]) -> str | None:
    """Scenarios that restart the server, or runs with a disk tier: one row per mode with the
    requests sent after the restart (TTFT p50, prompt tokens computed / reused), the first of
    them alone (the server's `prompt_ms` and computed / reused: a long prefix restored from
    disk vs computed again), the restarted server's time to /health, and the disk tier at the
    end (`radixserve:cache_tier_bytes` / `_tokens{tier="disk"}` of the last server and their
    ratio). '-' where unknown: no restart, no disk tier, a server without those metrics.
    None when no mode has any of it."""
    if not any(f.get("after_restart") or f.get("disk_bytes") is not None
               or f.get("disk_tokens") is not None for f in modes.values()):
        return None
    head = "| mode | " + " | ".join(RESTART_HEAD) + " |"
    sep = "| --- | " + " | ".join("---:" for _ in RESTART_HEAD) + " |"
    rows = []
    for m, f in modes.items():
        a = f.get("after_restart") or {}
        disk = f.get("disk_bytes")
        cells = [
            _tok(a.get("n_requests")),
            _num(a.get("ttft_p50_ms"), ".1f"),
            f"{_tok(a.get('prompt_tokens_computed'))} / {_tok(a.get('prompt_tokens_reused'))}",
            _num(a.get("first_prompt_ms"), ".1f"),
            f"{_tok(a.get('first_prompt_n'))} / {_tok(a.get('first_cache_n'))}",
            _num(a.get("first_ttft_ms"), ".1f"),
            _num(f.get("restart_start_s"), ".1f"),
            _num(None if disk is None else disk / MIB, ".1f"),
            _tok(f.get("disk_tokens")),
            _num(f.get("disk_bytes_per_token"), ".0f"),
        ]
        rows.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join([head, sep, *rows])


def host_ratio(modes: dict[str, dict[str, Any]]) -> float | None:
    """radix's host bytes over legacy's (medians), when both ran (the radix tree's goal: <= 1/3)."""
    radix, legacy = (modes.get(m, {}).get("host_cache_mib") for m in ("radix", "legacy"))
    return radix / legacy if radix is not None and legacy else None


def markdown_report(summary: Summary, results: list[dict[str, Any]],
                    descriptions: dict[str, str] | None = None) -> str:
    """All scenarios' tables, per-group hit rates where a scenario has groups, and failures."""
    out = ["# radixserve bench summary", "",
           "Medians over repeats (each repeat = a cold server per mode). Hit rate = reused / "
           "(reused + computed) prompt tokens, from the server's per-request `timings`. "
           "Decode tok/s: median over requests of `timings.predicted_per_second`. Draft "
           "accept = accepted / proposed draft tokens (`timings.draft_n_accepted` / `draft_n`), "
           "acc / step = accepted draft tokens per decode step of the target; '-' without "
           "speculation.", ""]
    outputs = compare_outputs(results)
    for scenario, modes in summary.items():
        out += [f"## {scenario}", ""]
        if descriptions and descriptions.get(scenario):
            out += [descriptions[scenario], ""]
        out += [markdown_table(modes), ""]
        restart = restart_table(modes)
        if restart is not None:
            out += ["After the restart (the requests sent to the restarted server; 1st = the "
                    "first of them: `timings.prompt_ms` and prompt tokens computed / reused, "
                    "i.e. its prefix restored or computed again; server start = new process "
                    "to /health; disk = the last server's /metrics at the end, "
                    "`radixserve:cache_tier_bytes` / `_tokens{tier=\"disk\"}`):", "",
                    restart, ""]
        turns = turn_table(modes)
        if turns is not None:
            out += ["Per turn (medians over the turn's requests, then over repeats; prompt "
                    "tokens computed / reused are `timings.prompt_n` / `cache_n`):", "",
                    turns, ""]
        for m, f in modes.items():
            groups = f.get("hit_rate_by_group")
            if groups:
                parts = ", ".join(f"{g} {100 * v:.1f}%" for g, v in groups.items() if v is not None)
                out.append(f"- {m}: hit rate by group: {parts}")
            extra = [f"{k.removeprefix('host_')} {f[k]:.0f}" for k in
                     ("host_saves", "host_loads", "host_hit_tokens", "host_evictions",
                      "host_fallbacks") if f.get(k) is not None]
            if extra:
                out.append(f"- {m}: host cache during measurement: {', '.join(extra)}")
            disk = [f"{k.removeprefix('disk_').replace('_', ' ')} {f[k]:.0f}" for k in
                    ("disk_hits", "disk_misses", "disk_hit_tokens", "disk_writes",
                     "disk_evictions", "disk_bad_files", "disk_write_errors", "disk_dropped")
                    if f.get(k) is not None]
            if disk:
                out.append(f"- {m}: disk tier during measurement (last server): "
                           f"{', '.join(disk)}")
            if f.get("disk_dir_bytes") is not None:
                out.append(f"- {m}: --cache-disk directory at the end: "
                           f"{_tok(f.get('disk_dir_files'))} files, "
                           f"{f['disk_dir_bytes'] / MIB:.1f} MiB")
            if f.get("prompt_tokens_bound") is not None and m != "no-cache":
                out.append(f"- {m}: prompt tokens computed {f['prompt_tokens_computed']:.0f}, "
                           f"bound {f['prompt_tokens_bound']:.0f} (what no earlier prompt "
                           "shared + 1 per request)")
            if f.get("prompt_tokens_min") is not None:
                out.append(f"- {m}: prompt tokens computed {f['prompt_tokens_computed']:.0f} = "
                           f"{f['prompt_tokens_computed'] / max(1, f['prompt_tokens_min']):.2f}x "
                           f"the unshared minimum {f['prompt_tokens_min']:.0f} (what no earlier "
                           "prompt or decoded answer held, + each prompt's last token)")
            if f.get("draft_n") is not None:
                out.append(f"- {m}: draft tokens accepted / proposed "
                           f"{_tok(f.get('draft_n_accepted'))} / {_tok(f['draft_n'])}")
            if f.get("n_errors"):
                out.append(f"- {m}: {f['n_errors']:.0f} failed requests (median per run)")
        ratio = host_ratio(modes)
        if ratio is not None:
            out.append(f"- host cache bytes radix / legacy: {ratio:.2f}")
        if scenario in outputs:
            out.append(outputs_line(outputs[scenario]))
        out.append("")
    failed = [r for r in results if "error" in r]
    if failed:
        out += ["## Failed runs", ""]
        out += [f"- {r['scenario']} / {r['mode']} / r{r['repeat']}: {r['error']}" for r in failed]
        out.append("")
    return "\n".join(out)


def _bars(summary: Summary, key: str, ylabel: str, title: str, path: Path,
          scale: float = 1.0, whisker_key: str | None = None, log_y: bool = False) -> Path:
    scenarios = list(summary)
    modes = list(dict.fromkeys(m for s in scenarios for m in summary[s]))
    # a log axis needs a positive value (every request failed: no TTFT at all)
    log_y = log_y and any((summary[s].get(m, {}).get(key) or 0.0) > 0
                          for s in scenarios for m in modes)
    width = 0.8 / max(1, len(modes))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(scenarios) + 2.0), 4.5))
    for i, m in enumerate(modes):
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(scenarios))]
        vals = [(summary[s].get(m, {}).get(key) or 0.0) * scale for s in scenarios]
        if log_y:
            vals = [v if v > 0 else math.nan for v in vals]
        ax.bar(xs, vals, width, label=m)
        if whisker_key:
            tops = [(summary[s].get(m, {}).get(whisker_key) or 0.0) * scale for s in scenarios]
            ax.errorbar(xs, vals, yerr=[[0] * len(vals), [max(0.0, t - v) for t, v in
                                                        zip(tops, vals)]],
                        fmt="none", ecolor="black", capsize=3, linewidth=1)
    ax.set_xticks(range(len(scenarios)), scenarios, rotation=20, ha="right")
    if log_y:  # TTFT spans 0.1 s (hits) to tens of seconds (long cold prefills)
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(summary: Summary, out_dir: Path) -> list[Path]:
    """ttft.png (p50 bars, p95 whiskers), hit_rate.png, host_mib.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        _bars(summary, "ttft_p50_ms", "TTFT ms", "Time to first token (bar p50, whisker p95)",
              out_dir / "ttft.png", whisker_key="ttft_p95_ms", log_y=True),
        _bars(summary, "hit_rate", "% of prompt tokens reused", "Prompt cache hit rate",
              out_dir / "hit_rate.png", scale=100.0),
        _bars(summary, "host_cache_mib", "MiB", "Host cache size after the run",
              out_dir / "host_mib.png"),
    ]


def write_report(results: list[dict[str, Any]], out_dir: Path,
                 descriptions: dict[str, str] | None = None) -> dict[str, Path]:
    """summary.json, summary.md, outputs.json (`compare_outputs`) and the plots under
    `out_dir`; returns their paths."""
    summary = summarize(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"summary.json": out_dir / "summary.json", "summary.md": out_dir / "summary.md",
             "outputs.json": out_dir / "outputs.json"}
    paths["summary.json"].write_text(json.dumps(summary, indent=1))
    paths["outputs.json"].write_text(json.dumps(compare_outputs(results), indent=1))
    paths["summary.md"].write_text(markdown_report(summary, results, descriptions))
    for p in write_plots(summary, out_dir):
        paths[p.name] = p
    return paths
