"""When slots and the host prompt cache exchange KV (the engine's side of the host tier).

- Nothing reusable is dropped unseen (radix backend): before a slot takes a new prompt that will
  not keep all it holds (another session's request, an n > 1 child, a slot file restored into
  it), before a context shift discards part of it, and before an idle slot's cells go to another
  slot, its KV (prompt and generated tokens) is offered to the tree, which stores only the rows
  it lacks, within `--cache-ram` and LRU. A session whose slot was taken by a request sharing
  only the long system prompt so finds its history in the tree. The legacy backend keeps
  llama.cpp's rule: save only when the new prompt keeps less than half of the slot's tokens (or
  the slot was picked by LRU), since each entry is a whole prompt. Admin flushes, slot erase and
  failed or shifted KV are dropped unsaved. Whether the prompt's prefix is then restored from
  the cache is the prefix planner's decision (prefix_plan.py); the legacy backend is consulted
  only when the slot is overwritten (llama.cpp), the radix backend, whose hits are not
  consumed, for every prompt.
- `--cache-idle-slots`: when a task starts, every idle slot is published to the cache and, with
  unified KV, cleared: only then do its cells become usable by the active slots. llama.cpp does
  this after the new task took its slot; with the radix backend we do it just before (the new
  task's own slot excepted), so the new prompt can already restore what the idle slots held.
- The slots' own context checkpoints count under `--cache-ram` with the cache (a model with
  no byte limit keeps llama-server's count, `--ctx-checkpoints`, alone): a buffer the cache
  holds too (a saved slot's checkpoints are the tree's snapshots, the same bytes) is counted
  once, by the cache. The slots' own hold at most half the budget (the oldest go first, from
  every slot: the other half is for what sessions left in the cache), the cache evicts to what
  they leave, and a snapshot it drops goes from the slots too (`update`, `save`,
  `take_disk_loads`).
"""

from __future__ import annotations

import hashlib
import logging
import time

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from radixserve.config import ServerConfig
from radixserve.memory.checkpoint import Checkpoint
from radixserve.memory.holders import Holder, ModelIdentity
from radixserve.memory.key import PromptKey
from radixserve.memory.pool.pool import KVPool
from radixserve.memory.pool.state import fingerprint_of, swa_fingerprint
from radixserve.memory.seq_kv import SlotKV
from radixserve.memory.prefix_plan import salted_lcp
from radixserve.memory.tiers.base import NullPromptCache, PromptCache
from radixserve.memory.tiers.disk import DiskTier
from radixserve.memory.tiers.disk_block import load_key, private_dir
from radixserve.memory.tiers.legacy import LegacyPromptCache
from radixserve.memory.tiers.radix import RadixPromptCache

log = logging.getLogger(__name__)
T = TypeVar("T")
STATS_LOG_INTERVAL_S = 30.0
SNAPSHOT_HEADER_BOUND = 4096  # a sealed state's bytes past its cell's (its header, the seal)


def backend_name(cfg: ServerConfig) -> str:
    """The host cache `cfg` describes: "none", "radix" or "legacy" (the whole-prompt cache)."""
    if cfg.cache_ram_mib == 0:
        return "none"
    return "radix" if cfg.cache_radix_prompt else "legacy"


def make_cache(cfg: ServerConfig, pool: KVPool, arch: str,
               models: tuple[ModelIdentity, ...] = ()) -> PromptCache:
    """The host cache `cfg` describes; with `--cache-disk`, `models` (the target, then a draft
    model) name the disk tier's files."""
    backend = backend_name(cfg)
    if cfg.cache_disk and not pool.layout.rows_every_position and pool.windowed is None:
        raise ValueError("--cache-disk: this model's recurrent state is kept in no pool the "
                         "disk tier can snapshot")
    if backend == "none":
        return NullPromptCache()
    limit = cfg.cache_ram_mib * 1024 * 1024 if cfg.cache_ram_mib > 0 else 0
    if backend == "radix":
        disk = make_disk(cfg, pool, models) if cfg.cache_disk else None
        pin = cfg.cache_pin_mib * 1024 * 1024
        return RadixPromptCache(limit, cfg.cache_radix_min_restore_tokens, disk=disk,
                                pin_limit_bytes=min(pin, limit) if limit > 0 else pin,
                                fingerprint=fingerprint_of(pool, arch))
    return LegacyPromptCache(limit, pool.n_cells, fingerprint_of(pool, arch))


