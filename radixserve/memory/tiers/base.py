"""The host tier's contract: what the scheduler may ask of a prompt cache backend.

Caches hold KV; they never write the device pool. A restore is a hand-over: `load` returns what
the cache holds for the prompt (a `Restore`: the tokens, their rows as `Segment`s in the pool's
layout, the checkpoints that came with them) and the slot's KV owner (memory/seq_kv.py, the
only writer of a slot's cells) writes the rows, then tells the cache how it went (`done`).

Rules every backend keeps (SGLang-style contracts):
- `save` copies a sequence's KV out of the pool and never modifies the pool.
- `match` says how long a prefix `load` would hand over now, and modifies nothing (the engine's
  prefix planner weighs it against the slot's own KV and other slots' before acting).
- `load` never writes the pool (it may read it: layouts, room). It returns None when it has
  nothing better than the slot (the slot stays untouched), else a `Restore`. Lock before use:
  whatever it hands over stays locked in the cache (not evicted, not consumed) until the writer
  calls `Restore.done` exactly once, with the error that stopped the writing or None. On an
  error the writer has removed every cell it wrote (the slot holds nothing and computes its
  prompt) and the cache counts a fallback; on success the cache counts the load (and a
  consuming backend drops the entry only then). Checks that can fail before anything is written (room, a bad
  state) make `load` return None instead.
- Evicting nothing is always safe; `update` only enforces limits.
- Namespaces: every operation takes a `salt` (a request's `cache_salt`; "" when it gave none).
  Entries of different salts never match each other: `match` and `load` consider only entries
  saved with the same salt, and what `save` skips or supersedes as already cached is judged
  within that salt only. Tenants that share a server therefore never share (or can time) each
  other's cached prefixes.
- `check` raises AssertionError when the bookkeeping is inconsistent (tests call it after every
  operation).
- `stats` reports the same figures under the same names whichever backend is on (`STAT_NAMES`),
  so dashboards do not change with `--cache-radix-prompt`.
- `disk_tier` says what the backend offers below RAM: the object the engine asks for disk reads,
  flushes and figures (`DiskTierCache`), or None; callers ask, they never test the class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol


from radixserve.memory.checkpoint import Checkpoint
from radixserve.memory.key import PromptKey
from radixserve.memory.pool.pool import KVPool
from radixserve.memory.pool.rows import Segment

__all__ = ["STAT_NAMES", "DiskTierCache", "NullPromptCache", "PromptCache", "Restore", "Segment"]

# Every backend's `stats()` keys, in this order (values are floats):
STAT_NAMES = (
    "nodes",  # radix tree nodes; legacy: entries
    "terminal_nodes",  # prompts stored (legacy: entries)
    "bytes",  # host bytes held
    "limit_bytes",  # --cache-ram in bytes; 0: no limit
    "limit_tokens",  # legacy's soft token limit (n_ctx); 0: none (radix)
    "unique_tokens",  # tokens stored, a shared prefix once
    "logical_tokens",  # tokens represented, a shared prefix once per prompt
    "saves",
    "loads",
    "hit_tokens",  # tokens restored by loads
    "skipped",  # saves refused: the entry alone is over the byte limit
    "evictions",  # entries (legacy) or leaves (radix) evicted
    "evicted_tokens",  # tokens they held
    "fallbacks",  # restores that failed (the slot computes what it then lacks)
    "pins",  # prompts kept from eviction (`prompt_cache_retention`; radix only)
    "pinned_bytes",  # the bytes they hold, shared prefixes once
    # a recurrent state's snapshots (memory/pool/recurrent.py; radix only): held, their bytes
    # (within `bytes`), and those dropped for room, their prefix then served up to the
    # nearest kept one
    "snapshots",
    "snapshot_bytes",
    "snapshots_dropped",
)


def stats_dict(**figures: float) -> dict[str, float]:
    """`figures` as a stats() answer: exactly STAT_NAMES, in order, absent ones 0."""
    unknown = set(figures) - set(STAT_NAMES)
    assert not unknown, f"not a cache stat: {sorted(unknown)}"
    return {k: float(figures.get(k, 0)) for k in STAT_NAMES}


class DiskTierCache(Protocol):
    """A host cache with a disk tier under it, as the engine sees it: reads started for a
    prompt's blocks (into the cache when they end), an admin flush, figures for /metrics, and
    the callback a finished read calls (from the tier's I/O thread)."""

    def disk_lookup(self, key: PromptKey, n_have: int) -> int | None:
        """Start reading the blocks of `key` the cache lacks past `n_have` tokens; a ticket
        to wait for, or None when nothing is to be read."""
        ...

    def take_disk_loads(self) -> list[int]:
        """Put finished reads into the cache; their tickets."""
        ...

    def disk_flush(self) -> Future[int]:
        """Drop queued writes and pending reads; remove the tier's files (the future: how
        many)."""
        ...

    def disk_figures(self) -> dict[str, float]:
        """The disk tier's figures for /metrics."""
        ...

    def set_disk_wake(self, wake: Callable[[], None]) -> None:
        """Call `wake` whenever a read ends (from the tier's I/O thread)."""
        ...

    def close(self) -> None:
        """Let queued writes finish (a restart finds them)."""
        ...


@dataclass(slots=True)
class Restore:
    """What `PromptCache.load` hands over: once every segment is written, the sequence holds
    `tokens` (token i at position i). Iterating `segments` may raise (a bad segment, an injected
    fault): the restore failed. `kept`: the cache still holds these tokens afterwards (a
    non-consuming backend), so a write-through save need not copy them again. `ns`: the cache
    namespace they were stored under (the slot's KV then belongs to it)."""

    tokens: list[int]
    segments: Iterable[Segment]
    ns: str = ""
    checkpoints: list[Checkpoint] = field(default_factory=list)
    kept: bool = False
    on_done: Callable[[BaseException | None], None] | None = None
    finished: bool = False

    def done(self, error: BaseException | None = None) -> None:
        """The writer's report, exactly once (later calls do nothing): `error` stopped the
        writing (its cells are gone already), or None. Releases what the cache locked."""
        if self.finished:
            return
        self.finished = True
        if self.on_done is not None:
            self.on_done(error)


class PromptCache(Protocol):
    name: str
    load_always: bool  # try `load` for every new prompt, not only when the slot is overwritten
    # a slot's reusable KV is offered before any of it is removed (a radix tree stores only
    # the rows it lacks, so a slot sharing most of a new prompt costs its own suffix), not only
    # when a new prompt keeps less than half of it (llama.cpp's rule for whole-prompt entries)
    offer_every_drop: bool

    def save(self, pool: KVPool, seq: int, key: PromptKey,
             checkpoints: Sequence[Checkpoint] = ()) -> bool:
        """Copy `seq`'s KV (`key.tokens`, token i at position i) into the cache under
        `key.ns`, with the sequence's context checkpoints where the backend keeps them; False
        if skipped."""
        ...

    def match(self, pool: KVPool, seq: int, slot_tokens: list[int], key: PromptKey) -> int:
        """Tokens of the prompt `key` that `load` would hand over for `seq` now (0: none);
        modifies nothing."""
        ...

    def load(self, pool: KVPool, seq: int, slot_tokens: list[int],
             key: PromptKey) -> Restore | None:
        """A better prefix of the prompt `key` than `slot_tokens` (what `seq` keeps), stored
        under its namespace, as rows for `seq` to hold in place of its own, locked until `Restore.done`;
        None if the cache has none (or `seq` could not hold it). The pool is only read."""
        ...

    def held(self, key: PromptKey, n_more: int) -> tuple[int, list[int]]:
        """What the cache holds of the prompt `key` in its namespace (whether restorable now or
        not): the longest stored prefix's length and up to `n_more` tokens the stored sequence
        continues with past it ([]: it ends there). For the reuse report (memory/miss_report.py)."""
        ...

    def pin(self, key: PromptKey, seconds: float) -> bool:
        """Keep the stored `key` from eviction for `seconds` (`prompt_cache_retention`);
        False where the backend keeps no pins or they did not fit its pin budget."""
        ...

    def update(self) -> None:
        """Enforce the size limits (evict), in what `beside` leaves of them."""
        ...

    # bytes held outside the cache under its limit (the slots' own checkpoints), given the
    # buffers the cache holds itself (`holds`: those are counted once, by the cache); None:
    # nothing outside counts
    beside: Callable[[Mapping[int, bytes]], int] | None

    def holds(self) -> dict[int, bytes]:
        """The state buffers (snapshots, checkpoints) the cache holds, by id."""
        ...

    def clear(self) -> tuple[int, int]:
        """Drop everything (an admin flush; nothing goes to another tier): (entries, bytes)."""
        ...

    def stats(self) -> dict[str, float]:
        """Figures for /metrics (as radixserve:<key>) and /props: `STAT_NAMES`, every backend."""
        ...

    def check(self) -> None:
        """AssertionError when the bookkeeping is off (at idle: nothing left locked)."""
        ...

    def disk_tier(self) -> DiskTierCache | None:
        """The disk tier under this cache, or None when it offers none."""
        ...


class NullPromptCache:
    """`--cache-ram 0`: no host tier at all."""

    name = "none"
    load_always = False
    offer_every_drop = False

    def held(self, key: PromptKey, n_more: int) -> tuple[int, list[int]]:
        return 0, []

    def pin(self, key: PromptKey, seconds: float) -> bool:
        return False

    def save(self, pool: KVPool, seq: int, key: PromptKey,
             checkpoints: Sequence[Checkpoint] = ()) -> bool:
        return False

    def match(self, pool: KVPool, seq: int, slot_tokens: list[int], key: PromptKey) -> int:
        return 0

    def load(self, pool: KVPool, seq: int, slot_tokens: list[int],
             key: PromptKey) -> Restore | None:
        return None

    beside = None

    def update(self) -> None:
        pass

    def holds(self) -> dict[int, bytes]:
        return {}

    def clear(self) -> tuple[int, int]:
        return 0, 0

    def stats(self) -> dict[str, float]:
        return stats_dict()

    def check(self) -> None:
        pass

    def disk_tier(self) -> DiskTierCache | None:
        return None
