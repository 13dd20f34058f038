"""Host-cache restores go through the slot's KV owner alone (issue 37).

Every backend (none, legacy, radix, radix over a disk tier) is driven through `SlotKV` on pools
of every layout (unified, partitioned, sliding window, with a draft model's rows), with the pool
instrumented: a sequence operation (`alloc`, `seq_rm`, ...) whose nearest caller outside kv/ is
not memory/seq_kv.py fails the test, and every cache call (`save`, `match`, `load`, each step of
the handed-over segments, the `done` report) must leave the pool bit for bit as it found it.
After every operation: `SlotKV.check`, the pool's free + held accounting, the cache's own check
(the radix byte counter, no lock left) and, for every slot, its rows equal the rows its tokens
were computed with (rows are a function of the token prefix, as real K/V is): so a restore gives
back exactly the rows that were saved.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import radixserve.memory.seq_kv as slot_kv_module
import radixserve.memory.pool.pool as pool_module
from radixserve.memory.key import PromptKey
from radixserve.memory.tiers.base import NullPromptCache, PromptCache, Restore, Segment
from radixserve.memory.tiers.prefix import common_prefix
from radixserve.memory.tiers.disk import DiskTier
from radixserve.memory.tiers.legacy import LegacyPromptCache
from radixserve.memory.tiers.radix import RadixPromptCache
from radixserve.memory.layout import FULL, MemoryLayout
from radixserve.memory.seq_kv import SlotKV
from radixserve.memory.pool.draft import attach_draft
from radixserve.memory.pool.pool import KVPool, OutOfCells
from radixserve.memory.pool.state import fingerprint_of
from radixserve.memory.pool.swa import SWAPool
from radixserve.model.forward import Transformer
from tests.conftest import make_pool, make_transformer

KV_DIR = os.path.dirname(os.path.abspath(pool_module.__file__)) + os.sep
SLOT_KV = os.path.abspath(slot_kv_module.__file__)
HERE = os.path.abspath(__file__)
MUTATORS = ("alloc", "seq_rm", "seq_cp", "seq_keep", "seq_add", "clear")
N_SEQ = 3
BLOCK = 4  # disk tier tokens a block


class RogueWrite(AssertionError):
    """Something other than SlotKV wrote a slot's sequence."""


# ----- the instrumented pool ---------------------------------------------------------------
def _writer() -> str:
    """The file of the nearest caller outside kv/ and outside this module's guard."""
    f = sys._getframe(2)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if not path.startswith(KV_DIR) and not (path == HERE and f.f_code.co_name == "guarded"):
            return path
        f = f.f_back
    return "?"


class Guard:
    """Patches the pool's (and its sliding part's) sequence operations on the instances."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.violations: list[str] = []
        parts = [pool] + ([pool.swa] if isinstance(pool, SWAPool) else [])
        for part in parts:
            for name in MUTATORS:
                setattr(part, name, self._wrap(name, getattr(part, name)))

    def _wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any, **kw: Any) -> Any:
            who = _writer()
            if who != SLOT_KV:
                self.violations.append(f"{name}{args} from {who}")
                raise RogueWrite(f"pool.{name} called from {who}, not from SlotKV")
            return real(*args, **kw)

        return guarded

    def snapshot(self) -> list[Any]:
        p = self.pool
        tensors = [p.k, p.v]
        if isinstance(p, SWAPool):
            tensors += [p.swa.k, p.swa.v]
        if p.draft is not None:
            tensors += [p.draft.k, p.draft.v]
        maps = [(p.seq_positions(s), p.seq_cells(s)) for s in range(p.n_seq)]
        if isinstance(p, SWAPool):
            maps += [(p.swa.seq_positions(s), p.swa.seq_cells(s)) for s in range(p.n_seq)]
        return [[t.clone() for t in tensors], maps, p.n_free]

    def same(self, before: list[Any], what: str) -> None:
        now = self.snapshot()
        ok = (all(torch.equal(a, b) for a, b in zip(before[0], now[0]))
              and before[1:] == now[1:])
        if not ok:
            self.violations.append(f"{what} changed the pool")
            raise RogueWrite(f"{what} changed the pool")


def watch_cache(cache: PromptCache, guard: Guard) -> None:
    """Every call a slot makes into the cache (and the restore it hands over) leaves the pool
    exactly as it was: only SlotKV writes it."""

    def pure(name: str) -> None:
        real = getattr(cache, name)

        def call(*args: Any, **kw: Any) -> Any:
            before = guard.snapshot()
            out = real(*args, **kw)
            guard.same(before, f"cache.{name}")
            if name == "load" and out is not None:
                out = watched_restore(out, guard)
            return out

        setattr(cache, name, call)

    for name in ("save", "match", "load"):
        pure(name)


def watched_restore(got: Restore, guard: Guard) -> Restore:
    def segments(inner: Iterable[Segment]) -> Iterator[Segment]:
        it = iter(inner)
        while True:
            before = guard.snapshot()
            try:
                seg = next(it)
            except StopIteration:
                guard.same(before, "the restore's segments")
                return
            except Exception:
                guard.same(before, "the restore's segments")
                raise
            guard.same(before, "the restore's segments")
            yield seg

    real_done = got.on_done

    def on_done(error: BaseException | None) -> None:
        before = guard.snapshot()
        if real_done is not None:
            real_done(error)
        guard.same(before, "the restore's done")

    got.segments = segments(got.segments)
    got.on_done = on_done
    return got


# ----- rows as a function of the token prefix ------------------------------------------------
MOD = 16_777_213


def prefix_hashes(tokens: list[int]) -> list[int]:
    out, h = [], 7
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % MOD
        out.append(h)
    return out


def rows_of(tokens: list[int], shape: tuple[int, int, int], salt: float,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V [n_layer, n_head_kv, len(tokens), head_dim]: exact small integers in any float."""
    n_layer, n_head, head_dim = shape
    h = torch.tensor(prefix_hashes(tokens), dtype=torch.float64) % 997
    offs = torch.arange(n_layer * n_head * head_dim, dtype=torch.float64).view(
        n_layer, n_head, 1, head_dim)
    k = (h.view(1, 1, -1, 1) + offs * 3 + salt) % 1009
    return k.to(dtype), (-k - 1).to(dtype)


