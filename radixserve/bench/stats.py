"""The numbers of a benchmark run: percentiles, per-run figures, medians over repeats.

Everything here is pure (records and scraped metrics in, plain dicts out) so it is unit-tested
without a server. Hit rate is token-weighted, from the server's own per-request `timings`:
reused = sum(cache_n), computed = sum(prompt_n), hit rate = reused / (reused + computed).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.memory.tiers.prefix import common_prefix

MIB = 1024 * 1024


@dataclass(slots=True)
class RequestRecord:
    """One measured request as the client saw it (times in seconds from the phase start)."""

    session: str
    group: str
    turn: int
    t_start: float
    latency_s: float
    ttft_s: float | None = None
    prompt_n: int | None = None  # prompt tokens computed by the server
    cache_n: int | None = None  # prompt tokens reused (slot or host cache)
    predicted_n: int | None = None
    prompt_ms: float | None = None
    predicted_ms: float | None = None
    error: str | None = None
    reply: str | None = None  # the generated text: runs of different modes must agree on it
    # the generated token ids, where the server sent them (`logprobs` entries' `id`, llama.cpp's
    # extension): a reply's text may re-tokenize to other ids (random weights' broken UTF-8,
    # pieces the tokenizer would merge), and the unshared minimum needs what was computed
    reply_ids: list[int] | None = None
    # speculative decoding (timings.draft_n / draft_n_accepted): draft tokens proposed and
    # accepted; None when the server sent no such fields (no speculation, or no draft made)
    draft_n: int | None = None
    draft_n_accepted: int | None = None
    predicted_per_second: float | None = None  # the server's own decode rate (timings)
    # 0: sent to the first server; 1: sent after the scenario's server restart (to the new one)
    phase: int = 0

    @property
    def prefill_tok_s(self) -> float | None:
        """The server's own prompt rate (timings): prompt tokens computed per second."""
        if not self.prompt_n or not self.prompt_ms:
            return None
        return self.prompt_n / self.prompt_ms * 1e3

    @property
    def decode_tok_s(self) -> float | None:
        """The server's own generation rate: timings.predicted_per_second when sent, else
        predicted_n / predicted_ms (llama-server's formula)."""
        if self.predicted_per_second:
            return self.predicted_per_second
        if not self.predicted_n or not self.predicted_ms:
            return None
        return self.predicted_n / self.predicted_ms * 1e3

    @property
    def decode_steps(self) -> int | None:
        """Forward passes of the target model while generating: the first token comes with the
        prompt, then each step yields 1 token plus the draft tokens it accepted."""
        if not self.predicted_n:
            return None
        return max(0, self.predicted_n - 1 - (self.draft_n_accepted or 0))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default "linear" method); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def hit_rate(reused: int, computed: int) -> float:
    total = reused + computed
    return reused / total if total else 0.0


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def series_key(name: str, labels: dict[str, str] | None = None) -> str:
    """The key of one series in `parse_prometheus`'s dict: the bare name without labels, else
    `name{k="v",...}` with the labels sorted, so a lookup does not depend on the order in
    which a server writes them."""
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def parse_prometheus(text: str) -> dict[str, float]:
    """`name value` lines of a Prometheus exposition, comments skipped. A labelled series is
    stored under `series_key(name, labels)` (families such as
    `radixserve:cache_tier_bytes{tier="disk"}` have one series per label value) and, as
    before labels were read, under its bare name too (the family's last series)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        m = _METRIC_NAME.match(line)
        if not line or line.startswith("#") or m is None:
            continue
        name, rest = m.group(), line[m.end():]
        labels: dict[str, str] = {}
        if rest.startswith("{"):
            close = rest.rfind("}")
            if close < 0:
                continue
            labels = dict(_LABEL.findall(rest[1:close]))
            rest = rest[close + 1:]
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        out[name] = value
        if labels:
            out[series_key(name, labels)] = value
    return out


def prefix_bound(prompts: Sequence[Sequence[int]]) -> int:
    """Issue #5's bound on prompt tokens computed: for each prompt (in the order sent), the
    tokens past its longest common prefix with any earlier prompt, plus one per prompt (a
    prompt that is all cached still computes its last token, for the logits)."""
    total = 0
    for i, p in enumerate(prompts):
        shared = max((common_prefix(p, q) for q in prompts[:i]), default=0)
        total += len(p) - shared + 1
    return total


def unshared_minimum(sent: Sequence[tuple[Sequence[int], Sequence[int]]]) -> int:
    """Prompt tokens a server that never drops computed KV would compute: for each
    (prompt, answer) in the order sent, the prompt's tokens past its longest common prefix with
    any earlier prompt followed by that request's decoded answer (every answer token but the
    last was fed back, so its KV exists), and always the prompt's last token (its logits).
    An answer re-tokenized differently in the next prompt counts as new, as on any server."""
    total = 0
    known: list[Sequence[int]] = []
    for prompt, answer in sent:
        shared = max((common_prefix(prompt, q) for q in known), default=0)
        total += len(prompt) - min(shared, len(prompt) - 1)
        known.append(list(prompt) + list(answer[:-1]))
    return total


def host_cache_figures(before: dict[str, float],
                       after: dict[str, float]) -> dict[str, float | None]:
    """Host-cache figures from two /metrics scrapes (the same names for every backend: the
    engine's cache.base.STAT_NAMES). Counters are deltas over the phase; sizes are end values;
    None where the server does not report them (not radixserve)."""

    def end(name: str) -> float | None:
        return after.get(f"radixserve:{name}")

    def delta(name: str) -> float | None:
        a = end(name)
        return None if a is None else a - before.get(f"radixserve:{name}", 0.0)

    host_bytes = end("bytes")
    return {
        "host_cache_mib": None if host_bytes is None else host_bytes / MIB,
        "unique_tokens": end("unique_tokens"),
        "logical_tokens": end("logical_tokens"),
        "host_saves": delta("saves"),
        "host_loads": delta("loads"),
        "host_hit_tokens": delta("hit_tokens"),
        "host_evictions": delta("evictions"),
        "host_fallbacks": delta("fallbacks"),
    }


# the cache hierarchy's tiers in /metrics (`radixserve:cache_tier_*{tier=...}`)
TIERS = ("ram", "disk")
# per-tier counters (`radixserve:cache_tier_<name>_total`)
TIER_COUNTERS = ("hits", "misses", "hit_tokens", "writes", "evictions", "bad_files",
                 "write_errors", "dropped")
# of those, the disk tier's alone: files that failed their checks, writes that failed or were
# not queued (a writer too far behind: prefixes a restarted server will not find)
DISK_ONLY = ("bad_files", "write_errors", "dropped")


def tier_figures(before: dict[str, float],
                 after: dict[str, float]) -> dict[str, float | None]:
    """Per tier of the cache hierarchy (`<tier>_...`, e.g. `disk_bytes`): bytes and tokens
    held at the end, bytes per token (what a stored token costs on that tier, so a disk
    format can be compared with the RAM one), and the counters as deltas over the phase.
    None where the server exports no such series (no disk tier, older servers, other
    servers): the report shows '-' rather than a 0 that would claim an empty tier."""

    def get(d: dict[str, float], tier: str, family: str) -> float | None:
        return d.get(series_key(f"radixserve:cache_tier_{family}", {"tier": tier}))

    out: dict[str, float | None] = {}
    for tier in TIERS:
        size, tokens = get(after, tier, "bytes"), get(after, tier, "tokens")
        out[f"{tier}_bytes"], out[f"{tier}_tokens"] = size, tokens
        out[f"{tier}_bytes_per_token"] = size / tokens if size is not None and tokens else None
        for c in TIER_COUNTERS:
            if c in DISK_ONLY and tier != "disk":
                continue
            end = get(after, tier, f"{c}_total")
            out[f"{tier}_{c}"] = None if end is None else end - (
                get(before, tier, f"{c}_total") or 0.0)
    return out


def _ms(xs: list[float], q: float) -> float:
    return percentile(xs, q) * 1e3


def summarize_run(records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    """Client-side figures of one measurement phase (errors are counted, not timed)."""
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.latency_s for r in ok]
    reused = sum(r.cache_n or 0 for r in ok)
    computed = sum(r.prompt_n or 0 for r in ok)
    generated = sum(r.predicted_n or 0 for r in ok)
    out: dict[str, Any] = {
        "n_requests": len(records),
        "n_errors": len(records) - len(ok),
        "wall_s": wall_s,
        "ttft_p50_ms": _ms(ttft, 50),
        "ttft_p95_ms": _ms(ttft, 95),
        "e2e_p50_ms": _ms(e2e, 50),
        "e2e_p95_ms": _ms(e2e, 95),
        "req_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "gen_tok_per_s": generated / wall_s if wall_s > 0 else 0.0,
        # per-request engine rates from the server's timings (single-stream: the engine itself)
        "prefill_tok_s_p50": median_of(r.prefill_tok_s for r in ok),
        "decode_tok_s_p50": median_of(r.decode_tok_s for r in ok),
        "prompt_tokens_computed": computed,
        "prompt_tokens_reused": reused,
        "hit_rate": hit_rate(reused, computed),
        **draft_figures(ok),
    }
    after = restart_figures(records)
    if after is not None:  # the scenario restarted the server: what the new one had to do
        out["after_restart"] = after
    by_turn = turn_figures(ok)
    if len(by_turn) > 1:  # multi-turn sessions: how each turn fares as the history grows
        out["by_turn"] = by_turn
    groups = sorted({r.group for r in ok})
    if len(groups) > 1:
        out["hit_rate_by_group"] = {
            g: hit_rate(sum(r.cache_n or 0 for r in ok if r.group == g),
                        sum(r.prompt_n or 0 for r in ok if r.group == g))
            for g in groups
        }
    return out


def restart_figures(records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """The requests sent after the server restart (`phase` 1): TTFT p50 and prompt tokens
    computed / reused (sums of `prompt_n` / `cache_n`), and the first of them (the earliest
    sent) on its own: its server-side `prompt_ms` with its `prompt_n` / `cache_n` is the
    time to restore a long prefix from disk, or to compute it again where nothing survived.
    The first request's figures are None when it failed. None without a restart."""
    after = sorted((r for r in records if r.phase == 1), key=lambda r: r.t_start)
    if not after:
        return None
    ok = [r for r in after if r.error is None]
    reused = sum(r.cache_n or 0 for r in ok)
    computed = sum(r.prompt_n or 0 for r in ok)
    first = after[0] if after[0].error is None else None
    return {
        "n_requests": len(after),
        "n_errors": len(after) - len(ok),
        "ttft_p50_ms": _ms([r.ttft_s for r in ok if r.ttft_s is not None], 50),
        "prompt_tokens_computed": computed,
        "prompt_tokens_reused": reused,
        "hit_rate": hit_rate(reused, computed),
        "first_prompt_ms": None if first is None else first.prompt_ms,
        "first_prompt_n": None if first is None else first.prompt_n,
        "first_cache_n": None if first is None else first.cache_n,
        "first_ttft_ms": None if first is None or first.ttft_s is None else 1e3 * first.ttft_s,
    }


def draft_figures(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Speculative decoding over a run's requests: draft tokens proposed and accepted (sums of
    timings.draft_n / draft_n_accepted), acceptance = accepted / proposed, and accepted draft
    tokens per decode step of the target (`RequestRecord.decode_steps`; steps that had no draft
    count too, as the timings do not tell them apart). All None when no request reported draft
    fields (no speculation); a request without them in a run where others have them drafted
    nothing (llama-server leaves the fields out when draft_n is 0)."""
    drafted = [r for r in records if r.draft_n is not None]
    if not drafted:
        return {"draft_n": None, "draft_n_accepted": None, "draft_acceptance": None,
                "draft_accepted_per_step": None}
    proposed = sum(r.draft_n or 0 for r in drafted)
    accepted = sum(r.draft_n_accepted or 0 for r in drafted)
    steps = sum(r.decode_steps or 0 for r in records)
    return {"draft_n": proposed, "draft_n_accepted": accepted,
            "draft_acceptance": accepted / proposed if proposed else None,
            "draft_accepted_per_step": accepted / steps if steps else None}


def turn_figures(records: Iterable[RequestRecord]) -> dict[int, dict[str, Any]]:
    """Per turn (1-based) of multi-turn sessions: requests, and medians over the turn's
    requests of prompt tokens computed (`prompt_n`), reused (`cache_n`) and TTFT."""
    turns: dict[int, list[RequestRecord]] = {}
    for r in records:
        turns.setdefault(r.turn + 1, []).append(r)
    return {t: {"n": len(rs),
                "prompt_n_p50": median_of(r.prompt_n for r in rs),
                "cache_n_p50": median_of(r.cache_n for r in rs),
                "ttft_p50_ms": median_of(None if r.ttft_s is None else 1e3 * r.ttft_s
                                         for r in rs)}
            for t, rs in sorted(turns.items())}


def sum_counter_figures(parts: Sequence[dict[str, Any]],
                        counters: Iterable[str]) -> dict[str, Any]:
    """Figures of a run measured on several servers in turn (a restart): the last server's
    figures, with each of `counters` (deltas over one server's phase) summed over the servers,
    because counters restart at 0 with each process while sizes are what the last one holds.
    A counter is None if any server lacks it."""
    out = dict(parts[-1])
    for k in counters:
        vals = [p.get(k) for p in parts]
        out[k] = None if any(v is None for v in vals) else sum(vals)
    return out


def median_of(values: Iterable[Any]) -> Any:
    """Median of the numbers present (None and NaN skipped); None when there are none."""
    xs = [v for v in values if isinstance(v, (int, float)) and not math.isnan(v)]
    return statistics.median(xs) if xs else None


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-key medians over repeated runs of one (scenario, mode); nested dicts per key."""
    keys = dict.fromkeys(k for r in runs for k in r)
    out: dict[str, Any] = {"repeats": len(runs)}
    for k in keys:
        vals = [r.get(k) for r in runs]
        if any(isinstance(v, dict) for v in vals):
            out[k] = aggregate([v for v in vals if isinstance(v, dict)])
            out[k].pop("repeats", None)
        else:
            out[k] = median_of(vals)
    return out
