"""One benchmark run = one cold server (or an external URL) taken through three phases.

1. warm-up: a few unrelated prompts (not measured) so first-call costs (allocator growth,
   kernel selection, lazy imports) do not land on the first measured request;
2. default slot clean-up: one short unrelated request. Starting a task makes the server save
   its idle slots to the host cache and, with unified KV, clear them (`--cache-idle-slots`, on
   by default): the state a production server is in between bursts. Nothing else is touched;
   the modes run with their default cache settings;
3. measurement: the scenario's sessions with its client concurrency, the server's RSS polled
   throughout;
4. final publish: the clean-up request once more, so the server publishes the slots the last
   measured requests left (as it would at its next task); `/metrics` is scraped before the
   measurement and after this step, so the host cache figures count every measured request's
   KV, in every mode alike. Then the prompts are tokenized by the server (/apply-template,
   /tokenize) to compute the prompt-token bound (`stats.prefix_bound`).

A scenario with `restart_after` (see scenarios.split_at_restart) measures a server restart:
phases 1-4 run on the first server with the sessions before the restart point; the final
publish (4) puts the last requests' KV into the host cache, and so into a disk tier, as the
server's next request would have; the server is stopped (SIGINT, SIGKILL after
RESTART_STOP_TIMEOUT_S) and a new one started with the same flags (`radix-disk`: the same
`--cache-disk` directory), /health awaited, then phases 1-4 again with the other sessions. The
new server's warm-up uses the same unrelated prompts, so its compute path is warm and the
first measured request after the restart times the restore (or recomputation) of its prefix,
not first-call costs. The figures cover both halves; `after_restart` (stats.restart_figures)
the second; the tier sizes come from the second server's last /metrics. External servers
(`--url`) cannot be restarted: such runs are refused (check_restart).

`radix-disk` runs get a fresh directory for `--cache-disk` (tempfile.mkdtemp), removed after
the run; its file count and bytes are recorded before removal (`disk_dir_files`,
`disk_dir_bytes`), a check on the server's own `radixserve:cache_tier_bytes{tier="disk"}`.
Note that the files the first server wrote are still in the OS page cache when the second
reads them: the restore time is that of a warm page cache, not of a cold disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from radixserve.bench.client import Messages, RequestOptions, run_sessions, sent_token_ids
from radixserve.bench.modes import Mode
from radixserve.bench.scenarios import (
    Scenario,
    Session,
    build_workload,
    cleanup_session,
    split_at_restart,
    warmup_sessions,
)
from radixserve.server_proc import RssSampler, ServerProcess
from radixserve.bench.stats import (
    MIB,
    RequestRecord,
    host_cache_figures,
    parse_prometheus,
    prefix_bound,
    sum_counter_figures,
    summarize_run,
    tier_figures,
    unshared_minimum,
)

log = logging.getLogger(__name__)
# the stop at a scenario's restart: SIGINT, then SIGKILL after this long. Longer than the
# final stop's, as a server with a disk tier may finish writing its files on the way out
RESTART_STOP_TIMEOUT_S = 60.0
# per-server counters (deltas over one server's measurement) summed over a restart
HOST_COUNTERS = ("host_saves", "host_loads", "host_hit_tokens", "host_evictions",
                 "host_fallbacks")


@dataclasses.dataclass(slots=True)
class BenchOptions:
    """What the CLI decided, shared by every run."""

    out_dir: Path
    repeats: int = 1
    model: str = "default"
    extra_server_args: list[str] = dataclasses.field(default_factory=list)
    url: str | None = None  # an already running server for every mode (else: Mode.url)


def server_args(s: Scenario, mode: Mode, opt: BenchOptions,
                disk_dir: Path | None = None) -> list[str]:
    """Scenario flags, then the user's, then the mode's (last wins, so a mode is never undone);
    a `cache_disk` mode's `--cache-disk disk_dir` at the very end."""
    args = ["-m", opt.model, "--metrics", *s.server_args, *opt.extra_server_args,
            *mode.server_flags]
    if mode.cache_disk:
        if disk_dir is None:
            raise ValueError(f"mode {mode.name} needs a directory for --cache-disk")
        args += ["--cache-disk", str(disk_dir)]
    return args


def restart_refusal(s: Scenario, mode: Mode, url: str) -> str:
    """Why a restart scenario cannot run against an external server, and what to do instead."""
    return (f"scenario {s.name!r} restarts the server after {s.restart_after} requests "
            f"(restart_after), which the benchmark can only do with servers it starts; "
            f"mode {mode.name!r} is the external server {url}. Run the scenario with "
            "--modes (e.g. no-cache,radix,radix-disk) and without --url")


def check_restart(scenarios: list[Scenario], modes: list[Mode], opt: BenchOptions) -> None:
    """Refuse, before anything runs, a scenario that restarts the server together with a mode
    that measures an external server (ValueError): we cannot restart what we did not start."""
    for s in scenarios:
        if s.restart_after is None:
            continue
        for m in modes:
            url = m.url or opt.url
            if url is not None:
                raise ValueError(restart_refusal(s, m, url))


