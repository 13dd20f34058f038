"""The soak's judgement (`radixserve bench soak`, see soak.py): the plan of request kinds, the
verdict on each answer, and the reasons a soak fails. Pure functions, no I/O: unit-tested.

Every plan item carries its own seed, so what an item sends does not depend on which worker
ran it or when: an item named in a report can be replayed by its index. 5xx are counted apart
from the other unexpected answers, because a 5xx is the server admitting a bug, while a wrong
4xx or a dropped connection may also be a contract slip.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

# kind -> share of the plan. Abandoned streams, client time-outs and malformed bodies are
# frequent on purpose: they are what leaves state behind when a server gets them wrong
KINDS: dict[str, float] = {
    "completion": 0.17, "chat": 0.13, "stream": 0.14, "abandon_stream": 0.12,
    "abandon_early": 0.06, "client_timeout": 0.06, "malformed": 0.12, "oversized": 0.04,
    "slot": 0.06, "flush": 0.03, "pressure": 0.07,
}
EXPECTED, UNEXPECTED, SERVER_ERROR = "expected", "unexpected", "5xx"
# kinds the server must refuse: the statuses allowed (always in OpenAI's error shape)
REFUSED: dict[str, range | tuple[int, ...]] = {"malformed": range(400, 500),
                                               "oversized": (413,)}


@dataclass(slots=True, frozen=True)
class Item:
    """One entry of the plan; `seed` drives every random choice of what it sends."""

    index: int
    kind: str
    seed: int


@dataclass(slots=True)
class Outcome:
    """One HTTP exchange and its verdict."""

    index: int
    kind: str
    variant: str
    status: int | None = None  # HTTP status, or an in-stream error event's code; None: no answer
    verdict: str = ""
    t_start: float = 0.0  # time.monotonic() when it was sent
    elapsed_s: float = 0.0
    chunks: int | None = None  # SSE data events read (streams)
    client_left: bool = False  # the client ended the exchange on purpose (abandon, time-out)
    error: str | None = None  # an exception, an in-stream error, a 2xx body that is not JSON
    request: str = ""  # excerpt of what was sent
    response: str = ""  # excerpt of the answer


def error_shape_ok(text: str) -> bool:
    """OpenAI's error body: {"error": {"code": int, "message": str, "type": str}}."""
    try:
        err = json.loads(text)["error"]
        return (isinstance(err["code"], int) and isinstance(err["message"], str)
                and isinstance(err["type"], str))
    except (ValueError, KeyError, TypeError):
        return False


def classify(o: Outcome) -> str:
    """EXPECTED, UNEXPECTED or SERVER_ERROR (any 5xx, in-stream errors included). No answer is
    expected only when the client itself left; a refusal must have the right status and
    OpenAI's error shape; a busy slot's 409 is a slot action's normal answer."""
    if o.status is not None and o.status >= 500:
        return SERVER_ERROR
    if o.status is None:
        return EXPECTED if o.client_left else UNEXPECTED
    if o.error is not None:
        return UNEXPECTED
    allowed = REFUSED.get(o.kind)
    if allowed is not None:
        return EXPECTED if o.status in allowed and error_shape_ok(o.response) else UNEXPECTED
    if 200 <= o.status < 300:
        return EXPECTED
    busy = o.kind == "slot" and o.status == 409 and error_shape_ok(o.response)
    return EXPECTED if busy else UNEXPECTED


def make_plan(n: int, seed: int) -> list[Item]:
    """`n` items: one of each kind first (when n allows, so a short run still covers every
    kind), the rest drawn by KINDS' shares; shuffled, each with its own seed."""
    rng = random.Random(seed)
    kinds = list(KINDS)[:n]
    kinds += rng.choices(list(KINDS), weights=list(KINDS.values()), k=n - len(kinds))
    rng.shuffle(kinds)
    return [Item(i, k, rng.getrandbits(32)) for i, k in enumerate(kinds)]


def rss_budget(baseline_mib: float | None, cache_ram_mib: float | None,
               allowance_mib: float) -> float | None:
    """Baseline + host cache bound + allowance; None when either is unknown or the cache is
    unbounded (`--cache-ram -1`): then there is nothing to check against."""
    if baseline_mib is None or cache_ram_mib is None or cache_ram_mib < 0:
        return None
    return baseline_mib + cache_ram_mib + allowance_mib


