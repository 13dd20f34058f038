"""`radixserve bench soak [options] [-- server flags]`: a reliability soak of one server process.

C workers share one seeded plan of N items (soak_judge.KINDS; how each is sent: soak_traffic):
completions and chats, plain and streamed, on a few shared documents with and without a
tenant's cache_salt; streams abandoned after 0-6 events, or before any byte of the answer (FIN
or reset); non-streamed requests whose client times out; malformed and oversized bodies; slot
save/restore/erase, amid the traffic (a busy slot's 409 is expected) or drained (alone, after
checking that every slot goes idle once no client is left); cache flushes; long unique prompts
that push the RAM and disk tiers into eviction. Traffic goes to 127.0.0.1 only: a server the
soak starts (`--metrics`, `--slot-save-path` on a temporary directory, a small `--cache-ram`,
`--max-body-mib 1`, with `--disk` a small disk tier; server flags after `--` are passed on) or
`--url` of a running one. It stops by itself: after N items, or at the `--max-minutes` safety
stop.

It fails (exit 1) on any of:
- an answer that is not the expected one (a refusal must be the right 4xx in OpenAI's error
  shape; no answer is expected only when the client left), and any 5xx;
- a slot processing, or a request counted as processing or deferred in /metrics,
  `--idle-wait-s` after the traffic: a client that left must have freed its slot (requests
  the client leaves ask for 1024 tokens, so a task nobody cancelled is still running then);
- the probe's tokens changed: a greedy /completion of fixed length sent before and after the
  traffic, once with cache_prompt false (every token computed), then twice with it (the second
  reusing the first's prompt). Uncached at the end must equal uncached at the start (the
  traffic left nothing behind that changes a computation); in deterministic mode (the default
  where the compute path supports it, `/props`) cached must equal uncached, bitwise;
- the server's peak RSS over its budget: RSS right after the first probe (model loaded, KV
  pool allocated) + the server's `--cache-ram` + RSS_ALLOWANCE_MIB for what lives outside
  both and is bounded: allocator arenas and fragmentation under C concurrent requests, the
  activations of a long prefill, request bodies, slot files and disk-tier blocks in flight,
  HTTP buffers. A leak per request outgrows it over a long soak; a bounded working set does not.

Writes `soak.json` (counts, per kind, the 5xx and unexpected answers with excerpts, final slot
states, probes, the RSS series, cache figures, the machine and the command), `soak_rss.png`
and `server.log` under `--out`, and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import shlex
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from tqdm import tqdm

from radixserve.bench.runner import dir_usage
from radixserve.bench.scenarios import make_text
from radixserve.server_proc import RssSampler, ServerProcess
from radixserve.bench.soak_judge import (
    EXPECTED,
    SERVER_ERROR,
    UNEXPECTED,
    Outcome,
    counts,
    failures,
    make_plan,
    probe_verdict,
    rss_figures,
)
from radixserve.bench.soak_traffic import REQUEST_TIMEOUT_S, Sizes, Traffic, run_plan
from radixserve.bench.stats import MIB, host_cache_figures, parse_prometheus, tier_figures
from radixserve.config import ServerConfig

RSS_ALLOWANCE_MIB = 512.0  # see the module docstring
MAX_LISTED = 200  # answers listed one by one in the report, per list
# a fixed greedy completion of fixed length: its tokens must not change
PROBE_BODY: dict[str, Any] = {
    "prompt": "Continue the list.\n" + make_text(random.Random(7), 96),
    "n_predict": 32, "temperature": 0.0, "seed": 1234, "ignore_eos": True,
    "return_tokens": True,
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="radixserve bench soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="plan items (default: %(default)s)")
    ap.add_argument("--concurrency", type=int, default=32, help="workers (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="the plan's seed (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default: bench-results/soak-<UTC time>)")
    ap.add_argument("-m", "--model", default="default", help="model of the server we start")
    ap.add_argument("--url", default=None, help="soak this running server (127.0.0.1 only; "
                    "it needs --metrics and --slot-save-path) instead of starting one")
    ap.add_argument("--disk", action="store_true", help="start the server with a disk tier "
                    "(--cache-disk on a temporary directory)")
    ap.add_argument("--cache-disk-mib", type=int, default=64, help="its bound (default: "
                    "%(default)s, small so long prompts evict)")
    ap.add_argument("--cache-ram", type=int, default=64, help="the server's --cache-ram MiB "
                    "(default: %(default)s, small so long prompts evict)")
    ap.add_argument("--slot-save-path", type=Path, default=None,
                    help="the server's --slot-save-path (default: a temporary directory)")
    ap.add_argument("--max-body-mib", type=int, default=None, help="the server's "
                    "--max-body-mib (default: 1 for a server we start, the server default "
                    "with --url); oversized bodies go just past it")
    ap.add_argument("--rss-interval-s", type=float, default=0.5,
                    help="RSS sampling period (default: %(default)s)")
    ap.add_argument("--rss-allowance-mib", type=float, default=RSS_ALLOWANCE_MIB,
                    help="RSS allowed above baseline + --cache-ram (default: %(default)s)")
    ap.add_argument("--max-minutes", type=float, default=90.0,
                    help="safety stop: no new item after this long (default: %(default)s)")
    ap.add_argument("--idle-wait-s", type=float, default=30.0,
                    help="how long the slots may take to go idle (default: %(default)s)")
    ap.add_argument("--doc-tokens", type=int, default=Sizes().doc_tokens,
                    help="tokens of each shared document (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=Sizes().max_tokens,
                    help="n_predict of normal requests: 8 .. this (default: %(default)s)")
    ap.add_argument("--pressure-tokens", type=int, default=Sizes().pressure_tokens,
                    help="long unique prompts: half of this .. this (default: %(default)s)")
    return ap


class RssSeries(RssSampler):
    """The bench's RSS sampler, keeping every sample: (seconds since start, MiB)."""

    def __init__(self, pid: int, interval_s: float) -> None:
        super().__init__(pid, interval_s)
        self.t0 = time.monotonic()
        self.series: list[tuple[float, float]] = []

    def _loop(self) -> None:
        while not self._stop.is_set():
            rss = self.rss_bytes()
            self.peak_bytes = max(self.peak_bytes, rss)
            self.series.append((round(time.monotonic() - self.t0, 2), round(rss / MIB, 1)))
            self._stop.wait(self.interval_s)

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)


