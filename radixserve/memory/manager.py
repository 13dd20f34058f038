"""The one object the engine sees of sequence memory: the pool, each slot's KV owner, the host
tier (radix tree or llama.cpp's whole-prompt cache, or none), the disk tier under it, slot
files, and the figures /metrics, /slots and /cache show.

Every decision to save, offer, restore, share, pin or drop a slot's KV is taken here (or by
the modules this one calls: the prefix planner, the host tier's triggers), never by the
scheduler, which asks in scheduling terms: may this task start, which slot takes it, admit it
(returns where its prefix came from), make room, the step is committed, the task ended or failed.
The host cache backends are strategies behind this object; what differs between them (whether a
hit is consumed, whether every drop is offered) is read here and nowhere outside memory/.

Runs on the engine thread only, as everything it holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from radixserve.config import ServerConfig
from radixserve.memory import miss_report
from radixserve.memory.holders import Holder, Request
from radixserve.memory.host_tier import HostTier
from radixserve.memory.key import PromptKey
from radixserve.memory.miss_report import Reuse
from radixserve.memory.pool.pool import KVPool, OutOfCells
from radixserve.memory.prefix_plan import (PrefixPlan, choose_slot, pending_prefill,
                                           salted_lcp, take_prefix)
from radixserve.memory.slot_files import slot_action
from radixserve.memory.tiers.base import DiskTierCache, PromptCache
from radixserve.memory.tiers.prefix import common_prefix
from radixserve.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class MemoryManager:
    def __init__(self, cfg: ServerConfig, pool: KVPool, slots: Sequence[Holder], host: HostTier,
                 tok: Tokenizer, arch: str, *, no_shift: bool) -> None:
        """`slots`: the engine's slots, each holding one of this pool's sequences (read, never
        changed here but through their `kv`); `no_shift`: KV is never shifted (a sliding
        window keeps none to shift; deterministic mode never reuses KV computed for other
        text), so `--cache-reuse` is off."""
        self.cfg, self.pool, self.slots, self.host, self.tok = cfg, pool, slots, host, tok
        self.arch = arch
        self.no_shift = no_shift
        # the disk tier under the host cache: tasks wait (unslotted) while their blocks load
        self.disk: DiskTierCache | None = host.cache.disk_tier()
        self._disk_wait: dict[int, int] = {}  # task id -> disk ticket it waits for
        self._from_disk: set[int] = set()  # task ids whose disk read ended (reuse report)
        self._disk_asked: set[int] = set()  # task ids whose disk lookup was made
        self._waiters: dict[int, PromptKey] = {}  # tasks waiting for a prefill's prefix
        host.count_checkpoints(slots)

    @property
    def cache(self) -> PromptCache:
        """The host cache backend (for its figures: stats(), name)."""
        return self.host.cache

    def cache_stats(self) -> dict[str, float]:
        """The host cache's figures (one set of names for every backend)."""
        return self.host.cache.stats()

    # -- sleep: the device memory goes, the host tier stays ----------------------------------
    def keep_host(self) -> tuple[PromptCache, int]:
        """Before the pool and the slots go: every slot's KV offered to the host cache (what
        it does not already hold, within --cache-ram). Returns the cache and its miss count,
        for the manager built on waking (`carry_misses`)."""
        for slot in self.slots:
            if len(slot.kv):
                self.host.offer(slot)
        self.host.update()
        self.host.count_checkpoints(())  # the cache outlives the slots: it holds none of them
        return self.host.cache, self.host.misses

    def carry_misses(self, n: int) -> None:
        """Go on counting host-cache misses from a previous manager's `n`."""
        self.host.misses = n

    # -- admission ---------------------------------------------------------------------------
    def must_wait(self, task: Request) -> bool:
        """Whether `task` should wait rather than start now: another slot is computing a prefix
        it would reuse, or its prompt's blocks are being read from disk."""
        if pending_prefill(self.slots, task) is not None:
            self._waiters[task.id] = task.key  # its fork with that prefill: see `_forks`
            return True
        self._waiters.pop(task.id, None)
        return self._awaits_disk(task)

    def choose_slot(self, task: Request) -> tuple[Holder | None, bool]:
        """llama-server's slot choice; the flag: the slot's content goes to the host cache
        first (legacy rule). The slot may be busy (the task named it): the caller waits."""
        return choose_slot(self.slots, task, self.cfg.slot_prompt_similarity)

    def before_launch(self, slot: Holder) -> None:
        """`--cache-idle-slots`, radix backend: the other idle slots are cached before the new
        task plans its prefix, so it can already restore what they held."""
        if self.host.cache.load_always:
            self.host.cache_idle_slots(self.slots, exclude=slot)

    def after_launch(self) -> None:
        """`--cache-idle-slots`, legacy backend: llama.cpp caches the idle slots once the new
        task took its slot."""
        if not self.host.cache.load_always:
            self.host.cache_idle_slots(self.slots)

    def admit(self, slot: Holder, task: Request, *, update_cache: bool,
              n_cache_reuse: int | None, prefer: Holder | None, slot_only: bool
              ) -> tuple[PrefixPlan, Reuse]:
        """Make `slot` hold the longest reusable prefix of the task's prompt (its own KV,
        shifted chunks, another slot's cells, the host or disk tier), after saving what the
        slot would lose. Returns the plan carried out and the reuse report.
        `n_cache_reuse`: the task's own `--cache-reuse` (None: the server's); `prefer`: the
        slot of an n_cmpl parent; `slot_only`: the KV stays out of the host tiers."""
        from_disk = task.id in self._from_disk
        self._from_disk.discard(task.id)
        self._disk_asked.discard(task.id)
        key = task.key
        if self.pool.unified:  # room for the whole prompt, so a cached prefix can be restored
            while (self.pool.n_free + len(slot.kv) < len(key)
                   and self.make_room(exclude=slot)):
                pass
        self.host.save_before_overwrite(slot, key, update_cache)
        n_reuse = self.cfg.cache_reuse if n_cache_reuse is None else n_cache_reuse
        if n_reuse > 0 and self.no_shift:
            if n_cache_reuse:  # llama-server's words where it cannot shift the cache
                log.warning("cache reuse is not supported - ignoring n_cache_reuse = %d",
                            n_reuse)
            n_reuse = 0
        host = self.host.consulted(update_cache)
        loads = host.stats()["loads"] if host is not None and task.cache_prompt else None
        held = miss_report.probe(key, self.slots, self.host.cache)
        plan = take_prefix(slot, key, self.slots, host, task.cache_prompt, n_reuse, prefer)
        slot.kv.slot_only = slot_only
        why = miss_report.report(held, plan, key.tokens, from_disk, self.tok,
                                 windowed=self.pool.layout.window > 0 and task.cache_prompt)
        if loads is not None and host is not None and host.stats()["loads"] == loads:
            self.host.misses += 1
        if update_cache:
            self.host.update()
        return plan, why

    def forget(self, task_id: int) -> None:
        """A waiting task left: nothing of it is kept."""
        self._disk_wait.pop(task_id, None)
        self._from_disk.discard(task_id)
        self._disk_asked.discard(task_id)
        self._waiters.pop(task_id, None)

    def _awaits_disk(self, task: Request) -> bool:
        """Whether `task` waits for its prompt's blocks to come from disk into the radix tree
        (the lookup is made once, when the task is first considered; off the engine thread)."""
        if self.disk is None or not task.cache_prompt:
            return False
        if task.id not in self._disk_asked:
            self._disk_asked.add(task.id)
            key = task.key
            n_have = max((salted_lcp(s.kv, key) for s in self.slots if s.kv.reusable),
                         default=0)
            ticket = self.disk.disk_lookup(key, n_have)
            if ticket is not None:
                self._disk_wait[task.id] = ticket
        return task.id in self._disk_wait

    def poll_io(self) -> bool:
        """Take finished disk reads into the radix tree; True when a waiting task may go on."""
        if self.disk is None:
            return False
        done = set(self.host.take_disk_loads())
        if not done:
            return False
        # their prefixes are in the tree now, read from disk
        self._from_disk |= {t for t, k in self._disk_wait.items() if k in done}
        self._disk_wait = {t: k for t, k in self._disk_wait.items() if k not in done}
        return True

    # -- while tasks run ---------------------------------------------------------------------
    def reserve(self, slot: Holder, pos0: int, n: int, generating: bool) -> list[int] | None:
        """Cells for n tokens of `slot` at pos0.. before a batch runs, idle slots cleared (their
        KV kept by the host cache) until they fit; None when even that does not make room.
        `generating`: the tokens are the pending one and its draft, and cells drafting
        reserved already are kept."""
        kv = slot.kv
        held = max(pos0, self.pool.seq_pos_max(kv.seq) + 1) if generating else pos0
        cells: list[int] = []
        while held < pos0 + n:
            try:
                cells = kv.reserve(held, pos0 + n - held)
                break
            except OutOfCells:
                if not self.make_room():
                    return None
        if held > pos0:  # some were reserved while drafting
            cells = self.pool.cells_at(kv.seq, list(range(pos0, pos0 + n)))
        return cells

    def make_room(self, exclude: Holder | None = None) -> bool:
        """llama-server's try_clear_idle_slots (unified KV): an idle slot's cells freed, its
        KV kept by the host cache first. False when no idle slot held any."""
        return self.host.clear_idle_slot(self.slots, exclude)

    def checkpoint_chunk(self, slot: Holder, p0: int, take: int, user_starts: Sequence[int],
                         task_id: int) -> tuple[int, bool]:
        """llama-server's context checkpoints (sliding window), for the prompt chunk of `take`
        tokens at p0 about to be scheduled: where the chunk must end so checkpoints land where
        a later prompt is likely to diverge, and whether one was taken before it runs. Returns
        (the chunk's length, taken)."""
        forks = self._forks(slot)
        take = self._cut(slot, p0, take, user_starts, forks)
        made = self._checkpoint(slot, p0, take, user_starts, task_id, forks)
        if made:
            self.host.update()  # the checkpoint's bytes count under --cache-ram
        return take, made

    def _forks(self, s: Holder) -> tuple[int, ...]:
        """Where a layout whose state has no rows a token (memory/pool/recurrent.py: its state
        exists only where a snapshot was kept) takes a checkpoint whatever the spacing: where
        the prompt leaves the text the host cache or another slot holds, or the prompt of a
        task waiting for this prefill (the next prompt of that group diverges there too:
        prompts fork where they forked before), and before the prompt's last token (a
        regenerated answer or a retried tool call resumes there)."""
        if self.pool.layout.rows_every_position:
            return ()
        prompt, kv = s.prompt, s.kv
        key = PromptKey(kv.salt, list(prompt))
        held = [self.host.cache.held(key, 0)[0]]
        held += [common_prefix(o.kv.tokens, prompt) for o in self.slots
                 if o is not s and o.kv.salt == kv.salt]
        held += [common_prefix(w.tokens, prompt) for w in self._waiters.values()
                 if w.ns == kv.salt]
        return tuple(sorted({m for m in held if 0 < m < len(prompt) - 1}
                            | {len(prompt) - 1}))

    def _cut(self, s: Holder, p0: int, take: int, starts: Sequence[int],
             forks: Sequence[int] = ()) -> int:
        """A chunk ends before a user message's start (the last one's, or any one when there is
        no checkpoint yet or it lies checkpoint_min_step past the last) and at a fork
        (`_forks`), and the last min(n_batch, n_ubatch + 4) and the last min(n_batch, 4)
        prompt tokens start chunks of their own."""
        n, cks, step = len(s.prompt), s.kv.checkpoints, self.cfg.checkpoint_min_step
        take = min([f - p0 for f in forks if p0 < f < p0 + take], default=take)
        for u in starts:
            if p0 < u < p0 + take and (u == starts[-1] or not cks
                                       or u > cks[-1].n_tokens + step):
                return u - p0
        for n_last in (min(self.cfg.batch_size, self.cfg.ubatch_size + 4),
                       min(self.cfg.batch_size, 4)):
            if p0 < n - n_last < p0 + take:
                return n - n_last - p0
        return take

    def _checkpoint(self, s: Holder, p0: int, take: int, starts: Sequence[int],
                    task_id: int, forks: Sequence[int] = ()) -> bool:
        """llama-server's do_checkpoint, before the chunk [p0, p0 + take) runs: at a user
        message's start or near the prompt's end, spaced checkpoint_min_step apart unless at
        the last user message or near the end; and at a fork, always."""
        kv = s.kv
        if p0 == len(kv) and p0 in forks and not any(c.n_tokens == p0 for c in kv.checkpoints):
            return kv.take_checkpoint(task_id) is not None
        near_end = len(s.prompt) < p0 + take + self.cfg.ubatch_size
        if p0 != len(kv) or not (near_end or p0 in starts):
            return False
        cks = kv.checkpoints
        if not (not cks or near_end or (starts and p0 == starts[-1])
                or p0 > cks[-1].n_tokens + self.cfg.checkpoint_min_step):
            return False
        return kv.take_checkpoint(task_id) is not None

    def offer_before_drop(self, slot: Holder) -> None:
        """The slot's KV is about to be replaced (a slot file restored) or partly discarded and
        never reused (a context shift): a backend that keeps every drop takes it first."""
        if self.host.cache.offer_every_drop:
            self.host.offer(slot)

    def slide(self, slot: Holder, cache_prompt: bool) -> None:
        """A step of `slot` is committed: a sliding window drops the KV no later token reads,
        first saving into a write-through host tier (radix) what it lacks."""
        kv = slot.kv
        if not self.pool.layout.window:
            return
        if (kv.window_unsaved() and self.host.cache.load_always and cache_prompt
                and kv.reusable):
            self.host.save(kv)
        kv.prune()

    def release(self, slot: Holder, task: Request, answered: bool) -> None:
        """The slot's task ended (`answered`: not cancelled): its KV stays in the slot (the
        slot-level prompt cache), is written through to disk when there is a disk tier, and its
        prompt (or the prefix `pin_key` names) is pinned in the tree for the task's `pin_s`
        seconds when asked; shifted or flushed KV is dropped, never reused."""
        kv, pin_s = slot.kv, task.pin_s
        kv.truncate(len(kv))  # cancelled mid-prompt: drop KV past the contiguous prefix
        if not kv.reusable:
            kv.drop()
        elif (self.disk is not None or pin_s) and self.host.save(kv):
            # on disk now, not only when the slot is reused: a restart; pinned: in the tree
            self.host.update()
        if pin_s and answered and kv.reusable and not self.host.cache.pin(
                task.pin_key, pin_s):
            log.warning("slot %d: task %d's prompt (%d tokens) not pinned: over "
                        "--cache-pin-mib, or not kept by the host cache", slot.id, task.id,
                        len(task.pin_key))

    def drop(self, slot: Holder) -> None:
        """The slot's task failed: its KV may be half-written, so none of it is kept."""
        slot.kv.drop()

    # -- the tiers as a whole ----------------------------------------------------------------
    def flush(self) -> tuple[dict[str, int], Future[int] | None]:
        """The admin flush of every tier: the disk tier's reads and writes in flight are
        dropped first (so none lands in RAM afterwards) and its files go off the engine thread
        (the future: files removed; None without a disk tier); then every slot's KV (a busy
        slot's when its task ends) and the host cache. Returns what went."""
        disk = None if self.disk is None else self.disk.disk_flush()
        n_slots = 0
        for s in self.slots:
            if s.is_processing:
                s.kv.flushed = True  # never reused nor saved: dropped when the task ends
            elif not len(s.kv):
                continue
            else:
                s.kv.drop()
            n_slots += 1
        nodes, n_bytes = self.host.cache.clear()
        return {"slots": n_slots, "ram_entries": nodes, "ram_bytes": n_bytes}, disk

    def tier_figures(self) -> dict[str, dict[str, float]]:
        """Per cache tier: host RAM (when on) and disk (when on), for /metrics."""
        out = {}
        if self.host.cache.name != "none":
            st = self.host.cache.stats()
            out["ram"] = {"bytes": st["bytes"], "tokens": st["unique_tokens"],
                          "hits": st["loads"], "misses": self.host.misses,
                          "hit_tokens": st["hit_tokens"], "writes": st["saves"],
                          "evictions": st["evictions"]}
        if self.disk is not None:
            out["disk"] = self.disk.disk_figures()
        return out

    def checkpoints(self) -> tuple[int, int]:
        """Context checkpoints the slots keep: (count, bytes)."""
        if not self.pool.layout.needs_checkpoints:
            return 0, 0
        return (sum(len(s.kv.checkpoints) for s in self.slots),
                sum(s.kv.checkpoint_bytes for s in self.slots))

    def take_checkpoints_dropped(self) -> int:
        """Checkpoints the slots dropped to stay within --cache-ram since the last call."""
        n, self.host.checkpoints_dropped = self.host.checkpoints_dropped, 0
        return n

    def set_disk_wake(self, wake: Callable[[], None]) -> None:
        """Have the disk tier (when on) call `wake` when a read ends, from its I/O thread."""
        if self.disk is not None:
            self.disk.set_disk_wake(wake)

    def close(self) -> None:
        """Let the disk tier finish its queued writes (a restart finds them)."""
        if self.disk is not None:
            self.disk.close()

    def check(self) -> None:
        """Every invariant of the memory: the pool's bookkeeping, each slot's KV against its
        tokens, the host cache's (tests call this after every step)."""
        self.pool.check()
        for s in self.slots:
            s.kv.check()
        self.host.cache.check()

    def slot_action(self, id_slot: int, action: str, filename: str | None) -> dict[str, Any]:
        """`POST /slots/{id}?action=save|restore|erase` (memory/slot_files.py)."""
        return slot_action(self, id_slot, action, filename)