def global_rows(pool: KVPool, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return rows_of(tokens, (pool.n_layer, pool.n_head_kv, pool.head_dim), 0.0, pool.dtype)


def sliding_rows(pool: SWAPool, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    s = pool.swa
    return rows_of(tokens, (s.n_layer, s.n_head_kv, s.head_dim), 500.0, s.dtype)


def draft_rows(pool: KVPool, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    d = pool.draft
    assert d is not None
    return rows_of(tokens, (d.n_layer, d.n_head_kv, d.head_dim), 250.0, d.dtype)


def compute(kv: SlotKV, prompt: list[int], salt: str) -> None:
    """What a prompt's forward does to a slot: keep the usable common prefix, reserve cells for
    the rest, the "model" writes their rows (every part), commit, prune the window."""
    if kv.salt != salt or not kv.reusable:
        kv.drop()
    n_lcp = min(common_prefix(kv.tokens, prompt), len(prompt) - 1)
    n, ck = kv.usable_prefix(n_lcp)
    assert kv.keep_prefix(n, ck)
    kv.claim(PromptKey(salt, []))
    pool, seq = kv.pool, kv.seq
    try:
        cells = kv.reserve(n, len(prompt) - n)
    except OutOfCells:
        return  # nothing taken: the slot holds its prefix
    positions = list(range(n, len(prompt)))
    k, v = global_rows(pool, prompt)
    pool.k[:, :, cells] = k[:, :, n:]
    pool.v[:, :, cells] = v[:, :, n:]
    if isinstance(pool, SWAPool):
        sc = pool.swa.cells_at(seq, positions)
        sk, sv = sliding_rows(pool, prompt)
        pool.swa.k[:, :, sc] = sk[:, :, n:]
        pool.swa.v[:, :, sc] = sv[:, :, n:]
    if pool.draft is not None:
        dk, dv = draft_rows(pool, prompt)
        pool.draft.k[:, :, cells] = dk[:, :, n:]
        pool.draft.v[:, :, cells] = dv[:, :, n:]
    kv.commit(n, prompt[n:])
    kv.n_draft = len(kv)  # the draft model ran over the same tokens
    kv.prune()


def check_rows(kv: SlotKV) -> None:
    """The slot's cells hold exactly the rows of its tokens (every part it holds)."""
    pool, seq, tokens = kv.pool, kv.seq, list(kv.tokens)
    if not tokens:
        assert pool.seq_len(seq) == 0
        return
    cells = pool.cells_at(seq, list(range(len(tokens))))
    k, v = global_rows(pool, tokens)
    assert torch.equal(pool.k[:, :, cells], k) and torch.equal(pool.v[:, :, cells], v), \
        f"slot {seq}: rows are not those of its tokens"
    if isinstance(pool, SWAPool):
        pos = pool.swa.seq_positions(seq)
        sk, sv = sliding_rows(pool, tokens)
        sc = pool.swa.cells_at(seq, pos)
        assert torch.equal(pool.swa.k[:, :, sc], sk[:, :, pos])
        assert torch.equal(pool.swa.v[:, :, sc], sv[:, :, pos])
    if pool.draft is not None and kv.n_draft:
        n = min(kv.n_draft, len(tokens))
        dk, dv = draft_rows(pool, tokens)
        assert torch.equal(pool.draft.k[:, :, cells[:n]], dk[:, :, :n])
        assert torch.equal(pool.draft.v[:, :, cells[:n]], dv[:, :, :n])


def check_all(kvs: list[SlotKV], cache: PromptCache, guard: Guard) -> None:
    assert not guard.violations, guard.violations
    pool = guard.pool
    for kv in kvs:
        kv.check()
        check_rows(kv)
    pool.check()
    parts = [pool] + ([pool.swa] if isinstance(pool, SWAPool) else [])
    for part in parts:  # free + held == size (caches pin no cells)
        held = {c for s in range(part.n_seq) for c in part.seq_cells(s)}
        assert part.n_free + len(held) == part.n_cells
    cache.check()
    if isinstance(cache, RadixPromptCache):
        t = cache.tree
        assert t.bytes == sum(n.nbytes for n in t.nodes()), "radix byte counter"
        assert all(n.lock_ref == 0 for n in t.nodes()), "a restore left a lock"


# ----- the machine under test ---------------------------------------------------------------
@pytest.fixture(scope="module")
def swa_tr(tiny_swa_path: str) -> Transformer:
    return make_transformer(tiny_swa_path)


def new_pool(kind: str, tr: Transformer, swa_tr: Transformer) -> KVPool:
    if kind == "unified":
        return make_pool(tr, n_cells=72, n_seq=N_SEQ)
    if kind == "partitioned":
        return make_pool(tr, n_cells=96, n_seq=N_SEQ, unified=False)
    if kind == "swa":
        return make_pool(swa_tr, n_cells=96, n_seq=N_SEQ)
    assert kind == "draft"
    pool = make_pool(tr, n_cells=96, n_seq=N_SEQ)
    attach_draft(pool, MemoryLayout(1, 8, (FULL,)), torch.float32, tr.rope.rotate, "tiny-draft")
    return pool


def new_cache(backend: str, pool: KVPool, arch: str, disk_dir: str | None) -> PromptCache:
    if backend == "none":
        return NullPromptCache()
    if backend == "legacy":
        return LegacyPromptCache(0, pool.n_cells, fingerprint_of(pool, arch))
    disk = None
    if backend == "radix-disk":
        assert disk_dir is not None
        disk = DiskTier(disk_dir, 0, BLOCK, b"slot-kv-property", pool.row_layout())
    return RadixPromptCache(-1, disk=disk)


# prompts are cuts of three documents (two share a prefix) plus a short tail, so restores hit
DOCS = [[(7 * i + 3) % 11 + 4 for i in range(28)]]
DOCS += [DOCS[0][:12] + [(5 * i + 1) % 9 + 20 for i in range(16)], [30 + i % 7 for i in range(28)]]
prompts = st.builds(lambda d, cut, tail: (DOCS[d][:cut] + tail)[:28], st.integers(0, 2),
                    st.integers(1, 28), st.lists(st.integers(0, 3), max_size=3))
slot_ids = st.integers(0, N_SEQ - 1)
salts = st.sampled_from(["", "", "", "s"])
faults = st.one_of(st.none(), st.none(), st.integers(0, 20))  # armed before a cycle's restore
ops = st.lists(
    st.one_of(
        st.tuples(st.just("compute"), slot_ids, prompts, salts),
        st.tuples(st.just("save"), slot_ids),
        st.tuples(st.just("restore"), slot_ids, prompts, salts),
        st.tuples(st.just("cycle"), slot_ids, prompts, slot_ids, prompts, salts, faults),
        st.tuples(st.just("cycle"), slot_ids, prompts, slot_ids, prompts, salts, faults),
        st.tuples(st.just("drop"), slot_ids),
        st.tuples(st.just("fault"), st.integers(0, 20)),
        st.tuples(st.just("limit"), st.integers(0, 40)),
        st.tuples(st.just("forget")),
    ),
    min_size=1,
    max_size=20,
)


def restore(kv: SlotKV, cache: PromptCache, prompt: list[int], salt: str) -> None:
    """One restore, checked against what `match` predicted and what the cache counted."""
    if isinstance(cache, RadixPromptCache) and cache.disk is not None:
        ticket = cache.disk_lookup(PromptKey(salt, prompt), 0)  # the scheduler reads disk blocks first
        if ticket is not None:
            cache.disk.drain()
            cache.take_disk_loads()
            event("read from disk")
    want = cache.match(kv.pool, kv.seq, kv.offered(PromptKey(salt, prompt)), PromptKey(salt, prompt))
    before = (list(kv.tokens), kv.pool.seq_cells(kv.seq), kv.salt)
    s0 = cache.stats()
    fault = getattr(cache, "fault_after_tokens", None)
    ok = kv.restore_from(cache, PromptKey(salt, prompt))
    s1 = cache.stats()
    event("restored" if ok else "nothing better" if want == 0 else "failed")
    if ok:
        assert want > 0 and common_prefix(kv.tokens, prompt) == want
        assert kv.salt == salt and (s1["loads"], s1["fallbacks"]) == (s0["loads"] + 1,
                                                                     s0["fallbacks"])
        assert s1["hit_tokens"] == s0["hit_tokens"] + want
        assert fault is None or want < fault
        return
    assert s1["loads"] == s0["loads"]
    unchanged = (list(kv.tokens), kv.pool.seq_cells(kv.seq), kv.salt) == before
    if want == 0:  # nothing better: not even asked to write
        assert unchanged and s1 == s0
        return
    # failed: counted; untouched (legacy: its checks before writing), or emptied (part-way)
    assert s1["fallbacks"] == s0["fallbacks"] + 1
    assert unchanged or (len(kv) == 0 and kv.pool.seq_len(kv.seq) == 0)
    if isinstance(cache, RadixPromptCache):  # its checks are `match`'s: only part-way
        assert len(kv) == 0 and kv.pool.seq_len(kv.seq) == 0
        assert fault is not None and want >= fault  # nothing else fails here
    else:
        assert fault is None


def run_ops(kind: str, backend: str, tr: Transformer, swa_tr: Transformer,
            steps: list[tuple[Any, ...]]) -> None:
    pool = new_pool(kind, tr, swa_tr)
    arch = (swa_tr if kind == "swa" else tr).hp.arch
    with tempfile.TemporaryDirectory() as d:
        cache = new_cache(backend, pool, arch, d if backend == "radix-disk" else None)
        try:
            guard = Guard(pool)
            watch_cache(cache, guard)
            kvs = [SlotKV(pool, s) for s in range(N_SEQ)]
            for step in steps:
                op = step[0]
                if op == "cycle":  # one slot computes and saves, another restores
                    compute(kvs[step[1]], step[2], step[5])
                    if kvs[step[1]].save_to(cache):
                        cache.update()
                    check_all(kvs, cache, guard)
                    if step[6] is not None and isinstance(cache, RadixPromptCache):
                        cache.fault_after_tokens, cache.fault_restores_left = step[6], 1
                    restore(kvs[step[3]], cache, step[4], step[5])
                elif op == "compute":
                    compute(kvs[step[1]], step[2], step[3])
                elif op == "save":
                    if kvs[step[1]].save_to(cache):
                        cache.update()
                elif op == "restore":
                    restore(kvs[step[1]], cache, step[2], step[3])
                elif op == "drop":
                    kvs[step[1]].drop()
                elif op == "fault" and isinstance(cache, RadixPromptCache):
                    cache.fault_after_tokens, cache.fault_restores_left = step[1], 1
                elif op == "limit" and isinstance(cache, RadixPromptCache):
                    per_token = pool.bytes_per_cell + (
                        pool.swa.bytes_per_cell if isinstance(pool, SWAPool) else 0) + (
                        pool.draft.bytes_per_cell if pool.draft is not None else 0)
                    cache.limit_bytes = step[1] * per_token if step[1] else -1
                    cache.update()
                elif op == "limit" and isinstance(cache, LegacyPromptCache):
                    cache.limit_size = step[1] * (pool.bytes_per_cell + 64)
                    cache.update()
                elif op == "forget" and isinstance(cache, RadixPromptCache):
                    if cache.disk is not None:
                        cache.disk.drain()  # the writes through are on disk first
                    cache.tree.clear()  # RAM lost: a disk tier still has the blocks
                check_all(kvs, cache, guard)
        finally:
            if isinstance(cache, RadixPromptCache):
                cache.close()


@pytest.mark.parametrize("kind", ["unified", "partitioned", "swa", "draft"])
@pytest.mark.parametrize("backend", ["none", "legacy", "radix"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=ops)
def test_restores_through_slot_kv_only(tiny_tr: Transformer, swa_tr: Transformer, kind: str,
                                       backend: str, steps: list[tuple[Any, ...]]) -> None:
    run_ops(kind, backend, tiny_tr, swa_tr, steps)


@pytest.mark.parametrize("kind", ["unified", "swa", "draft"])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=ops)
def test_disk_backed_radix_restores_through_slot_kv_only(
        tiny_tr: Transformer, swa_tr: Transformer, kind: str,
        steps: list[tuple[Any, ...]]) -> None:
    run_ops(kind, "radix-disk", tiny_tr, swa_tr, steps)


# ----- the instrument itself -------------------------------------------------------------------
class RogueCache(RadixPromptCache):
    """Writes the pool itself (what the cache contract forbids)."""

    def load(self, pool: KVPool, seq: int, slot_tokens: list[int],
             key: PromptKey) -> Restore | None:
        got = super().load(pool, seq, slot_tokens, key)
        if got is not None:
            pool.seq_rm(seq)
        return got


def test_the_guard_catches_a_cache_that_writes_the_pool(tiny_tr: Transformer) -> None:
    pool = make_pool(tiny_tr, n_cells=64, n_seq=2)
    cache = RogueCache(-1)
    guard = Guard(pool)
    a, b = SlotKV(pool, 0), SlotKV(pool, 1)
    compute(a, [1, 2, 3, 4, 5], "")
    assert a.save_to(cache)
    with pytest.raises(RogueWrite, match="not from SlotKV"):
        b.restore_from(cache, PromptKey("", [1, 2, 3, 4, 5, 6]))
    assert guard.violations
    cache.tree.unlock(cache.tree.match([1, 2, 3, 4, 5]).path[-1])  # the aborted restore's lock


def test_a_fault_mid_restore_leaves_nothing_behind(tiny_tr: Transformer) -> None:
    """Radix: the cells written before the fault go, the slot is empty, the fallback counted,
    the lock released, and the next restore succeeds with the saved rows."""
    pool = make_pool(tiny_tr, n_cells=64, n_seq=2)
    cache = RadixPromptCache(-1, fault_after_tokens=3, fault_restores=1)
    guard = Guard(pool)
    watch_cache(cache, guard)
    a, b = SlotKV(pool, 0), SlotKV(pool, 1)
    compute(a, [1, 2, 3, 4, 5, 6], "")
    assert a.save_to(cache)
    compute(a, [1, 2, 3, 9, 9], "")
    assert a.save_to(cache)  # two segments: [1, 2, 3] and the rest
    compute(b, [7, 7], "")
    n_free = pool.n_free + 2
    assert not b.restore_from(cache, PromptKey("", [1, 2, 3, 4, 5, 6, 0]))
    assert len(b) == 0 and pool.seq_len(1) == 0 and pool.n_free == n_free
    assert cache.fallbacks == 1 and cache.loads == 0
    check_all([a, b], cache, guard)
    assert b.restore_from(cache, PromptKey("", [1, 2, 3, 4, 5, 6, 0]))
    assert list(b.tokens) == [1, 2, 3, 4, 5, 6] and b.saved_upto == 6 and b.n_draft == 6
    check_all([a, b], cache, guard)


def test_legacy_restore_is_take_and_delete_with_its_draft(tiny_tr: Transformer) -> None:
    """Legacy: the entry leaves the cache only once written; a draft part that does not load
    fails the whole restore (the slot emptied, counted) and the entry stays."""
    pool = make_pool(tiny_tr, n_cells=96, n_seq=2)
    attach_draft(pool, MemoryLayout(1, 8, (FULL,)), torch.float32, tiny_tr.rope.rotate,
                 "tiny-draft")
    cache = LegacyPromptCache(0, pool.n_cells, fingerprint_of(pool, tiny_tr.hp.arch))
    guard = Guard(pool)
    watch_cache(cache, guard)
    a, b = SlotKV(pool, 0), SlotKV(pool, 1)
    compute(a, list(range(10, 30)), "")
    assert a.save_to(cache) and len(cache.states) == 1
    compute(b, [5, 5, 5], "")
    assert b.restore_from(cache, PromptKey("", list(range(10, 30)) + [1]))
    assert list(b.tokens) == list(range(10, 30)) and not cache.states and b.saved_upto == 0
    assert cache.counters["loads"] == 1
    check_all([a, b], cache, guard)
    assert b.save_to(cache)
    e = cache.states[0]
    e.draft = e.draft.replace(b":draft", b":drafx", 1)
    compute(a, [5, 5, 5], "")
    assert not a.restore_from(cache, PromptKey("", list(range(10, 30)) + [1]))
    assert len(a) == 0 and pool.seq_len(0) == 0 and len(cache.states) == 1
    assert cache.stats()["fallbacks"] == 1
    check_all([a, b], cache, guard)