def log_problems(path: Path, keep: int = 5) -> dict[str, Any]:
    """The server log's ERROR and WARNING lines (counts, the first few): reported, not judged;
    a handler that logs a traceback for a client's doing shows up here."""
    out: dict[str, Any] = {}
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    for level in ("ERROR", "WARNING"):
        hits = [ln for ln in lines if re.search(rf"\b{level}\b", ln)]
        out[level.lower()] = {"n": len(hits), "first": [h[:300] for h in hits[:keep]]}
    return out


def rss_high_water_mib(pid: int) -> float | None:
    """The kernel's high-water mark of the process's RSS (Linux: VmHWM), the true peak, which
    sampling every --rss-interval-s can miss; None elsewhere."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


async def run_probe(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    """The probe once with cache_prompt false (every token computed), then twice with it (the
    second reuses the first's prompt): their tokens and cache_n."""
    out: dict[str, Any] = {"uncached": None, "cached": [], "cache_n": []}
    for cache_prompt in (False, True, True):
        r = await client.post(url + "/completion", timeout=REQUEST_TIMEOUT_S,
                              json=PROBE_BODY | {"cache_prompt": cache_prompt})
        r.raise_for_status()
        data = r.json()
        if cache_prompt:
            out["cached"].append(data["tokens"])
        else:
            out["uncached"] = data["tokens"]
        out["cache_n"].append(data["timings"]["cache_n"])
    return out


async def _scrape(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
    """/metrics as a dict; None without it (a --url server without --metrics, or gone)."""
    try:
        r = await client.get(url + "/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    return parse_prometheus(r.text) if r.status_code == 200 else None


async def wait_idle(client: httpx.AsyncClient, url: str, timeout_s: float) -> dict[str, Any]:
    """Poll /slots and /metrics until no slot is processing and no request is counted as
    processing or deferred, for at most `timeout_s`; the last states seen."""
    t0 = time.monotonic()
    while True:
        error, slots, metrics = None, [], {}
        try:
            slots = (await client.get(url + "/slots", timeout=30)).json()
            metrics = await _scrape(client, url) or {}
        except (httpx.HTTPError, ValueError) as e:  # a server gone is not idle
            error = f"{type(e).__name__}: {e}"
        busy = [s["id"] for s in slots if s.get("is_processing")]
        processing = metrics.get("llamacpp:requests_processing")
        deferred = metrics.get("llamacpp:requests_deferred")
        idle = error is None and not busy and not processing and not deferred
        waited = time.monotonic() - t0
        if idle or waited > timeout_s:
            return {"idle": idle, "waited_s": round(waited, 2), "busy_slots": busy,
                    "requests_processing": processing, "requests_deferred": deferred,
                    "error": error,
                    "slots": [{k: v for k, v in s.items() if k != "params"} for s in slots]}
        await asyncio.sleep(0.25)


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                    .splitlines() if ln.startswith("model name")), cpu)
    return {"cpu": cpu, "logical_cores": os.cpu_count(),
            "physical_cores": psutil.cpu_count(logical=False),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "load_average_at_start": os.getloadavg(), "platform": platform.platform(),
            "python": platform.python_version()}


def _listed(outcomes: list[Outcome], verdict: str) -> list[dict[str, Any]]:
    return [{"index": o.index, "kind": o.kind, "variant": o.variant, "status": o.status,
             "error": o.error, "request": o.request, "response": o.response}
            for o in outcomes if o.verdict == verdict][:MAX_LISTED]


async def soak(url: str, a: argparse.Namespace, sampler: RssSeries | None) -> dict[str, Any]:
    """Probe, traffic, idle wait, probe; the report (without the RSS verdict)."""
    limits = httpx.Limits(max_connections=a.concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        props = (await client.get(url + "/props", timeout=30)).json()
        cache_ram = (props.get("prompt_cache") or {}).get("cache_ram_mib")
        start = await _guarded_probe(client, url)
        baseline = sampler.rss_bytes() / MIB if sampler else None
        before = await _scrape(client, url)
        max_body = a.max_body_mib or ServerConfig().max_body_mib
        sizes = Sizes(doc_tokens=a.doc_tokens, max_tokens=a.max_tokens,
                      pressure_tokens=a.pressure_tokens)
        tr = Traffic(url, client, int(props["total_slots"]), max_body * MIB, sizes)
        plan = make_plan(a.requests, a.seed)
        t_traffic = (sampler.now() if sampler else 0.0, time.monotonic())
        with tqdm(total=len(plan), unit="item", desc="soak", dynamic_ncols=True) as bar:
            outcomes, ran = await run_plan(tr, plan, a.concurrency,
                                           time.monotonic() + a.max_minutes * 60,
                                           lambda _: bar.update(1))
        traffic_s = time.monotonic() - t_traffic[1]
        t_end = sampler.now() if sampler else 0.0
        final = await wait_idle(client, url, a.idle_wait_s)
        after = await _scrape(client, url)
        end = await _guarded_probe(client, url)
    clock0 = sampler.t0 if sampler else t_traffic[1]
    cache = (host_cache_figures(before, after) | tier_figures(before, after)
             if before is not None and after is not None else None)
    return {"planned": len(plan), "items_run": ran, "completed": ran == len(plan),
            "traffic_s": round(traffic_s, 1), "counts": counts(outcomes),
            "server_errors": _listed(outcomes, SERVER_ERROR),
            "unexpected_failures": _listed(outcomes, UNEXPECTED), "final": final,
            "probe": probe_verdict(start, end, bool(props.get("deterministic"))),
            "cache": cache, "cache_ram_mib": cache_ram, "baseline_mib": baseline,
            "traffic_window_s": [t_traffic[0], t_end],
            # [index, kind, variant, status, verdict, sent at (the RSS series' clock), seconds,
            #  SSE events read]
            "outcomes": [[o.index, o.kind, o.variant, o.status, o.verdict,
                          round(o.t_start - clock0, 2), round(o.elapsed_s, 3), o.chunks]
                         for o in outcomes]}


async def _guarded_probe(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    try:
        return await run_probe(client, url)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def plot_rss(rep: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    rss = rep["rss"]
    fig, ax = plt.subplots(figsize=(8, 4.6))
    if rss["series"]:
        ax.plot(*zip(*rss["series"], strict=True), label="server RSS")
    t0, t1 = rep["traffic_window_s"]
    ax.axvspan(t0, t1, color="tab:blue", alpha=0.08, label="traffic")
    if rss["baseline_mib"] is not None:
        ax.axhline(rss["baseline_mib"], color="gray", ls=":", label="baseline (after 1st probe)")
    if rss.get("peak_hwm_mib") is not None:
        ax.axhline(rss["peak_hwm_mib"], color="tab:orange", ls="-.", lw=0.8,
                   label="peak (the kernel's high-water mark)")
    if rss["budget_mib"] is not None:
        ax.axhline(rss["budget_mib"], color="red", ls="--",
                   label=f"budget: baseline + cache-ram {rss['cache_ram_mib']:g} + "
                         f"{rss['allowance_mib']:g} MiB")
    ax.set_xlabel("seconds since the server was ready")
    ax.set_ylabel("RSS MiB")
    ax.set_title(f"radixserve bench soak: {rep['planned']} items, {rep['concurrency']} workers")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(rep: dict[str, Any]) -> str:
    c, p, r, f = rep["counts"], rep["probe"], rep["rss"], rep["final"]
    lines = [f"soak: {rep['items_run']} of {rep['planned']} items ({c['requests']} requests) "
             f"in {rep['traffic_s']} s, {rep['concurrency']} workers, seed {rep['seed']}"
             + ("" if rep["completed"] else " (stopped at --max-minutes)"),
             (f"answers: {c[EXPECTED]} expected, {c[UNEXPECTED]} unexpected, "
              f"{c[SERVER_ERROR]} 5xx; {c['zero_chunk_abandons']} left before any event")]
    lines += [f"  {k:15} {v['n']:5}  expected {v[EXPECTED]}, unexpected {v[UNEXPECTED]}, "
              f"5xx {v[SERVER_ERROR]}" for k, v in c["per_kind"].items()]
    lines.append(f"slots idle after the traffic: {'yes' if f['idle'] else 'NO'} "
                 f"(waited {f['waited_s']} s; processing {f['requests_processing']}, "
                 f"deferred {f['requests_deferred']})")
    lines.append(f"probe unchanged: {'yes' if p['unchanged'] else 'NO'}; cached == uncached: "
                 f"{'yes' if p['cached_equal'] else 'no'} (deterministic "
                 f"{'on' if p['deterministic'] else 'off'})")
    if r["peak_mib"] is not None:
        lines.append(f"RSS: baseline {r['baseline_mib']:.0f} MiB, peak {r['peak_mib']:.0f} MiB "
                     f"(sampled {r['peak_sampled_mib']:.0f}), budget {r['budget_mib'] or 0:.0f} "
                     f"MiB: {'within' if r['within_budget'] else 'OVER'}")
    if "server_log" in rep:
        n = {k: v["n"] for k, v in rep["server_log"].items()}
        lines.append(f"server log: {n['error']} ERROR, {n['warning']} WARNING lines")
    lines.append("PASS" if not rep["failures"] else "FAIL: " + "; ".join(rep["failures"]))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`radixserve bench soak ...`; 1 if the soak failed."""
    command = list(argv)
    argv, forwarded = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    ap = build_parser()
    a, unknown = ap.parse_known_args(argv)
    if a.requests < 1 or a.concurrency < 1:
        ap.error("--requests and --concurrency must be >= 1")
    if a.url and not a.url.startswith(("http://127.0.0.1:", "http://localhost:")):
        ap.error("--url must be a loopback server (http://127.0.0.1:PORT)")
    a.concurrency = min(a.concurrency, a.requests)
    out = a.out or Path("bench-results") / time.strftime("soak-%Y%m%d-%H%M%S", time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="radixserve-soak-"))
    slot_dir, disk_dir = a.slot_save_path or tmp / "slots", tmp / "disk"
    slot_dir.mkdir(parents=True, exist_ok=True)
    args = ["-m", a.model, "--metrics", "--slot-save-path", str(slot_dir),
            "--cache-ram", str(a.cache_ram), "--max-body-mib", str(a.max_body_mib or 1)]
    if a.disk:
        args += ["--cache-disk", str(disk_dir), "--cache-disk-mib", str(a.cache_disk_mib)]
    args += unknown + forwarded
    a.max_body_mib = a.max_body_mib or (None if a.url else 1)
    rep: dict[str, Any] = {"command": shlex.join(["radixserve", "bench", "soak", *command]),
                           "machine": machine(), "seed": a.seed, "concurrency": a.concurrency,
                           "options": {k: str(v) if isinstance(v, Path) else v
                                       for k, v in vars(a).items()}}
    t0 = time.monotonic()
    try:
        if a.url:
            rep |= {"url": a.url} | asyncio.run(soak(a.url.rstrip("/"), a, None))
            series: list[tuple[float, float]] = []
            hwm = None
        else:
            rep["server_args"] = args
            with ServerProcess(args, out / "server.log") as srv:
                sampler = RssSeries(srv.pid, a.rss_interval_s)
                with sampler:
                    rep |= asyncio.run(soak(srv.url, a, sampler))
                hwm = rss_high_water_mib(srv.pid)
            series = sampler.series
            rep["server_log"] = log_problems(out / "server.log")
        rep["disk_dir"] = dir_usage(disk_dir) if a.disk else None
        rep["slot_dir"] = dir_usage(slot_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rep["duration_s"] = round(time.monotonic() - t0, 1)
    rep["rss"] = rss_figures(series, rep.pop("baseline_mib"), rep.pop("cache_ram_mib"),
                             a.rss_allowance_mib, hwm)
    rep["failures"] = failures(rep)
    (out / "soak.json").write_text(json.dumps(rep, indent=1))
    plot_rss(rep, out / "soak_rss.png")
    print(summary(rep))
    print(f"results in {out}/ (soak.json, soak_rss.png, server.log)")
    return 1 if rep["failures"] else 0