async def _scrape(url: str) -> dict[str, float]:
    """/metrics as a dict; empty when the server has none (llama-server without --metrics)."""
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.get(url + "/metrics")
        return parse_prometheus(r.text) if r.status_code == 200 else {}
    except httpx.HTTPError:
        return {}


async def _model_id(url: str) -> str:
    """The first id of /v1/models: servers that check the `model` field (vLLM) need it."""
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            data = (await c.get(url + "/v1/models")).json().get("data") or []
        return str(data[0]["id"]) if data else "default"
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return "default"


@dataclasses.dataclass(slots=True)
class Part:
    """One server's measured phase: the whole run, or one side of a scenario's restart."""

    records: list[RequestRecord]
    wall_s: float
    sent: list[tuple[RequestRecord, Messages]]
    before: dict[str, float]  # /metrics before the measurement
    after: dict[str, float]  # /metrics after the final publish
    rss_start_mib: float | None
    rss_peak_mib: float | None
    t0: float  # time.perf_counter() when the measurement began (to order parts' requests)


async def _measure(url: str, s: Scenario, mode: Mode, pid: int | None,
                   on_done: Callable[[RequestRecord], None], sessions: list[Session]) -> Part:
    """Phases 1-4 of the module docstring on one server, measuring `sessions`."""
    opt = RequestOptions(s.n_predict, mode.cache_prompt and s.cache_prompt,
                         await _model_id(url), api=s.api)
    warm = warmup_sessions(s)
    if warm:
        await run_sessions(url, warm, min(s.concurrency, len(warm)), opt)
    await run_sessions(url, [cleanup_session(s)], 1, opt)
    opt = dataclasses.replace(opt, fields=s.request_fields)
    before = await _scrape(url)
    sampler = RssSampler(pid) if pid is not None else None
    rss_start = sampler.rss_bytes() / MIB if sampler else None
    sent: list[tuple[RequestRecord, Messages]] = []
    t0 = time.perf_counter()
    with sampler or contextlib.nullcontext():
        records, wall_s = await run_sessions(url, sessions, s.concurrency, opt, on_done, sent)
    await run_sessions(url, [cleanup_session(s)], 1, opt)  # final publish
    after = await _scrape(url)
    return Part(records, wall_s, sent, before, after, rss_start,
                sampler.peak_mib if sampler else None, t0)


async def _result(url: str, parts: list[Part]) -> dict[str, Any]:
    """A run's figures, requests and scrapes from its parts (one, or two around a restart).
    A request's `phase` is its part's index (1: after the restart) and its start time counts
    from the first part's start; wall time is the parts' sum (the restart itself is not
    serving time); host-cache counters are summed over the servers (each process counts from
    0), sizes and tier figures are the last server's. The prompts are tokenized by `url`, the
    last server (the same model and template as the first)."""
    records: list[RequestRecord] = []
    sent: list[tuple[RequestRecord, Messages]] = []
    for i, p in enumerate(parts):
        for r in p.records:
            r.phase = i
            r.t_start += p.t0 - parts[0].t0
        records += p.records
        sent += p.sent
    last = parts[-1]
    figures = summarize_run(records, sum(p.wall_s for p in parts))
    figures |= sum_counter_figures([host_cache_figures(p.before, p.after) for p in parts],
                                   HOST_COUNTERS)
    tiers = tier_figures(last.before, last.after)
    if any(v is not None for v in tiers.values()):  # only servers with cache tiers export them
        figures |= tiers
    ids = await sent_token_ids(url, sent)
    figures["prompt_tokens_bound"] = None if ids is None else prefix_bound([p for p, _ in ids])
    figures["prompt_tokens_min"] = None if ids is None else unshared_minimum(ids)
    figures["rss_start_mib"] = parts[0].rss_start_mib
    peaks = [p.rss_peak_mib for p in parts if p.rss_peak_mib is not None]
    figures["rss_peak_mib"] = max(peaks) if peaks else None
    out: dict[str, Any] = {"figures": figures,
                           "requests": [dataclasses.asdict(r) for r in records],
                           "metrics_before": last.before, "metrics_after": last.after}
    if len(parts) > 1:
        out["metrics_first_server"] = {"before": parts[0].before, "after": parts[0].after}
    return out


async def _phases(url: str, s: Scenario, mode: Mode, pid: int | None,
                  on_done: Callable[[RequestRecord], None]) -> dict[str, Any]:
    """A run on one server (no restart): phases 1-4 and the figures."""
    part = await _measure(url, s, mode, pid, on_done, build_workload(s))
    return await _result(url, [part])


def _rss_pid(srv: ServerProcess, mode: Mode) -> int | None:
    """The process whose memory the run reports: the server's; none for a cluster, whose
    command only drives Ray (its replicas are other processes)."""
    return srv.pid if mode.command == ("serve",) else None


