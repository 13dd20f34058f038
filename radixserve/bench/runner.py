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
   /tokenize) to compute the prompt-token bound of issue #5 (`stats.prefix_bound`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from radixserve.bench.client import Messages, RequestOptions, prompt_token_ids, run_sessions
from radixserve.bench.modes import Mode
from radixserve.bench.scenarios import (
    Scenario,
    build_workload,
    cleanup_session,
    warmup_sessions,
)
from radixserve.bench.server_proc import RssSampler, ServerProcess
from radixserve.bench.stats import (
    MIB,
    RequestRecord,
    host_cache_figures,
    parse_prometheus,
    prefix_bound,
    summarize_run,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class BenchOptions:
    """What the CLI decided, shared by every run."""

    out_dir: Path
    repeats: int = 1
    model: str = "default"
    extra_server_args: list[str] = dataclasses.field(default_factory=list)
    url: str | None = None  # an already running server for every mode (else: Mode.url)


def server_args(s: Scenario, mode: Mode, opt: BenchOptions) -> list[str]:
    """Scenario flags, then the user's, then the mode's (last wins, so a mode is never undone)."""
    return ["-m", opt.model, "--metrics", *s.server_args, *opt.extra_server_args,
            *mode.server_flags]


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


async def _phases(url: str, s: Scenario, mode: Mode, pid: int | None,
                  on_done: Callable[[RequestRecord], None]) -> dict[str, Any]:
    opt = RequestOptions(s.n_predict, mode.cache_prompt and s.cache_prompt,
                         await _model_id(url))
    warm = warmup_sessions(s)
    if warm:
        await run_sessions(url, warm, min(s.concurrency, len(warm)), opt)
    await run_sessions(url, [cleanup_session(s)], 1, opt)
    opt = dataclasses.replace(opt, fields=s.request_fields)
    before = await _scrape(url)
    sampler = RssSampler(pid) if pid is not None else None
    rss_start = sampler.rss_bytes() / MIB if sampler else None
    sent: list[tuple[RequestRecord, Messages]] = []
    with sampler or contextlib.nullcontext():
        records, wall_s = await run_sessions(url, build_workload(s), s.concurrency, opt, on_done,
                                             sent)
    await run_sessions(url, [cleanup_session(s)], 1, opt)  # final publish
    after = await _scrape(url)
    figures = summarize_run(records, wall_s)
    figures |= host_cache_figures(before, after)
    prompts = await prompt_token_ids(url, sent)
    figures["prompt_tokens_bound"] = None if prompts is None else prefix_bound(prompts)
    figures["rss_start_mib"] = rss_start
    figures["rss_peak_mib"] = sampler.peak_mib if sampler else None
    return {"figures": figures, "requests": [dataclasses.asdict(r) for r in records],
            "metrics_before": before, "metrics_after": after}


def run_one(s: Scenario, mode: Mode, repeat: int, opt: BenchOptions,
            on_done: Callable[[RequestRecord], None]) -> dict[str, Any]:
    """One run; its JSON goes to runs/, the server log to logs/. Failures are recorded."""
    tag = f"{s.name}__{mode.name}__r{repeat}"
    url = mode.url or opt.url
    # the speculation type we set (an external server's own flags are not known here)
    result: dict[str, Any] = {"scenario": s.name, "mode": mode.name, "repeat": repeat,
                              "spec": None if url else mode.spec}
    try:
        if url is not None:
            result["url"] = url
            result |= asyncio.run(_phases(url.rstrip("/"), s, mode, None, on_done))
        else:
            args = server_args(s, mode, opt)
            result["server_args"] = args
            with ServerProcess(args, opt.out_dir / "logs" / f"{tag}.log") as srv:
                result |= asyncio.run(_phases(srv.url, s, mode, srv.pid, on_done))
    except Exception as e:  # one broken run must not lose the others
        log.error("run %s failed: %s", tag, e)
        result["error"] = "".join(traceback.format_exception_only(e)).strip()
        result["traceback"] = traceback.format_exc()
    path = opt.out_dir / "runs" / f"{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return result


def run_all(scenarios: list[Scenario], modes: list[Mode],
            opt: BenchOptions) -> list[dict[str, Any]]:
    """Every scenario x repeat x mode (modes interleaved within a repeat, so slow drift of a
    shared machine spreads over all modes), with one progress bar over measured requests."""
    n_req = sum(len(x.user_turns) for s in scenarios for x in build_workload(s))
    results: list[dict[str, Any]] = []
    with tqdm(total=n_req * len(modes) * opt.repeats, unit="req", dynamic_ncols=True) as bar:
        for s in scenarios:
            for k in range(opt.repeats):
                for mode in modes:
                    bar.set_description(f"{s.name} {mode.name} r{k + 1}/{opt.repeats}")
                    results.append(run_one(s, mode, k, opt, lambda _: bar.update(1)))
    return results
