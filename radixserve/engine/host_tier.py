"""When slots and the host prompt cache exchange KV (the scheduler's side of the host tier).

- Before a slot takes a new prompt that would keep less than half of its tokens (or that it got
  by LRU), its content is saved; then the best cached prefix of the prompt is restored. The
  legacy backend only loads at that moment (llama.cpp); the radix backend, whose hits are not
  consumed, is asked for every prompt.
- `--cache-idle-slots`: when a task starts, every idle slot is published to the cache and, with
  unified KV, cleared: only then do its cells become usable by the active slots. llama.cpp does
  this after the new task took its slot; with the radix backend we do it just before (the new
  task's own slot excepted), so the new prompt can already restore what the idle slots held.
"""

from __future__ import annotations

import logging
import time

from radixserve.cache.base import NullPromptCache, PromptCache
from radixserve.cache.legacy import LegacyPromptCache
from radixserve.cache.radix import RadixPromptCache
from radixserve.config import ServerConfig
from radixserve.kv.pool import KVPool
from radixserve.kv.state import fingerprint_of
from radixserve.engine.slot import Slot

log = logging.getLogger(__name__)
STATS_LOG_INTERVAL_S = 30.0


def make_cache(cfg: ServerConfig, pool: KVPool, arch: str) -> PromptCache:
    if cfg.cache_ram_mib == 0:
        return NullPromptCache()
    limit = cfg.cache_ram_mib * 1024 * 1024 if cfg.cache_ram_mib > 0 else 0
    if cfg.cache_radix_prompt:
        return RadixPromptCache(limit, cfg.cache_radix_min_restore_tokens)
    return LegacyPromptCache(limit, pool.n_cells, fingerprint_of(pool, arch))


class HostTier:
    def __init__(self, cfg: ServerConfig, pool: KVPool, arch: str) -> None:
        self.pool = pool
        self.cache = make_cache(cfg, pool, arch)
        self.cache_idle_slots = cfg.cache_idle_slots
        if cfg.cache_idle_slots and cfg.cache_ram_mib == 0:
            log.warning("--cache-idle-slots requires --cache-ram, disabling")
            self.cache_idle_slots = False
        self._t_log = time.monotonic()

    def exchange(self, slot: Slot, prompt: list[int], update_cache: bool) -> None:
        """Stash the slot's KV if it is about to be lost; restore the best cached prefix."""
        cache = self.cache
        t0 = time.perf_counter()
        if update_cache and cache.save(self.pool, slot.id, slot.tokens):
            log.debug("slot %d: saved %d tokens to the host cache", slot.id, len(slot.tokens))
        if update_cache or cache.load_always:
            loaded = cache.load(self.pool, slot.id, slot.tokens, prompt)
            if loaded is not None:
                slot.tokens = list(loaded)
                log.info("slot %d: restored %d tokens from the %s cache", slot.id, len(loaded),
                         cache.name)
        if update_cache:
            cache.update()
            log.debug("prompt cache update took %.2f ms", (time.perf_counter() - t0) * 1e3)

    def publish_idle(self, slots: list[Slot], exclude: Slot | None = None) -> None:
        if not self.cache_idle_slots:
            return
        saved = False
        for s in slots:
            if s.is_processing or not s.tokens or s is exclude:
                continue
            saved |= self.cache.save(self.pool, s.id, s.tokens)
            if self.pool.unified:
                self.pool.seq_rm(s.id)
                s.tokens = []
        if saved:
            self.cache.update()
        now = time.monotonic()
        log_stats = getattr(self.cache, "log_stats", None)
        if log_stats is not None and now - self._t_log > STATS_LOG_INTERVAL_S:
            self._t_log = now
            log_stats()