def _run_with_restart(s: Scenario, mode: Mode, args: list[str], log_path: Path,
                      on_done: Callable[[RequestRecord], None]) -> dict[str, Any]:
    """The restart of the module docstring: the sessions before `restart_after` on one server,
    the rest on a new one started with the same `args`. Its log goes next to the first's
    (`<tag>__restarted.log`); `restart` in the result records the stop and start times and
    whether the first server exited on SIGINT or had to be killed."""
    first, rest = split_at_restart(s)
    with ServerProcess(args, log_path, command=mode.command) as srv:
        part1 = asyncio.run(_measure(srv.url, s, mode, _rss_pid(srv, mode), on_done, first))
        t = time.perf_counter()
        clean = srv.stop(RESTART_STOP_TIMEOUT_S)
        stop_s = time.perf_counter() - t
    log2 = log_path.with_name(log_path.stem + "__restarted" + log_path.suffix)
    t = time.perf_counter()
    with ServerProcess(args, log2, command=mode.command) as srv:
        start_s = time.perf_counter() - t  # to /health: model load plus any disk-tier scan
        part2 = asyncio.run(_measure(srv.url, s, mode, _rss_pid(srv, mode), on_done, rest))
        out = asyncio.run(_result(srv.url, [part1, part2]))
    out["restart"] = {"after_requests": sum(len(x.user_turns) for x in first),
                      "stop_s": stop_s, "stopped_on_sigint": clean, "start_s": start_s,
                      "log": str(log2)}
    out["figures"] |= {"restart_stop_s": stop_s, "restart_start_s": start_s}
    return out


def dir_usage(path: Path) -> tuple[int, int] | None:
    """(files, bytes) under `path`, recursively: what a disk tier left there; None if it
    cannot be read (the run's result must still be written)."""
    try:
        files = [p for p in path.rglob("*") if p.is_file()]
        return len(files), sum(p.stat().st_size for p in files)
    except OSError:
        return None


def run_one(s: Scenario, mode: Mode, repeat: int, opt: BenchOptions,
            on_done: Callable[[RequestRecord], None]) -> dict[str, Any]:
    """One run; its JSON goes to runs/, the server log to logs/. Failures are recorded."""
    tag = f"{s.name}__{mode.name}__r{repeat}"
    url = mode.url or opt.url
    # the speculation type we set (an external server's own flags are not known here)
    result: dict[str, Any] = {"scenario": s.name, "mode": mode.name, "repeat": repeat,
                              "spec": None if url else mode.spec}
    disk_dir: Path | None = None
    try:
        if url is not None:
            result["url"] = url
            if s.restart_after is not None:
                raise ValueError(restart_refusal(s, mode, url))
            result |= asyncio.run(_phases(url.rstrip("/"), s, mode, None, on_done))
        else:
            if mode.cache_disk:  # fresh per run: every run starts cold on disk too
                disk_dir = Path(tempfile.mkdtemp(prefix=f"radixserve-bench-{tag}-"))
                result["disk_dir"] = str(disk_dir)
            args = server_args(s, mode, opt, disk_dir)
            result["server_args"] = args
            log_path = opt.out_dir / "logs" / f"{tag}.log"
            if s.restart_after is not None:
                result |= _run_with_restart(s, mode, args, log_path, on_done)
            else:
                with ServerProcess(args, log_path, command=mode.command) as srv:
                    result |= asyncio.run(_phases(srv.url, s, mode, _rss_pid(srv, mode), on_done))
    except Exception as e:  # one broken run must not lose the others
        log.error("run %s failed: %s", tag, e)
        result["error"] = "".join(traceback.format_exception_only(e)).strip()
        result["traceback"] = traceback.format_exc()
    finally:  # the servers are stopped by now: nothing writes there any more
        if disk_dir is not None:
            usage = dir_usage(disk_dir)
            if "figures" in result and usage is not None:
                result["figures"] |= {"disk_dir_files": usage[0], "disk_dir_bytes": usage[1]}
            shutil.rmtree(disk_dir, ignore_errors=True)
    path = opt.out_dir / "runs" / f"{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return result


def run_all(scenarios: list[Scenario], modes: list[Mode],
            opt: BenchOptions) -> list[dict[str, Any]]:
    """Every scenario x repeat x mode (modes interleaved within a repeat, so slow drift of a
    shared machine spreads over all modes), with one progress bar over measured requests.
    Refuses (ValueError, before any run) a restart scenario with an external server."""
    check_restart(scenarios, modes, opt)
    n_req = sum(len(x.user_turns) for s in scenarios for x in build_workload(s))
    results: list[dict[str, Any]] = []
    with tqdm(total=n_req * len(modes) * opt.repeats, unit="req", dynamic_ncols=True) as bar:
        for s in scenarios:
            for k in range(opt.repeats):
                for mode in modes:
                    bar.set_description(f"{s.name} {mode.name} r{k + 1}/{opt.repeats}")
                    results.append(run_one(s, mode, k, opt, lambda _: bar.update(1)))
    return results