def rss_figures(series: list[tuple[float, float]], baseline_mib: float | None,
                cache_ram_mib: float | None, allowance_mib: float,
                hwm_mib: float | None = None) -> dict[str, Any]:
    """The report's `rss`: the series (seconds, MiB), the peak (the larger of the samples' and
    the kernel's high-water mark `hwm_mib`, which sees the spikes between samples), the budget
    and the verdict (None: nothing to check, e.g. `--url`, whose process the soak cannot see)."""
    sampled = max((v for _, v in series), default=None)
    peak = max((v for v in (sampled, hwm_mib) if v is not None), default=None)
    budget = rss_budget(baseline_mib, cache_ram_mib, allowance_mib)
    return {"baseline_mib": baseline_mib, "cache_ram_mib": cache_ram_mib,
            "allowance_mib": allowance_mib, "budget_mib": budget, "peak_mib": peak,
            "peak_sampled_mib": sampled, "peak_hwm_mib": hwm_mib,
            "within_budget": None if budget is None or peak is None else peak <= budget,
            "series": series}


def probe_verdict(start: dict[str, Any], end: dict[str, Any],
                  deterministic: bool) -> dict[str, Any]:
    """unchanged: the uncached tokens at the end are those at the start; cached_equal: every
    cached probe gave the uncached tokens (required in deterministic mode only)."""
    ok_runs = "error" not in start and "error" not in end and bool(start.get("uncached"))
    unchanged = ok_runs and start["uncached"] == end["uncached"]
    cached_equal = ok_runs and all(c == p["uncached"] for p in (start, end) for c in p["cached"])
    return {"unchanged": unchanged, "cached_equal": cached_equal,
            "deterministic": deterministic,
            "ok": unchanged and (cached_equal or not deterministic), "start": start, "end": end}


def counts(outcomes: list[Outcome]) -> dict[str, Any]:
    """Totals and per kind: verdicts, variants, statuses ('none': no answer)."""
    total = {EXPECTED: 0, UNEXPECTED: 0, SERVER_ERROR: 0}
    kinds: dict[str, dict[str, Any]] = {}
    for o in outcomes:
        total[o.verdict] += 1
        k = kinds.setdefault(o.kind, {"n": 0, EXPECTED: 0, UNEXPECTED: 0, SERVER_ERROR: 0,
                                      "client_left": 0, "variants": {}, "statuses": {}})
        k["n"] += 1
        k[o.verdict] += 1
        k["client_left"] += o.client_left
        k["variants"][o.variant] = k["variants"].get(o.variant, 0) + 1
        status = "none" if o.status is None else str(o.status)
        k["statuses"][status] = k["statuses"].get(status, 0) + 1
    zero = sum(o.client_left and o.chunks == 0 for o in outcomes)
    return {"requests": len(outcomes), **total, "zero_chunk_abandons": zero,
            "per_kind": dict(sorted(kinds.items()))}


def failures(rep: dict[str, Any]) -> list[str]:
    """Why the soak fails (empty: it passed)."""
    c, out = rep["counts"], []
    if c[UNEXPECTED]:
        out.append(f"{c[UNEXPECTED]} unexpected answer(s)")
    if c[SERVER_ERROR]:
        out.append(f"{c[SERVER_ERROR]} 5xx answer(s)")
    if not rep["final"]["idle"]:
        f = rep["final"]
        out.append(f"not idle {f['waited_s']} s after the traffic: busy slots {f['busy_slots']}, "
                   f"processing {f['requests_processing']}, deferred {f['requests_deferred']}")
    p = rep["probe"]
    errors = [p[k]["error"] for k in ("start", "end") if "error" in p.get(k, {})]
    if errors:
        out.append(f"probe failed: {errors[0]}")
    elif not p["ok"]:
        out.append("probe changed" if not p["unchanged"] else
                   "cached probe differs from the uncached one in deterministic mode")
    if rep["rss"]["within_budget"] is False:
        out.append(f"peak RSS {rep['rss']['peak_mib']:.0f} MiB over the budget "
                   f"{rep['rss']['budget_mib']:.0f} MiB")
    return out
