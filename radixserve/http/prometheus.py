"""Prometheus text for `GET /metrics`, from the engine's plain counters (engine/counters.py).

Names, help strings and types follow llama-server's `/metrics` (llamacpp: prefix) so existing
dashboards and llama.cpp's own tests work unchanged; host-cache figures are added as
`radixserve:<name>` gauges, the same names whichever cache backend is on (cache.base.STAT_NAMES).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixserve.engine.counters import ServerMetrics

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _rate(n: float, seconds: float) -> float:
    return n / seconds if seconds > 0 else 0.0


_N_DECODE_HELP = (
    "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding"
)
# (name without prefix, type, help, value getter), in llama-server's order and wording.
# llama-server types n_tokens_max as a counter; prometheus_client would then rename it to
# n_tokens_max_total, so it is a gauge here (a maximum is a gauge anyway).
_FAMILIES = (
    (
        "prompt_tokens_total",
        "counter",
        "Number of prompt tokens processed, excluding cached tokens",
        lambda m: m.prompt_tokens_total,
    ),
    (
        "prompt_tokens_cached_total",
        "counter",
        "Number of prompt tokens reused from the cache",
        lambda m: m.prompt_tokens_cached_total,
    ),
    (
        "prompt_seconds_total",
        "counter",
        "Total time spent processing prompts",
        lambda m: m.prompt_seconds_total,
    ),
    (
        "tokens_predicted_total",
        "counter",
        "Number of generation tokens processed",
        lambda m: m.tokens_predicted_total,
    ),
    (
        "tokens_predicted_seconds_total",
        "counter",
        "Total time spent generating tokens",
        lambda m: m.tokens_predicted_seconds_total,
    ),
    ("n_decode_total", "counter", _N_DECODE_HELP, lambda m: m.n_decode_total),
    (
        "n_tokens_max",
        "gauge",
        "Largest observed sequence length (prompt + generation)",
        lambda m: m.n_tokens_max,
    ),
    (
        "spec_decode_num_draft_tokens_total",
        "counter",
        "Speculative: Total draft tokens generated",
        lambda m: m.n_draft_tokens_total,
    ),
    (
        "spec_decode_num_accepted_tokens_total",
        "counter",
        "Speculative: Total draft tokens accepted by the target model",
        lambda m: m.n_draft_accepted_total,
    ),
    (
        "spec_decode_num_drafts_total",
        "counter",
        "Speculative: Total speculative decoding verification steps",
        lambda m: m.n_drafts_total,
    ),
    (
        "prompt_tokens_seconds",
        "gauge",
        "Average prompt throughput in tokens/s",
        lambda m: _rate(m.bucket_prompt_tokens, m.bucket_prompt_seconds),
    ),
    (
        "predicted_tokens_seconds",
        "gauge",
        "Average generation throughput in tokens/s",
        lambda m: _rate(m.bucket_predicted_tokens, m.bucket_predicted_seconds),
    ),
    (
        "requests_processing",
        "gauge",
        "Number of requests processing",
        lambda m: m.requests_processing,
    ),
    ("requests_deferred", "gauge", "Number of requests deferred", lambda m: m.requests_deferred),
    (
        "n_busy_slots_per_decode",
        "gauge",
        "Average number of busy slots per llama_decode() call",
        lambda m: m.n_busy_slots_total / max(m.n_decode_total, 1),
    ),
)

# radixserve's own engine figures (not llama-server's), as radixserve:<name>
_OWN_FAMILIES = (
    ("checkpoints", "gauge", "Context checkpoints held by the slots (sliding-window models)",
     lambda m: m.checkpoints),
    ("checkpoint_bytes", "gauge", "Bytes of the context checkpoints held by the slots",
     lambda m: m.checkpoint_bytes),
    ("checkpoints_created_total", "counter", "Context checkpoints created",
     lambda m: m.checkpoints_created_total),
    ("checkpoints_dropped_total", "counter",
     "Context checkpoints the slots dropped to stay within --cache-ram",
     lambda m: m.checkpoints_dropped_total),
    ("checkpoints_restored_total", "counter",
     "Context checkpoints restored into a slot for a new prompt",
     lambda m: m.checkpoints_restored_total),
)

# per cache tier (label tier="ram"|"disk"), as radixserve:cache_tier_<name>
_TIER_FAMILIES = (
    ("bytes", "gauge", "Bytes the tier holds (disk: the directory, every process's files)"),
    ("tokens", "gauge", "Tokens of KV the tier holds (disk: whole blocks)"),
    ("hits", "counter", "Lookups the tier served (disk: reads that found a block)"),
    ("misses", "counter", "Lookups the tier could not serve"),
    ("hit_tokens", "counter", "Prompt tokens the tier supplied"),
    ("writes", "counter", "Saves into the tier (disk: block files written)"),
    ("evictions", "counter", "Entries, leaves or files evicted by the tier's bound"),
    ("bad_files", "counter", "Disk block files that failed their checks (removed)"),
    ("write_errors", "counter", "Disk block writes that failed (a full disk...), and writes "
                                "dropped while a full disk pauses writing"),
    ("dropped", "counter", "Disk block writes not queued: the writer was too far behind"),
)

_BAD_NAME_CHARS = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(key: str) -> str:
    """`radixserve:<key>` with characters Prometheus does not allow replaced by `_`."""
    return "radixserve:" + _BAD_NAME_CHARS.sub("_", key)


class _Snapshot(Collector):
    def __init__(self, m: ServerMetrics, cache_stats: dict[str, float]) -> None:
        self.m, self.cache_stats = m, cache_stats

    def collect(self) -> Iterator[Metric]:
        for name, kind, doc, get in _FAMILIES:
            # CounterMetricFamily strips `_total` and the exposition adds it back.
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family("llamacpp:" + name, doc, value=float(get(self.m)))
        for name, kind, doc, get in _OWN_FAMILIES:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family("radixserve:" + name, doc, value=float(get(self.m)))
        for key, value in sorted(self.cache_stats.items()):
            yield GaugeMetricFamily(metric_name(key), f"Host prompt cache: {key}", value=value)
        tiers = self.m.tiers
        for name, kind, doc in _TIER_FAMILIES if tiers else ():
            make = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            fam = make(f"radixserve:cache_tier_{name}", doc, labels=["tier"])
            for tier, figures in tiers.items():
                if name in figures:
                    fam.add_metric([tier], float(figures[name]))
            yield fam


def render_metrics(m: ServerMetrics, cache_stats: dict[str, float]) -> bytes:
    """Prometheus text exposition of `m` (a `scrape()` copy) and the host-cache figures."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(m, cache_stats))
    return generate_latest(registry)
