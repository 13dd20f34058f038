"""Host prompt cache, radix backend (the seeds' `--cache-radix-prompt`).

Prompts are kept in a radix tree (`radix_tree.py`) whose edges own the K/V rows of their tokens,
so a prefix shared by many prompts is stored once. `save` copies out only the rows past the
longest stored prefix; `load` hands the longest stored prefix of a new prompt over as the
matched segments themselves (locked until the slot's KV owner has copied them straight into its
cells: "direct KV"), without consuming it. A restore that fails part-way (a bad segment, out of
cells, an injected fault) has its cells removed by the writer, which reports the error: counted
as a "fallback", the scheduler prefills from scratch, the tree stays usable. `--cache-ram`
bounds the bytes; LRU leaves go first.

Sliding-window models (memory/pool/swa.py): a segment keeps every layer of every token, the sliding
layers stacked after the global ones, so the tree never needs checkpoints: restoring a prefix
writes the global layers' rows for all of it and the sliding layers' for its last window. A
slot's sliding part holds only its window, so the engine saves into the tree before the window
drops rows the tree lacks (write-through, engine/scheduler.py); a save whose new rows have left
the window is skipped.

Tenants: a `salt` (a request's `cache_salt`) is the tree's namespace: prompts of different salts
never match each other, in RAM or on disk.

Disk tier (`disk`, disk.py): every block of `disk.block` tokens a save completes is written
through to disk (in the background), and an evicted leaf's blocks the disk lacks are written
before it goes. `disk_lookup` starts reading a prompt's blocks past what RAM and the slots hold;
`take_disk_loads` puts what was read into the tree (on the engine thread), from where `load`
hands it over as any other prefix.

A recurrent layout (memory/pool/recurrent.py: the disk tier's `snapshots`): the blocks hold the
attention rows, and the nodes' snapshots go to snapshot files (disk.py, disk_block.py). Rule:
whenever a node's blocks are written through (a save completes, a leaf is evicted), the
snapshots on its path (its own and its ancestors') the disk lacks are written too, the
deepest first, at most SNAPSHOT_WRITES a call (each is written once: later calls skip what
is on disk or queued). `disk_lookup` then asks for the deepest snapshot of the prompt (but
its last token) past what the tree or a slot can resume from; its read brings the blocks
below it and the tail's rows, and `take_disk_loads` inserts them and attaches the state at
its depth. No snapshot on the prompt's path: nothing is read (blocks alone serve nothing).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from radixserve.memory.tiers.base import Restore, Segment, stats_dict
from radixserve.memory.tiers.disk import DiskTier, Loaded
from radixserve.memory.tiers.prefix import common_prefix
from radixserve.memory.tiers.radix_tree import RadixMatch, RadixNode, RadixTree, own_rows
from radixserve.memory.checkpoint import Checkpoint, seal
from radixserve.memory.key import PromptKey
from radixserve.memory.pool.pool import KVPool
from radixserve.memory.pool.state import Fingerprint, get_swa_state

log = logging.getLogger(__name__)
SNAPSHOT_WRITES = 4  # snapshot files a write-through queues at most (the deepest first)


def _to_snapshot(match: RadixMatch) -> RadixMatch:
    """The match cut back to the deepest node on its path that ends within it and keeps a
    snapshot (a recurrent state exists only where one was kept)."""
    path = match.path
    while path and (path[-1].depth > match.length or not path[-1].snapshot):
        path = path[:-1]
    return RadixMatch(path[-1].depth if path else 0, path)


def _checkpoints(match: RadixMatch, n: int = 2) -> list[Checkpoint]:
    """The deepest `n` snapshots along a match, as the context checkpoints a restore hands the
    slot (it resumes from the deepest the new prompt can use: the prompt's last token is
    always computed, so a prompt ending at the match's end needs the one before)."""
    out = [Checkpoint(node.depth, node.depth - 1, node.depth - 1, node.snapshot)
           for node in match.path if node.snapshot and node.depth <= match.length]
    return out[-n:]


class InjectedFault(RuntimeError):
    """Raised by the fault hook (the seed's LLAMA_SERVER_RADIX_TEST_FAULT_INJECTION) in the
    middle of a restore; tests set it through the constructor."""


@dataclass(slots=True)
class Pin:
    """`end` and the nodes above it are kept (locked) until `until` (time.monotonic())."""

    end: RadixNode
    until: float


class RadixPromptCache:
    """The `PromptCache` protocol over a radix tree of K/V segments."""

    name = "radix"
    load_always = True  # hits are not consumed: try the tree for every new prompt
    offer_every_drop = True  # a save stores only the rows past the stored prefix

    def __init__(
        self, limit_bytes: int, min_restore_tokens: int = 0, fault_after_tokens: int | None = None,
        fault_restores: int | None = None, disk: DiskTier | None = None,
        pin_limit_bytes: int = 0, fingerprint: Fingerprint | None = None,
    ) -> None:
        """`fault_after_tokens` (tests only): restores raise InjectedFault after writing that
        many tokens' cells - every restore, or only the first `fault_restores`.
        `pin_limit_bytes`: what `prompt_cache_retention` pins may hold (0: no pins)."""
        self.tree = RadixTree()
        self.disk = disk
        self.fp = fingerprint  # names a snapshot's state (a recurrent layout's; see `save`)
        self.snapshots_dropped = 0
        # (salt, last key[, the tail's tokens: a snapshot read]) -> disk ticket
        self._inflight: dict[tuple[object, ...], int] = {}
        self.disk_inserts = 0  # prefixes read from disk into the tree
        self.limit_bytes = limit_bytes  # <= 0: no limit (--cache-ram -1)
        self.beside: Callable[[Mapping[int, bytes]], int] | None = None
        self.min_restore_tokens = min_restore_tokens
        self.fault_after_tokens = fault_after_tokens
        self.fault_restores_left = fault_restores  # None: every restore faults
        self.saves = self.loads = self.hit_tokens = 0
        self.evictions = self.evicted_tokens = self.fallbacks = self.skipped = 0
        # `prompt_cache_retention`: prompts kept from eviction until a time, oldest first,
        # within pin_limit_bytes (held through the tree's locks; see `pin`)
        self.pins: list[Pin] = []
        self.pin_limit_bytes = pin_limit_bytes
        self.pinned_bytes = 0  # the pins' nodes, shared ones once (kept by `_count_pins`)
        self.pins_lapsed = 0  # pins released early to stay within the budget

    # ##### PromptCache #####
    def save(self, pool: KVPool, seq: int, key: PromptKey,
             checkpoints: Sequence[Checkpoint] = ()) -> bool:
        """Store `key` (token i at position i of `seq`); only rows past the stored prefix move.

        Skipped (False) for an empty prompt, when the new rows alone exceed the limit, or when
        host memory runs out: then the tree is exactly as before, since every allocation
        (copy-out, split) happens before the tree changes.
        """
        tokens, salt = key.tokens, key.ns
        n = len(tokens)
        if n == 0:
            return False
        if pool.seq_positions(seq)[:n] != list(range(n)):
            raise ValueError(f"sequence {seq} does not hold positions 0..{n - 1} for {n} tokens")
        found = self.tree.match(tokens, salt)
        m = found.length
        snaps = self._snapshots(pool, seq, n, checkpoints, found)
        if m < n and not 0 <= pool.rows_held_from(seq) <= m:
            log.debug("radix save of %d new tokens skipped: the sliding window dropped them",
                      n - m)
            self.skipped += 1
            return False
        if 0 < self.limit_bytes < (n - m) * pool.bytes_per_token + sum(map(len, snaps.values())):
            log.debug(
                "radix save of %d new tokens skipped: over the %d-byte limit",
                n - m,
                self.limit_bytes,
            )
            self.skipped += 1
            return False
        try:
            k, v, *more = pool.rows_out(seq, m, n)
            node = self.tree.insert(tokens, k, v, tuple(more), salt)
            for depth, snap in snaps.items():
                self.tree.attach(self.tree.node_at(node, depth), snap)
        except (MemoryError, torch.OutOfMemoryError) as e:
            log.warning("radix save of %d tokens failed (%s); cache unchanged", n, e)
            return False
        self.saves += 1
        # the end node's edge, and every new row (snapshots may have split their edge)
        self._to_disk(node, min(m, node.depth - len(node.tokens)))
        self.update()
        return True

    def _snapshots(self, pool: KVPool, seq: int, n: int, checkpoints: Sequence[Checkpoint],
                   found: RadixMatch) -> dict[int, bytes]:
        """{depth: state} a save of n tokens attaches, for a layout whose recurrent state has no
        rows a token (memory/layout.py's rows_every_position): the slot's checkpoints, and its
        state after its last token when it holds exactly those n; none where the tree
        (`found`: its match of the tokens) has one already (the same tokens give the same
        state: a slot saved again costs no copy), and a checkpoint there takes the tree's
        buffer, so the slot and the tree hold one copy (--cache-ram counts it once). Empty
        for the others."""
        w = pool.windowed
        if pool.layout.rows_every_position or w is None or self.fp is None:
            return {}
        have = {p.depth: p.snapshot for p in found.path if p.snapshot and p.depth <= found.length}
        out = {}
        for c in checkpoints:
            if 0 < c.n_tokens <= n:
                if c.n_tokens in have:
                    c.target = have[c.n_tokens]  # one buffer for both (see the docstring)
                else:
                    out[c.n_tokens] = c.target
        if n in have:
            return out
        if pool.seq_len(seq) == n and w.snapshot_from(seq) == n - 1:
            out[n] = seal(get_swa_state(w, seq, self.fp))
        return out

    def match(self, pool: KVPool, seq: int, slot_tokens: list[int], key: PromptKey) -> int:
        found = self._restorable(pool, seq, slot_tokens, key)
        return found.length if found is not None else 0

    def held(self, key: PromptKey, n_more: int) -> tuple[int, list[int]]:
        """The tree's longest match; past it, the rest of the edge it ends in, else the edge of
        the most recently used child: the stored text the prompt turned away from."""
        salt = key.ns
        match = self.tree.match(key.tokens, salt)
        m = match.length
        node = match.path[-1] if match.path else self.tree.roots.get(salt)
        if node is None:
            return 0, []
        if m < node.depth:  # the prompt leaves in the middle of this edge
            return m, list(node.tokens[m - (node.depth - len(node.tokens)):][:n_more])
        more: list[int] = []
        while len(more) < n_more and node.children:
            node = max(node.children.values(), key=lambda c: c.last_access)
            more += node.tokens[:n_more - len(more)]
        return m, more

    def _restorable(self, pool: KVPool, seq: int, slot_tokens: list[int],
                    key: PromptKey) -> RadixMatch | None:
        """The stored prefix `load` would restore: long enough, better than the slot's own, and
        with room for it."""
        match = self.tree.match(key.tokens, key.ns)
        if not pool.layout.rows_every_position:
            # a recurrent state: up to a snapshot only, one the prompt can resume from (its
            # last token is always computed)
            match = _to_snapshot(RadixMatch(min(match.length, len(key) - 1), match.path))
        m = match.length
        if m == 0 or m < self.min_restore_tokens or m <= common_prefix(slot_tokens, key.tokens):
            return None
        return match if self.can_restore(pool, seq, m) else None

    def load(self, pool: KVPool, seq: int, slot_tokens: list[int],
             key: PromptKey) -> Restore | None:
        """The longest stored prefix of the prompt `key`, if it beats what `seq` keeps, as the matched
        segments in `pool`'s layout for positions 0..m-1 (the whole match: the scheduler keeps
        at least one token to evaluate itself).

        None: nothing better (or too few free cells). Otherwise the matched nodes stay locked
        (never evicted) until `Restore.done`, which counts a load, or a fallback for an error.
        """
        match = self._restorable(pool, seq, slot_tokens, key)
        if match is None:
            return None
        m = match.length
        end = match.path[-1]
        self.tree.touch(end)
        self.tree.lock(end)  # eviction must not drop the segments while they are copied
        return Restore(key.tokens[:m], self._segments(pool, match), key.ns,
                       checkpoints=_checkpoints(match), kept=True,
                       on_done=lambda error: self._restored(end, m, seq, error))

    def _restored(self, end: RadixNode, m: int, seq: int, error: BaseException | None) -> None:
        """The writer's report on a restore of `m` tokens into `seq` (locked at `end`)."""
        self.tree.unlock(end)
        if error is not None:
            self.fallbacks += 1
            log.warning(
                "radix restore of %d tokens into sequence %d failed (%s: %s); "
                "falling back to a full prefill",
                m,
                seq,
                type(error).__name__,
                error,
            )
            return
        self.loads += 1
        self.hit_tokens += m

    def update(self) -> None:
        """Evict LRU leaves until the tree fits the byte limit (locked and pinned nodes stay;
        pins past their time are released first)."""
        self.expire_pins()
        if self.limit_bytes > 0:
            room = self.limit_bytes
            if self.beside is not None:
                room = max(0, room - self.beside(self.holds()))
            self.snapshots_dropped += self.tree.drop_snapshots(room)
            on_evict = self._to_disk if self.disk is not None else None
            nodes, tokens = self.tree.evict(room, on_evict)
            self.evictions += nodes
            self.evicted_tokens += tokens

    def holds(self) -> dict[int, bytes]:
        return {id(n.snapshot): n.snapshot for n in self.tree.nodes() if n.snapshot}

    # ##### Pins (`prompt_cache_retention`) #####
    def pin(self, key: PromptKey, seconds: float, now: float | None = None) -> bool:
        """Keep the nodes holding `key` (stored whole: save them first) from LRU eviction for
        `seconds`; a pin of the same nodes is extended. Pins hold at most `pin_limit_bytes`
        (shared nodes counted once): the oldest lapse first to make room, and a prompt larger
        than the budget alone is not pinned (False: the tree and the other pins as they were).
        A key ending inside a stored edge (a prompt's prefix) splits it there: the pin keeps
        that prefix, not what follows."""
        now = time.monotonic() if now is None else now
        self.expire_pins(now)
        tokens = key.tokens
        match = self.tree.match(tokens, key.ns)
        if not match.path or match.length < len(tokens):
            return False
        if self._path_bytes(match.path, len(tokens)) > self.pin_limit_bytes:
            return False  # too big alone: no split made, no other pin lapsed for it
        end = self.tree.cut(match.path[-1], len(tokens))
        old = next((p for p in self.pins if p.end is end), None)
        if old is not None:
            self.pins.remove(old)
            self.pins.append(Pin(end, max(old.until, now + seconds)))
            return True
        self.tree.lock(end)
        self.pins.append(Pin(end, now + seconds))
        self._count_pins()
        while self.pins and self.pinned_bytes > self.pin_limit_bytes:
            self._unpin(self.pins[0])
            self.pins_lapsed += 1
        return any(p.end is end for p in self.pins)

    @staticmethod
    def _path_bytes(path: list[RadixNode], depth: int) -> int:
        """The bytes of the nodes a pin ending `depth` tokens deep on `path` would hold: the
        last edge's up to that depth (as `tree.cut` would split it: rows are per token)."""
        *above, last = path
        n = depth - (last.depth - len(last.tokens))
        return sum(p.row_bytes for p in above) + last.row_bytes * n // len(last.tokens)

    def expire_pins(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for p in [p for p in self.pins if p.until <= now]:
            self._unpin(p)

    def _count_pins(self) -> None:
        """Recount `pinned_bytes` when the pins change (pinned nodes are never evicted, and a
        split keeps a path's rows, so it holds in between: stats() runs at every launch). A
        pin keeps rows: a snapshot on its path (attached later, at any time) is not counted."""
        seen: dict[int, int] = {}
        for p in self.pins:
            for n in self.tree.path_to(p.end):
                seen[id(n)] = n.row_bytes
        self.pinned_bytes = sum(seen.values())

    def _unpin(self, p: Pin) -> None:
        self.pins.remove(p)
        self.tree.unlock(p.end)
        self._count_pins()

    def clear(self) -> tuple[int, int]:
        """An admin flush: drop every prefix, pinned ones too (none is written to disk);
        (nodes, bytes) gone."""
        for p in list(self.pins):
            self._unpin(p)
        n_bytes = self.tree.bytes
        nodes, _ = self.tree.clear()
        return nodes, n_bytes - self.tree.bytes

    # ##### Disk tier #####
    def disk_tier(self) -> RadixPromptCache | None:
        """This cache fronts its disk tier (base.py's `DiskTierCache`) when it has one."""
        return self if self.disk is not None else None

    def set_disk_wake(self, wake: Callable[[], None]) -> None:
        assert self.disk is not None
        self.disk.wake = wake

    def disk_figures(self) -> dict[str, float]:
        assert self.disk is not None
        return self.disk.figures()

    def disk_flush(self) -> Future[int]:
        """Drop queued disk writes and pending reads; remove the directory's block and
        snapshot files."""
        assert self.disk is not None
        self._inflight.clear()
        return self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def disk_lookup(self, key: PromptKey, n_have: int) -> int | None:
        """Start reading the disk blocks of the prompt's restorable prefix (all but its last
        token) past what the tree holds, when they would reach past `n_have` (what the tree
        or a slot holds already); the ticket `take_disk_loads` will return, or None."""
        if self.disk is None:
            return None
        if self.disk.snapshots:
            return self._snapshot_lookup(key, n_have)
        prompt, salt = key.tokens, key.ns
        b = self.disk.block
        j1 = (len(prompt) - 1) // b
        m = self.tree.match(prompt, salt).length
        if j1 * b <= max(m, n_have):
            return None
        j0 = m // b
        if self.limit_bytes > 0:  # never read more than the tree could hold
            j1 = min(j1, j0 + self.limit_bytes // self.disk.block_bytes)
            if j1 * b <= max(m, n_have):
                return None
        keys = self.disk.keys(salt, prompt, j1)
        ticket = self._inflight.get((salt, keys[-1]))
        if ticket is None:  # another task may be reading the same blocks already
            ticket = self.disk.load(salt, prompt[:j1 * b], j0, keys[j0:])
            self._inflight[(salt, keys[-1])] = ticket
        return ticket

    def _snapshot_lookup(self, key: PromptKey, n_have: int) -> int | None:
        """`disk_lookup` for a recurrent layout: read the deepest snapshot file of a prefix of
        the prompt (all but its last token) deeper than what the tree can resume from and
        `n_have`, and the blocks below it the tree lacks (chosen on the I/O thread, which
        indexes the files)."""
        assert self.disk is not None
        prompt, salt = key.tokens, key.ns
        n = len(prompt) - 1
        b = self.disk.block
        match = self.tree.match(prompt, salt)
        floor = max(_to_snapshot(RadixMatch(min(match.length, n), match.path)).length, n_have)
        if n <= floor:
            return None
        j0, j1 = match.length // b, n // b
        j_max = j1
        if self.limit_bytes > 0:  # never read more than the tree could hold
            j_max = min(j1, j0 + self.limit_bytes // self.disk.block_bytes)
        prefixes = [self.disk.root(salt), *self.disk.keys(salt, prompt, j1)]
        if not self.disk.may_have_snapshot(prompt[:n], prefixes, floor, j_max):
            return None  # no snapshot of it on disk (as last scanned): no round trip
        tag = (salt, prefixes[-1], *prompt[j1 * b:n])
        ticket = self._inflight.get(tag)
        if ticket is None:  # another task may be reading the same file already
            ticket = self.disk.load_snapshot(salt, prompt[:n], j0, prefixes, floor, j_max)
            self._inflight[tag] = ticket
        return ticket

    def take_disk_loads(self) -> list[int]:
        """Put finished disk reads into the tree; returns their tickets."""
        if self.disk is None:
            return []
        done = []
        for got in self.disk.take_loaded():
            self._inflight = {k: t for k, t in self._inflight.items() if t != got.ticket}
            done.append(got.ticket)
            try:
                if got.rows:
                    self._insert_loaded(got)
            except (MemoryError, torch.OutOfMemoryError) as e:  # the task computes instead
                log.warning("disk cache: %d tokens read but not kept (%s)", len(got.tokens), e)
        return done

    def _insert_loaded(self, got: Loaded) -> None:
        """Insert the part of a disk read the tree lacks now (it may have changed meanwhile:
        rows that no longer join the stored prefix are dropped)."""
        end = len(got.tokens)
        m = self.tree.match(got.tokens, got.ns).length
        if got.snapshot:
            self._insert_snapshot(got, m)
            return
        if not got.start <= m < end:
            return
        cut = m - got.start
        rows = got.rows if cut == 0 else [own_rows(t[:, :, cut:]) for t in got.rows]
        if 0 < self.limit_bytes < sum(t.nbytes for t in rows):
            return
        self.tree.insert(got.tokens, rows[0], rows[1], tuple(rows[2:]), got.ns)
        self.disk_inserts += 1
        self.update()

    def _insert_snapshot(self, got: Loaded, m: int) -> None:
        """A snapshot read: the rows the tree lacks (`m`: its match now), then the state on
        the node ending at its depth (unless one is there already)."""
        end = len(got.tokens)
        if m < got.start:
            return  # the tree lost the rows below the read meanwhile
        cut = min(m, end) - got.start
        rows = [] if m >= end else got.rows if cut == 0 else [own_rows(t[:, :, cut:])
                                                              for t in got.rows]
        if 0 < self.limit_bytes < sum(t.nbytes for t in rows) + len(got.snapshot):
            return
        if rows:
            node = self.tree.insert(got.tokens, rows[0], rows[1], tuple(rows[2:]), got.ns)
        else:
            node = self.tree.node_at(self.tree.match(got.tokens, got.ns).path[-1], end)
            self.tree.touch(node)
        if not node.snapshot:
            self.tree.attach(node, got.snapshot)
        self.disk_inserts += 1
        self.update()

    def _to_disk(self, node: RadixNode, lo: int | None = None) -> None:
        """Queue the disk writes of the whole blocks on `node`'s edge, or from depth `lo` on
        (its path gives the rows of blocks that start above), that the disk lacks."""
        disk = self.disk
        if disk is None:
            return
        path = self.tree.path_to(node)
        root = path[0].parent
        assert root is not None
        b, depth = disk.block, node.depth
        tokens = [t for n in path for t in n.tokens]
        j_first = (depth - len(node.tokens) if lo is None else lo) // b
        keys = disk.keys(root.ns, tokens, depth // b)
        for j in range(j_first, depth // b):
            if keys[j] in disk.known or keys[j] in disk.queued:
                continue
            a, z = j * b, (j + 1) * b
            pieces: list[list[torch.Tensor]] = [[] for _ in node.rows()]
            for n in path:
                lo = n.depth - len(n.tokens)
                if n.depth <= a or lo >= z:
                    continue
                for i, t in enumerate(n.rows()):
                    pieces[i].append(t[:, :, max(a, lo) - lo:min(z, n.depth) - lo])
            disk.write(keys[j], a, tokens[a:z], pieces)
        if disk.snapshots:
            self._snapshots_to_disk(path, tokens, [disk.root(root.ns), *keys])

    def _snapshots_to_disk(self, path: list[RadixNode], tokens: list[int],
                           prefixes: list[bytes]) -> None:
        """Queue the snapshot files of the snapshots on `path` the disk lacks, the deepest
        first, at most SNAPSHOT_WRITES (`prefixes`: P of each j down the path)."""
        disk = self.disk
        assert disk is not None
        b, queued = disk.block, 0
        for node in reversed(path):
            if queued >= SNAPSHOT_WRITES:
                return
            if not node.snapshot:
                continue
            d = node.depth
            j = d // b
            a = j * b
            key = disk.snap_key(prefixes[j], tokens[a:d])
            if key in disk.snap_known or key in disk.queued:
                continue
            pieces: list[list[torch.Tensor]] = [[] for _ in node.rows()]
            for n in path:
                lo = n.depth - len(n.tokens)
                if n.depth <= a or lo >= d:
                    continue
                for i, t in enumerate(n.rows()):
                    pieces[i].append(t[:, :, max(a, lo) - lo:min(d, n.depth) - lo])
            queued += disk.write_snapshot(prefixes[j], key, a, tokens[a:d], pieces,
                                          node.snapshot)

    def stats(self) -> dict[str, float]:
        t = self.tree
        return stats_dict(
            nodes=t.n_nodes, terminal_nodes=t.n_terminal, bytes=t.bytes,
            limit_bytes=max(0, self.limit_bytes), unique_tokens=t.unique_tokens,
            logical_tokens=t.logical_tokens, saves=self.saves, loads=self.loads,
            hit_tokens=self.hit_tokens, skipped=self.skipped, evictions=self.evictions,
            evicted_tokens=self.evicted_tokens, fallbacks=self.fallbacks,
            pins=len(self.pins), pinned_bytes=self.pinned_bytes,
            snapshots=t.n_snapshots, snapshot_bytes=t.snapshot_bytes,
            snapshots_dropped=self.snapshots_dropped,
        )

    def log_stats(self) -> None:
        s = self.stats()
        limit = f"{s['limit_bytes'] / 2**20:.1f}" if self.limit_bytes > 0 else "unlimited"
        log.info(
            "radix cache: %d nodes (%d terminal), %.1f / %s MiB, unique tokens %d, logical tokens "
            "%d, saves %d, loads %d, hit tokens %d, evictions %d, fallbacks %d",
            s["nodes"],
            s["terminal_nodes"],
            s["bytes"] / 2**20,
            limit,
            s["unique_tokens"],
            s["logical_tokens"],
            s["saves"],
            s["loads"],
            s["hit_tokens"],
            s["evictions"],
            s["fallbacks"],
        )

    def check(self) -> None:
        """Tree integrity, plus: at idle nothing is locked and the limit holds."""
        self.tree.check()
        pins: dict[str, int] = {}
        for p in self.pins:
            ns = self.tree.path_to(p.end)[0].parent
            assert ns is not None
            pins[ns.ns] = pins.get(ns.ns, 0) + 1
        assert all(r.lock_ref == 1 + pins.get(ns, 0) for ns, r in self.tree.roots.items()), \
            "a restore left locks"
        counted = self.pinned_bytes
        self._count_pins()
        assert counted == self.pinned_bytes, "pinned bytes miscounted"
        assert self.pinned_bytes <= self.pin_limit_bytes or not self.pins
        assert self.limit_bytes <= 0 or self.tree.bytes <= self.limit_bytes, "over the byte limit"
        assert min(self.saves, self.loads, self.hit_tokens, self.fallbacks, self.evictions) >= 0

    # ##### Internal helpers #####
    def can_restore(self, pool: KVPool, seq: int, n: int) -> bool:
        """Whether `seq` can hold `n` cells once its current ones (only those it alone holds) go
        (a sliding-window pool: the window's in its sliding part)."""
        return pool.can_hold(seq, n)

    def _segments(self, pool: KVPool, match: RadixMatch) -> Iterator[Segment]:
        """The matched rows at positions 0..match.length-1 in `pool`'s layout (a sliding-window
        pool's sliding layers for the window only), a segment per node; ValueError for a
        segment of another layout, InjectedFault (the fault hook) once that many tokens' rows
        were handed over."""
        fault, written = self.fault_after_tokens, 0
        lo = pool.window_from(match.length)
        for pos0, rows in match.all_rows():
            n = rows[0].shape[2] if fault is None else min(rows[0].shape[2], fault - written)
            yield pool.segment(pos0, list(rows), n, lo)
            written += n
            if fault is not None and written >= fault:
                if self.fault_restores_left is not None:
                    self.fault_restores_left -= 1
                    if self.fault_restores_left <= 0:
                        self.fault_after_tokens = None
                raise InjectedFault(f"injected fault after {written} restored tokens")