def make_disk(cfg: ServerConfig, pool: KVPool, models: tuple[ModelIdentity, ...]) -> DiskTier:
    """The disk tier, its files keyed by the models' identities and the KV layout: another
    model, quantization, dtype, draft, kernel build or torch never sees them; with
    `--cache-disk-key`, names and checksums are keyed too (docs/SECURITY.md). A recurrent
    layout (Gated DeltaNet, Mamba2) keeps its state in snapshot files beside the blocks of its
    attention rows (disk.py): the state's layout names the files too."""
    assert models, "the disk tier needs the model's identity"
    key = load_key(cfg.cache_disk_key) if cfg.cache_disk_key else b""
    layout = pool.row_layout()
    h = hashlib.blake2b(digest_size=16)
    private_dir(cfg.cache_disk)
    # the weights' digest is kept in DIR, unless keyed: a writer without the key could plant a
    # false one there, and so have one model's files read as another's
    memo = None if key else cfg.cache_disk
    for m in models:
        h.update(m.identity(memo))
    h.update(repr(layout).encode())
    max_blob = 0
    if not pool.layout.rows_every_position and (w := pool.windowed) is not None:
        h.update(repr(swa_fingerprint(w, fingerprint_of(pool, ""))).encode())
        max_blob = pool.layout.state_bytes + SNAPSHOT_HEADER_BOUND
    limit = cfg.cache_disk_mib * 2**20 if cfg.cache_disk_mib > 0 else 0
    return DiskTier(cfg.cache_disk, limit, cfg.cache_disk_block, h.digest(), layout, key=key,
                    max_blob=max_blob)


