"""llama.cpp's `server_prompt_cache`, rule for rule: whole-sequence states, FIFO eviction.

Each entry is one slot's whole sequence (tokens + state bytes, plus its context checkpoints,
counted in the entry's size as llama.cpp counts them, and a draft model's state of the same
tokens when there is one, restored together with the target's or not at all). Hits
are consumed: a loaded entry moves into the slot and leaves the cache. This is what
llama-server users know, and the baseline the radix backend is measured against.

Namespaces (a request's `cache_salt`, base.py): each entry carries the salt it was saved
under; a load considers only entries of the prompt's salt, and the save rules that compare
entries with the new prompt (already cached: skip; a prefix of it: obsolete) compare it only
with entries of its own salt. The limits and FIFO order stay shared: one RAM budget.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from radixserve.memory.tiers.base import Restore, Segment, stats_dict
from radixserve.memory.tiers.prefix import common_prefix
from radixserve.memory.checkpoint import Checkpoint
from radixserve.memory.key import PromptKey
from radixserve.memory.pool.pool import KVPool, OutOfCells
from radixserve.memory.pool.state import (Fingerprint, ParsedState, StateError, check_room,
                                  draft_state_size, get_draft_state, get_state, parse_draft_rows,
                                  parse_pool_state, state_size)

log = logging.getLogger(__name__)
MiB = 1024 * 1024
# eviction reasons that are memory pressure (an "obsolete" entry was superseded by a longer one)
PRESSURE = ("fifo", "bytes", "tokens")


@dataclass(slots=True)
class CacheEntry:
    tokens: list[int]
    salt: str = ""  # the namespace it was saved under: only prompts of the same salt see it
    data: bytes = b""  # target (main model) sequence state
    draft: bytes = b""  # draft model state: restored together with `data` or not at all
    checkpoints: list[Checkpoint] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.data) + len(self.draft) + sum(c.size for c in self.checkpoints)


class LegacyPromptCache:
    name = "legacy"
    load_always = False  # llama.cpp loads only when the slot is about to be overwritten
    offer_every_drop = False  # whole-prompt entries: llama.cpp's save-when-mostly-lost rule

    def __init__(self, limit_bytes: int, limit_tokens: int, fingerprint: Fingerprint) -> None:
        self.limit_size = max(0, limit_bytes)  # 0: no byte limit (--cache-ram -1)
        self.limit_tokens = limit_tokens  # n_ctx: soft, raised to what the bytes allow
        self.fp = fingerprint
        self.beside: Callable[[Mapping[int, bytes]], int] | None = None
        self.states: deque[CacheEntry] = deque()  # oldest first: eviction is FIFO
        self._bytes = 0
        self._tokens = 0
        self._evicted_tokens = 0
        self.counters = dict(saves=0, loads=0, hit_tokens=0, skipped=0, load_failures=0,
                             evicted_fifo=0, evicted_obsolete=0, evicted_bytes=0,
                             evicted_tokens=0, alloc_failures=0)

    # -- sizes -----------------------------------------------------------------------------
    def _room(self, saving: Sequence[Checkpoint] = ()) -> int:
        """The byte limit less what `beside` counts outside the entries (`saving`: the
        checkpoints of the entry being made, counted in its size)."""
        if self.beside is None:
            return self.limit_size
        held = self.holds()
        held.update((id(c.target), c.target) for c in saving)
        return max(0, self.limit_size - self.beside(held))

    def holds(self) -> dict[int, bytes]:
        return {id(c.target): c.target for e in self.states for c in e.checkpoints}

    def size(self) -> int:
        return self._bytes

    def n_tokens(self) -> int:
        return self._tokens

    def _push(self, e: CacheEntry) -> None:
        self.states.append(e)
        self._bytes += e.size
        self._tokens += len(e.tokens)

    def _remove(self, e: CacheEntry, reason: str | None) -> None:
        self.states.remove(e)
        self._forget(e, reason)

    def _pop_front(self, reason: str) -> None:
        self._forget(self.states.popleft(), reason)

    def _forget(self, e: CacheEntry, reason: str | None) -> None:
        self._bytes -= e.size
        self._tokens -= len(e.tokens)
        if reason is not None:
            self.counters[f"evicted_{reason}"] += 1
        if reason in PRESSURE:
            self._evicted_tokens += len(e.tokens)

    # -- the three operations ------------------------------------------------------------------
    def alloc(self, key: PromptKey, size: int,
              checkpoints: Sequence[Checkpoint] = ()) -> CacheEntry | None:
        """A new entry for `key` (state of `size` bytes), or None if it should not be cached. Only entries of the same salt can make it redundant or be made
        obsolete by it: another salt's copy of the same tokens is not reachable from this one."""
        tokens, salt = key.tokens, key.ns
        same = [e for e in self.states if e.salt == salt]
        for e in same:
            if common_prefix(e.tokens, tokens) == len(tokens):
                log.debug(" - prompt is already in the cache, skipping")
                return None
        if self.limit_size > 0 and size > self.limit_size:
            log.warning(" - prompt state size %.3f MiB exceeds cache size limit %.3f MiB, skipping",
                        size / MiB, self.limit_size / MiB)
            self.counters["skipped"] += 1
            return None
        for e in [e for e in same if common_prefix(e.tokens, tokens) == len(e.tokens)]:
            log.debug(" - removing obsolete cached prompt with length %d", len(e.tokens))
            self._remove(e, "obsolete")
        while (self.limit_size > 0 and self.states
               and self._bytes + size > self._room(checkpoints)):
            log.warning(" - making room for prompt cache entry, removing oldest entry "
                        "(size = %.3f MiB)", self.states[0].size / MiB)
            self._pop_front("fifo")
        return CacheEntry(tokens=list(tokens), salt=salt, checkpoints=list(checkpoints))

    def save(self, pool: KVPool, seq: int, key: PromptKey,
             checkpoints: Sequence[Checkpoint] = ()) -> bool:
        tokens = key.tokens
        if not tokens:
            return False
        t0 = time.perf_counter()
        n_draft = draft_state_size(pool, seq)
        size = state_size(pool, seq, self.fp) + n_draft + sum(c.size for c in checkpoints)
        log.debug(" - saving prompt with length %d, total state size = %.3f MiB (draft: %.3f "
                  "MiB)", len(tokens), size / MiB, n_draft / MiB)
        entry = self.alloc(key, size, checkpoints)
        if entry is None:
            return False
        try:
            entry.data = self._read_state(pool, seq)
            if pool.draft is not None:
                entry.draft = get_draft_state(pool, seq)
        except MemoryError as e:
            log.error("failed to allocate memory for prompt cache state: %s", e)
            self.counters["alloc_failures"] += 1
            self.limit_size = max(1, int(0.4 * self._bytes))
            log.warning(" - cache size limit reduced to %.3f MiB", self.limit_size / MiB)
            self.update()
            return False
        self._push(entry)
        self.counters["saves"] += 1
        log.info("prompt cache: saved %d tokens, checkpoints: %d (%.3f MiB) in %.2f ms",
                 len(tokens), len(entry.checkpoints),
                 entry.size / MiB, (time.perf_counter() - t0) * 1e3)
        return True

    def _read_state(self, pool: KVPool, seq: int) -> bytes:
        """Separate so tests can make the allocation fail (MemoryError)."""
        return get_state(pool, seq, self.fp)

    def _best(self, slot_tokens: list[int], key: PromptKey
              ) -> tuple[CacheEntry | None, int, float, float]:
        """The entry of the prompt's namespace that beats the slot on both f_keep and f_sim
        (llama.cpp's rule), the prompt tokens it covers, and its f_keep, f_sim."""
        prompt, salt = key.tokens, key.ns
        lcp = common_prefix(slot_tokens, prompt)
        f_keep_best = lcp / len(slot_tokens) if slot_tokens else -1.0
        f_sim_best = lcp / len(prompt)
        best, n_best = None, 0
        for e in self.states:
            if e.salt != salt:
                continue
            n = common_prefix(e.tokens, prompt)
            f_keep, f_sim = n / len(e.tokens), n / len(prompt)
            if f_keep < 0.25:  # don't trash large prompts
                continue
            if f_keep > f_keep_best and f_sim > f_sim_best:
                best, n_best, f_keep_best, f_sim_best = e, n, f_keep, f_sim
        return best, n_best, f_keep_best, f_sim_best

    def pin(self, key: PromptKey, seconds: float) -> bool:
        """Not kept: requests asking for retention are refused with this backend (parse.py)."""
        return False

    def held(self, key: PromptKey, n_more: int) -> tuple[int, list[int]]:
        """The entry of the key's namespace sharing the longest prefix with its tokens (the
        newest of equals) and what it continues with."""
        prompt, salt = key.tokens, key.ns
        best, more = 0, []
        for e in self.states:
            if e.salt != salt:
                continue
            n = common_prefix(e.tokens, prompt)
            if n >= best and n:
                best, more = n, e.tokens[n:n + n_more]
        return best, more

    def match(self, pool: KVPool, seq: int, slot_tokens: list[int], key: PromptKey) -> int:
        return self._best(slot_tokens, key)[1]

    def load(self, pool: KVPool, seq: int, slot_tokens: list[int],
             key: PromptKey) -> Restore | None:
        """The entry of the prompt's namespace that beats the slot on both f_keep and f_sim, its
        state checked against `pool` and `seq`'s room first (a failure: None, counted); it
        leaves the cache once written (take-and-delete), its checkpoints going with it. The
        draft part is checked as its rows are handed over: a bad one fails the whole restore."""
        best, n, f_keep_best, f_sim_best = self._best(slot_tokens, key)
        if best is None:
            return None
        log.info(" - found better prompt with f_keep = %.3f, f_sim = %.3f", f_keep_best, f_sim_best)
        try:
            st = parse_pool_state(pool, best.data, self.fp)  # everything checked before writing
            check_room(pool, seq, st)
        except (StateError, OutOfCells) as e:
            log.error("failed to restore state with size %d: %s", len(best.data), e)
            self.counters["load_failures"] += 1
            return None
        entry: CacheEntry = best
        return Restore(list(entry.tokens), self._segments(pool, entry, st), entry.salt,
                       list(entry.checkpoints), kept=False,
                       on_done=lambda error: self._loaded(entry, n, error))

    @staticmethod
    def _segments(pool: KVPool, e: CacheEntry, st: ParsedState) -> Iterator[Segment]:
        """The entry's rows: one segment, its draft part with it or neither (StateError)."""
        draft = None
        if pool.draft is not None:
            draft = parse_draft_rows(pool, e.draft, sorted(st.positions))
        swa = None if st.swa is None else (st.swa.positions, st.swa.k, st.swa.v)
        yield Segment(st.positions, st.k, st.v, swa, draft)

    def _loaded(self, e: CacheEntry, n: int, error: BaseException | None) -> None:
        """The slot's report on `e`'s rows: consumed when written, kept (and counted) if not."""
        if error is not None:
            log.error("failed to restore the prompt cache entry (%d tokens, draft state %d "
                      "bytes): %s", len(e.tokens), len(e.draft), error)
            self.counters["load_failures"] += 1
            return
        self._remove(e, None)  # consumed: the entry now lives in the slot
        self.counters["loads"] += 1
        self.counters["hit_tokens"] += n

    def update(self) -> None:
        t0 = time.perf_counter()
        while self.limit_size > 0 and self.states and self._bytes > self._room():
            log.warning(" - cache size limit reached, removing oldest entry (size = %.3f MiB)",
                        self.states[0].size / MiB)
            self._pop_front("bytes")
        per_token = max(1.0, self._bytes / max(1, self._tokens))
        limit_cur = self.limit_tokens
        if self.limit_size > 0:
            limit_cur = max(self.limit_tokens, int(self.limit_size / per_token))
        while self.limit_tokens > 0 and self.states and self._tokens > limit_cur:
            log.warning(" - cache token limit (%d, est: %d) reached, removing oldest entry "
                        "(size = %.3f MiB)", self.limit_tokens, limit_cur,
                        self.states[0].size / MiB)
            self._pop_front("tokens")
        log.debug(" - cache state: %d prompts, %.3f MiB (limits: %.3f MiB, %d tokens, %d est), "
                  "update took %.2f ms", len(self.states), self._bytes / MiB,
                  self.limit_size / MiB, self.limit_tokens, limit_cur,
                  (time.perf_counter() - t0) * 1e3)

    def clear(self) -> tuple[int, int]:
        """An admin flush: drop every entry; (entries, bytes) gone."""
        out = len(self.states), self._bytes
        self.states.clear()
        self._bytes = self._tokens = 0
        return out

    def stats(self) -> dict[str, float]:
        c = self.counters
        return stats_dict(
            nodes=len(self.states), terminal_nodes=len(self.states), bytes=self._bytes,
            limit_bytes=self.limit_size, limit_tokens=self.limit_tokens,
            unique_tokens=self._tokens, logical_tokens=self._tokens,  # every entry whole
            saves=c["saves"], loads=c["loads"], hit_tokens=c["hit_tokens"], skipped=c["skipped"],
            evictions=sum(c[f"evicted_{r}"] for r in PRESSURE),
            evicted_tokens=self._evicted_tokens, fallbacks=c["load_failures"],
        )

    def disk_tier(self) -> None:
        return None  # nothing below RAM

    def check(self) -> None:
        assert self._bytes == sum(e.size for e in self.states), "byte counter drifted"
        assert self._tokens == sum(len(e.tokens) for e in self.states), "token counter drifted"
