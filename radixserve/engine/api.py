"""The engine's public API: all the HTTP layer may know of it.

Handlers build a `CompletionTask` and iterate the returned `ResultStream`; everything else is
an awaitable query or action that runs on the engine thread. Nothing here exposes the
scheduler, the pool or the slots themselves (`Engine` implements this; tests use doubles).
"""

from __future__ import annotations

from typing import Any, Protocol

from radixserve.config import ServerConfig
from radixserve.engine.counters import ServerMetrics
from radixserve.engine.task import CompletionTask, FinalResult, PartialResult
from radixserve.model.loader import Model


class ResultStream(Protocol):
    """PartialResult..., then one FinalResult; a failure is raised as TaskError."""

    def __aiter__(self) -> ResultStream: ...

    async def __anext__(self) -> PartialResult | FinalResult: ...

    def cancel(self) -> None:
        """The client went away: the engine stops the task and frees its slot."""
        ...


class EngineAPI(Protocol):
    cfg: ServerConfig
    model: Model  # tokenizer, chat template and file facts (read-only, any thread)
    # bumped on the event loop when a task is submitted or ends: a snapshot taken at another
    # count is stale (GET /cache shares one between polls only while this is unchanged)
    changes: int

    @property
    def n_ctx_slot(self) -> int: ...

    @property
    def n_slots(self) -> int: ...

    def submit(self, task: CompletionTask) -> ResultStream: ...

    async def slots_json(self) -> list[dict[str, Any]]:
        """GET /slots."""
        ...

    async def has_idle_slot(self) -> bool: ...

    async def cache_stats(self) -> dict[str, float]:
        """Host cache figures (cache.base.STAT_NAMES)."""
        ...

    async def scrape(self) -> tuple[ServerMetrics, dict[str, float]]:
        """A copy of the counters (resetting their per-scrape bucket) and the cache figures."""
        ...

    async def cache_view(self) -> dict[str, Any]:
        """GET /cache (memory/cache_view.py): slots, tree, tiers, reuse over time; every
        `text` is token ids (or None: not shown)."""
        ...

    async def flush_cache(self) -> dict[str, int]:
        """Empty every cache tier (slots, host RAM, disk); what was dropped."""
        ...

    async def slot_action(self, id_slot: int, action: str, filename: str | None) -> dict[str, Any]:
        """POST /slots/{id}?action=save|restore|erase; raises TaskError."""
        ...

    def stop(self) -> None: ...


class SleepingEngineAPI(EngineAPI, Protocol):
    """An engine that can sleep (--sleep-idle-seconds; `Engine` is one, test doubles need not
    be): http/sleep.py uses these where the engine has them."""

    @property
    def sleeping(self) -> bool: ...

    @property
    def can_sleep(self) -> bool:
        """Whether it knows how to load its model again."""
        ...

    async def sleep(self) -> bool:
        """Release the model's weights and the device KV, keeping the host cache tiers;
        False (nothing released) while a task runs or waits."""
        ...

    async def wake(self) -> None:
        """Load the model again (raises what loading raised; the engine stays asleep)."""
        ...