class HostTier:
    def __init__(self, cfg: ServerConfig, pool: KVPool, arch: str,
                 cache: PromptCache | None = None, models: tuple[ModelIdentity, ...] = ()) -> None:
        self.pool = pool
        self.cache = cache if cache is not None else make_cache(cfg, pool, arch, models)
        self.misses = 0  # new prompts the host cache was asked for and restored nothing
        self.idle_slots = cfg.cache_idle_slots
        if cfg.cache_idle_slots and cfg.cache_ram_mib == 0:
            log.warning("--cache-idle-slots requires --cache-ram, disabling")
            self.idle_slots = False
        self._t_log = time.monotonic()
        self.limit = int(self.cache.stats()["limit_bytes"])  # --cache-ram; 0: no limit
        self._slots: Sequence[Holder] = ()  # whose checkpoints count under `limit`
        self.checkpoints_dropped = 0  # slots' checkpoints dropped to fit the budget

    # -- the slots' own checkpoints under --cache-ram ------------------------------------------
    def count_checkpoints(self, slots: Sequence[Holder]) -> None:
        """Count `slots`' context checkpoints under --cache-ram (where there is a byte limit
        and the layout takes checkpoints); no slots: stop (the slots and their pool go, the
        cache stays: sleep)."""
        if slots and self.limit > 0 and self.pool.layout.needs_checkpoints:
            self._slots = slots
            self.cache.beside = lambda held: sum(c.size for c in self._own(held))
        else:
            self._slots, self.cache.beside = (), None

    def _own(self, held: Mapping[int, bytes]) -> list[Checkpoint]:
        """The slots' checkpoints whose buffers are not in `held` (the cache's), each once."""
        own = {id(c.target): c for s in self._slots for c in s.kv.checkpoints
               if id(c.target) not in held}
        return sorted(own.values(), key=lambda c: c.born)

    def update(self) -> None:
        """The slots' own checkpoints within half the budget (the oldest go: the cache keeps
        room for what the sessions left in it); the cache within what they leave, a snapshot
        it drops going from the slots too (one eviction order: kept by a slot it would free
        nothing); then, if the cache could not make room (locked, pinned), the slots' own
        again, oldest first."""
        if not self._slots:
            self.cache.update()
            return
        before = self.cache.holds()
        self._fit_own(before, self.limit // 2)
        self.cache.update()
        held = self.cache.holds()
        self._drop({i: b for i, b in before.items() if i not in held})
        self._fit_own(held, self.limit - int(self.cache.stats()["bytes"]))

    def _fit_own(self, held: Mapping[int, bytes], room: int) -> None:
        """The slots' own checkpoints (not in `held`) within `room` bytes, the oldest
        dropped first."""
        own = self._own(held)
        total = sum(c.size for c in own)
        gone: dict[int, bytes] = {}
        for c in own:
            if total <= room:
                break
            gone[id(c.target)] = c.target
            total -= c.size
        if gone:
            log.info("dropped %d context checkpoints of the slots to stay within --cache-ram "
                     "(%.1f MiB): they keep %.1f MiB the cache does not", len(gone),
                     self.limit / 2**20, total / 2**20)
            self._drop(gone)

    def _evicting(self, op: Callable[[], T]) -> T:
        """Run `op` (a cache operation that may evict); the snapshots it dropped go from the
        slots too (the buffers held before are kept alive meanwhile, so no id is reused)."""
        if not self._slots:
            return op()
        before = self.cache.holds()
        out = op()
        held = self.cache.holds()
        self._drop({i: b for i, b in before.items() if i not in held})
        return out

    def _drop(self, buffers: Mapping[int, bytes]) -> None:
        """The slots' checkpoints whose buffers are `buffers` (by id) dropped."""
        n = sum(id(c.target) in buffers for s in self._slots for c in s.kv.checkpoints)
        if n:
            for s in self._slots:
                s.kv.drop_checkpoints(buffers)
            self.checkpoints_dropped += n

    def take_disk_loads(self) -> list[int]:
        """Finished disk reads into the tree (whose room they may make by evicting)."""
        disk = self.cache.disk_tier()
        assert disk is not None
        return self._evicting(disk.take_disk_loads)

    def consulted(self, update_cache: bool) -> PromptCache | None:
        """The cache when a new prompt may restore from it: always for the radix backend (hits
        are not consumed), only when the slot is about to be overwritten for the legacy one."""
        return self.cache if update_cache or self.cache.load_always else None

    def save_before_overwrite(self, slot: Holder, key: PromptKey, update_cache: bool) -> None:
        """Before `slot` takes the prompt `key`: the radix tree is offered what
        the slot holds whenever the prompt will not keep all of it (its last token is always
        computed); the legacy cache only when `update_cache` (llama.cpp's rule)."""
        if self.cache.offer_every_drop:
            if min(salted_lcp(slot.kv, key), len(key) - 1) >= len(slot.kv):
                return
        elif not update_cache:
            return
        self.offer(slot)

    def offer(self, slot: Holder) -> None:
        """The slot's KV into the host cache (nothing when it is not reusable or the cache
        declines: over its budget, or a sliding window that dropped the rows). No update()
        here: a radix save enforces its limit itself, and the legacy cache evicts after the
        load, as llama.cpp (the scheduler calls it)."""
        if self.save(slot.kv):
            log.debug("slot %d: saved %d tokens to the host cache", slot.id, len(slot.kv))

    def save(self, kv: SlotKV) -> bool:
        """`kv` into the host cache; a snapshot the save's own eviction dropped goes from the
        slots too (as in `update`)."""
        return self._evicting(lambda: kv.save_to(self.cache))

    def cache_idle_slots(self, slots: Sequence[Holder], exclude: Holder | None = None) -> None:
        """`--cache-idle-slots`: save every idle slot's KV to the cache and, with unified KV
        (only there does it free cells another slot can use), clear the slot."""
        if not self.idle_slots:
            return
        saved = False
        for s in slots:
            if s.is_processing or not len(s.kv) or s is exclude:
                continue
            saved |= self.save(s.kv)
            if self.pool.unified:
                s.kv.drop()
        if saved:
            self.update()
        now = time.monotonic()
        log_stats = getattr(self.cache, "log_stats", None)
        if log_stats is not None and now - self._t_log > STATS_LOG_INTERVAL_S:
            self._t_log = now
            log_stats()

    def clear_idle_slot(self, slots: Sequence[Holder], exclude: Holder | None = None) -> bool:
        """llama-server's try_clear_idle_slots, unified KV only: free the first idle slot holding
        cells. Unlike llama-server, its KV goes to the host cache first (when there is one), so
        freeing cells for an active slot loses nothing a later request could reuse."""
        if not self.pool.unified:
            return False
        for s in slots:
            if not s.is_processing and len(s.kv) and s is not exclude:
                log.warning("purging slot %d with %d tokens", s.id, len(s.kv))
                if self.save(s.kv):
                    self.update()
                s.kv.drop()
                return True
        return False
