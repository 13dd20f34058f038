"""The engine's counters: plain numbers, bumped by the engine thread only.

llama-server's `server_metrics`. The engine imports no metrics framework: the HTTP layer takes a
copy (`scrape()`, run on the engine thread, so no lock is needed) and renders it for Prometheus
(http/prometheus.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

RECENT_PROMPTS = 120  # the page's chart of reuse over time (memory/cache_view.py)


@dataclass(slots=True)
class ServerMetrics:
    """llama-server's `server_metrics`: lifetime totals plus a "bucket" reset on every scrape."""

    prompt_tokens_total: int = 0  # prompt tokens computed (cached ones excluded)
    prompt_tokens_cached_total: int = 0  # prompt tokens reused from a slot or the host cache
    prompt_seconds_total: float = 0.0
    prompts_done_total: int = 0
    # (unix time, tokens computed, tokens reused) of the last prompts, oldest first
    recent_prompts: deque[tuple[float, int, int]] = field(
        default_factory=lambda: deque(maxlen=RECENT_PROMPTS))
    tokens_predicted_total: int = 0
    tokens_predicted_seconds_total: float = 0.0
    n_decode_total: int = 0  # forward passes
    n_busy_slots_total: int = 0  # sum over forwards of the slots busy in that forward
    n_tokens_max: int = 0  # largest sequence (prompt + generation) seen in any slot
    requests_processing: int = 0  # gauge, set by the engine
    requests_deferred: int = 0  # gauge, set by the engine
    # context checkpoints (sliding-window models): held now (gauges) and lifetime counts
    checkpoints: int = 0
    checkpoint_bytes: int = 0
    checkpoints_created_total: int = 0
    checkpoints_dropped_total: int = 0  # to stay within --cache-ram
    checkpoints_restored_total: int = 0
    # speculative decoding (llama-server's spec_decode_* counters)
    n_draft_tokens_total: int = 0  # draft tokens proposed
    n_draft_accepted_total: int = 0  # draft tokens the target accepted
    n_drafts_total: int = 0  # verification steps (forwards that checked a draft)
    # per cache tier ("ram", "disk"): bytes, tokens, hits, misses, writes... (set at scrape)
    tiers: dict[str, dict[str, float]] = field(default_factory=dict)
    # bucket since the last scrape: behind prompt_tokens_seconds / predicted_tokens_seconds
    bucket_prompt_tokens: int = 0
    bucket_prompt_seconds: float = 0.0
    bucket_predicted_tokens: int = 0
    bucket_predicted_seconds: float = 0.0

    def on_prompt_done(self, n_prompt: int, n_cached: int, seconds: float) -> None:
        """A slot finished its prompt: `n_prompt` tokens computed, `n_cached` reused."""
        self.prompt_tokens_total += n_prompt
        self.prompt_tokens_cached_total += n_cached
        self.prompt_seconds_total += seconds
        self.prompts_done_total += 1
        self.recent_prompts.append((time.time(), n_prompt, n_cached))
        self.bucket_prompt_tokens += n_prompt
        self.bucket_prompt_seconds += seconds
        self.observe_n_tokens(n_prompt + n_cached)

    def on_prediction_done(self, n_tokens: int, seconds: float) -> None:
        """A slot finished generating (llama-server counts predictions at slot release)."""
        self.tokens_predicted_total += n_tokens
        self.tokens_predicted_seconds_total += seconds
        self.bucket_predicted_tokens += n_tokens
        self.bucket_predicted_seconds += seconds

    def on_decode(self, n_busy_slots: int, n_tokens_max: int = 0) -> None:
        """One forward ran with `n_busy_slots` slots in it; `n_tokens_max`: its longest slot."""
        self.n_decode_total += 1
        self.n_busy_slots_total += n_busy_slots
        self.observe_n_tokens(n_tokens_max)

    def observe_n_tokens(self, n_tokens: int) -> None:
        self.n_tokens_max = max(self.n_tokens_max, n_tokens)

    def scrape(self) -> ServerMetrics:
        """A copy to render, and reset the throughput bucket (llama-server resets per scrape).

        Call it on the engine thread (`await engine.call(engine.metrics.scrape)`).
        """
        snap = dataclasses.replace(self, recent_prompts=deque(self.recent_prompts))
        self.bucket_prompt_tokens = self.bucket_predicted_tokens = 0
        self.bucket_prompt_seconds = self.bucket_predicted_seconds = 0.0
        return snap
