"""Radix host cache: the tree alone, a naive model (hypothesis), and direct KV on a real model.

Row values are made to be a function of the token prefix (as real K/V is), so a restore can be
checked against what must be there, not only against what the cache says it holds.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.memory.key import PromptKey
from radixserve.memory.tiers import radix_tree
from radixserve.memory.tiers.base import PromptCache
from radixserve.memory.tiers.prefix import common_prefix as common_prefix_len
from radixserve.memory.tiers.radix import RadixPromptCache
from radixserve.memory.tiers.radix_tree import RadixNode, RadixTree
from radixserve.engine.batch import BatchSeq, forward
from radixserve.memory.pool.pool import KVPool
from radixserve.model.forward import Transformer
from tests.conftest import make_pool, restore

MOD = 16_777_213  # row values stay exact in f32


# ----- helpers ---------------------------------------------------------------------------
def prefix_hashes(tokens: list[int]) -> list[float]:
    """A stand-in for K/V: row i depends on tokens[:i+1] only."""
    out, h = [], 7
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % MOD
        out.append(float(h))
    return out


def rows(tokens: list[int], start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V rows [1, 1, n, 2] of tokens[start:] (column 0: prefix hash, column 1: position)."""
    hs = prefix_hashes(tokens)[start:]
    k = torch.tensor([[h, float(start + i)] for i, h in enumerate(hs)]).view(1, 1, -1, 2)
    return k, -k


def fake_pool(n_cells: int = 64, n_seq: int = 2, unified: bool = True, head_dim: int = 2) -> KVPool:
    """A real KVPool with one layer and one head; no model needed to fill it."""
    return KVPool(1, 1, head_dim, n_cells, n_seq, unified, torch.float32, lambda k, d: k)


def fill(pool: KVPool, seq: int, tokens: list[int]) -> None:
    pool.seq_rm(seq)
    k, v = rows(tokens)
    pool.write_rows(seq, list(range(len(tokens))), k, v)


def pool_rows(pool: KVPool, seq: int) -> torch.Tensor:
    return pool.k[0, 0, pool.seq_cells(seq), 0]


def ins(tree: RadixTree, tokens: list[int]) -> RadixNode:
    k, v = rows(tokens, tree.match(tokens).length)
    node = tree.insert(tokens, k, v)
    tree.check()
    return node


def stored_prompts(tree: RadixTree) -> set[tuple[int, ...]]:
    out: set[tuple[int, ...]] = set()
    stack: list[tuple[RadixNode, tuple[int, ...]]] = [(tree.root, ())]
    while stack:
        node, path = stack.pop()
        path = path + tuple(node.tokens)
        if node.terminal:
            out.add(path)
        stack.extend((c, path) for c in node.children.values())
    return out


def snapshot(tree: RadixTree) -> tuple:
    """Everything but LRU stamps: structure, flags, locks, row bytes, counters."""

    def walk(node: RadixNode) -> tuple:
        kids = tuple(walk(node.children[t]) for t in sorted(node.children))
        return (
            tuple(node.tokens),
            node.terminal,
            node.lock_ref,
            node.depth,
            bytes(node.k.numpy().tobytes()),
            bytes(node.v.numpy().tobytes()),
            kids,
        )

    counters = (tree.bytes, tree.n_nodes, tree.n_terminal, tree.unique_tokens, tree.logical_tokens)
    return walk(tree.root), counters


def match_rows(tree: RadixTree, tokens: list[int]) -> list[float]:
    return [x for _, k, _ in tree.match(tokens).segments() for x in k[0, 0, :, 0].tolist()]


BPT = 2 * 2 * 4  # bytes per token in the fake pool: K and V, head_dim 2, f32


# ----- the tree --------------------------------------------------------------------------
def test_insert_and_longest_match_without_splitting() -> None:
    tree = RadixTree()
    ins(tree, [1, 2, 3, 4])
    assert tree.match([1, 2, 3, 4, 5]).length == 4
    assert tree.match([1, 2, 9]).length == 2  # ends inside the edge: read-only, no split
    assert tree.match([9, 1]).length == 0 and tree.match([]).length == 0
    assert tree.n_nodes == 1 and tree.bytes == 4 * BPT
    assert match_rows(tree, [1, 2, 9]) == prefix_hashes([1, 2])


def test_branch_splits_edge_and_stores_shared_prefix_once() -> None:
    tree = RadixTree()
    ins(tree, [1, 2, 3, 4])
    ins(tree, [1, 2, 7, 8, 9])
    assert tree.n_nodes == 3 and tree.n_terminal == 2
    assert [n.tokens for n in tree.match([1, 2, 7]).path] == [[1, 2], [7, 8, 9]]
    assert tree.unique_tokens == 7 and tree.logical_tokens == 9 and tree.bytes == 7 * BPT
    for p in ([1, 2, 3, 4], [1, 2, 7, 8, 9]):
        assert match_rows(tree, p) == prefix_hashes(p)
    assert stored_prompts(tree) == {(1, 2, 3, 4), (1, 2, 7, 8, 9)}


def test_prefix_of_stored_prompt_splits_and_becomes_terminal() -> None:
    tree = RadixTree()
    ins(tree, [1, 2, 3, 4])
    ins(tree, [1, 2])
    assert tree.n_nodes == 2 and tree.unique_tokens == 4 and tree.logical_tokens == 6
    ins(tree, [1, 2, 3, 4])  # already there: nothing new
    assert tree.n_nodes == 2 and tree.bytes == 4 * BPT
    assert match_rows(tree, [1, 2, 3, 4]) == prefix_hashes([1, 2, 3, 4])


def test_insert_rejects_rows_of_the_wrong_length() -> None:
    tree = RadixTree()
    ins(tree, [1, 2])
    with pytest.raises(ValueError):
        tree.insert([1, 2, 3], *rows([1, 2, 3], 0))
    tree.check()


def test_lru_evicts_least_recently_used_leaf_first() -> None:
    tree = RadixTree()
    a, b, c = ins(tree, [1, 1]), ins(tree, [2, 2]), ins(tree, [3, 3])
    tree.touch(tree.match([1, 1]).path[-1])  # a is now the newest
    order = []
    for limit in (4 * BPT, 2 * BPT, 0):
        assert tree.evict(limit) == (1, 2)
        tree.check()
        order.append(next(n for n in (a, b, c) if n.evicted and n not in order))
    assert order == [b, c, a] and tree.bytes == 0 and tree.n_nodes == 0


def test_shared_inner_node_survives_leaf_eviction_then_becomes_a_leaf() -> None:
    tree = RadixTree()
    ins(tree, [1, 2, 3, 4])
    ins(tree, [1, 2, 5, 6])
    assert tree.evict(4 * BPT) == (1, 2)  # [3, 4] was older
    tree.check()
    assert tree.match([1, 2, 3]).length == 2 and tree.match([1, 2, 5, 6]).length == 4
    assert tree.evict(2 * BPT) == (1, 2)
    tree.check()
    assert stored_prompts(tree) == {(1, 2)}  # the childless prefix is a stored prompt now
    assert tree.logical_tokens == 2 and tree.n_terminal == 1
    assert match_rows(tree, [1, 2, 9]) == prefix_hashes([1, 2])


def test_locked_path_survives_eviction() -> None:
    tree = RadixTree()
    ins(tree, [1, 2, 3])
    ins(tree, [1, 2, 4])
    ins(tree, [5])
    end = tree.match([1, 2, 3]).path[-1]
    tree.lock(end)
    tree.check()
    tree.evict(0)
    tree.check()
    assert stored_prompts(tree) == {(1, 2, 3)} and tree.bytes == 3 * BPT
    tree.unlock(end)
    tree.check()
    assert tree.evict(0) == (2, 3) and tree.bytes == 0 and tree.root.children == {}
    tree.check()


def test_split_inherits_locks() -> None:
    tree = RadixTree()
    end = ins(tree, [1, 2, 3, 4])
    tree.lock(end)
    ins(tree, [1, 2, 9])  # splits the locked edge
    assert tree.match([1, 2]).path[0].lock_ref == 1
    tree.evict(0)
    assert stored_prompts(tree) == {(1, 2, 3, 4)}
    tree.unlock(end)
    tree.check()


def test_lazy_heap_stays_bounded_under_repeated_touches() -> None:
    tree = RadixTree()
    for i in range(5):
        ins(tree, [i, i])
    end = tree.match([3, 3]).path[-1]
    for _ in range(1000):
        tree.touch(end)
        tree.lock(end)
        tree.unlock(end)  # re-pushes with the same stamp
    tree.check()
    assert len(tree._heap) <= 2 * tree.n_nodes + 65


def test_failed_split_leaves_tree_exactly_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    tree = RadixTree()
    ins(tree, [1, 2, 3, 4])
    ins(tree, [1, 2, 3, 9])
    before = snapshot(tree)
    real, calls = radix_tree.own_rows, []

    def fail_on_third_copy(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("injected")
        return real(t)

    monkeypatch.setattr(radix_tree, "own_rows", fail_on_third_copy)
    with pytest.raises(MemoryError):
        tree.insert([1, 5], *rows([1, 5], 1))
    assert len(calls) == 3
    tree.check()
    assert snapshot(tree) == before


# ----- the cache on a fake pool ----------------------------------------------------------
def test_save_copies_only_new_rows_and_never_touches_the_pool() -> None:
    pool = fake_pool()
    cache = RadixPromptCache(-1)
    fill(pool, 0, [1, 2, 3, 4])
    assert cache.save(pool, 0, PromptKey("", [1, 2, 3, 4]))
    fill(pool, 0, [1, 2, 3, 7, 8])
    k0, v0, cells0 = pool.k.clone(), pool.v.clone(), pool.seq_cells(0)
    assert cache.save(pool, 0, PromptKey("", [1, 2, 3, 7, 8]))
    assert torch.equal(pool.k, k0) and torch.equal(pool.v, v0) and pool.seq_cells(0) == cells0
    cache.check()
    pool.check()
    assert cache.tree.bytes == 6 * BPT and cache.saves == 2
    assert not cache.save(pool, 0, PromptKey("", []))


def test_save_rejects_tokens_without_kv() -> None:
    pool = fake_pool()
    cache = RadixPromptCache(-1)
    fill(pool, 0, [1, 2])
    with pytest.raises(ValueError):
        cache.save(pool, 0, PromptKey("", [1, 2, 3]))
    cache.check()


def test_failed_copy_out_leaves_cache_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:

    pool = fake_pool()
    cache = RadixPromptCache(-1)
    fill(pool, 0, [1, 2, 3])
    cache.save(pool, 0, PromptKey("", [1, 2, 3]))
    before = snapshot(cache.tree)

    def fail(seq: int, p0: int, p1: int) -> list[torch.Tensor]:
        raise MemoryError("injected")

    monkeypatch.setattr(pool, "rows_out", fail)
    fill(pool, 0, [1, 2, 5, 6])
    assert not cache.save(pool, 0, PromptKey("", [1, 2, 5, 6]))
    assert snapshot(cache.tree) == before and cache.saves == 1
    cache.check()
    monkeypatch.undo()
    assert cache.save(pool, 0, PromptKey("", [1, 2, 5, 6]))  # still usable
    cache.check()


def test_repeated_hits_do_not_consume_the_match() -> None:
    pool = fake_pool(n_seq=3)
    cache = RadixPromptCache(-1)
    fill(pool, 0, [1, 2, 3, 4, 5])
    cache.save(pool, 0, PromptKey("", [1, 2, 3, 4, 5]))
    before = snapshot(cache.tree)
    for seq in (1, 2, 1):
        assert restore(cache, pool, seq, [], [1, 2, 3, 4, 9]) == [1, 2, 3, 4]
        assert pool_rows(pool, seq).tolist() == prefix_hashes([1, 2, 3, 4])
        assert pool.seq_positions(seq) == [0, 1, 2, 3]
        cache.check()
        pool.check()
    assert snapshot(cache.tree) == before
    assert cache.loads == 3 and cache.hit_tokens == 12


def test_load_only_when_better_than_slot_and_long_enough() -> None:
    pool = fake_pool()
    cache = RadixPromptCache(-1, min_restore_tokens=3)
    fill(pool, 0, [1, 2, 3, 4])
    cache.save(pool, 0, PromptKey("", [1, 2, 3, 4]))
    fill(pool, 1, [1, 2, 3, 4])
    cells = pool.seq_cells(1)
    assert restore(cache, pool, 1, [1, 2, 3, 4], [1, 2, 3, 4, 5]) is None  # slot already has it
    assert restore(cache, pool, 1, [1, 2, 3, 4], [1, 2]) is None  # below min_restore_tokens
    assert restore(cache, pool, 1, [1, 2, 3, 4], [7]) is None  # no match
    assert pool.seq_cells(1) == cells and cache.loads == 0
    assert restore(cache, pool, 1, [1, 2, 8], [1, 2, 3, 4, 5]) == [1, 2, 3, 4]
    cache.check()


def test_byte_limit_evicts_on_save() -> None:
    pool = fake_pool()
    cache = RadixPromptCache(limit_bytes=8 * BPT)
    for p in ([1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]):
        fill(pool, 0, p)
        assert cache.save(pool, 0, PromptKey("", p))
        cache.check()
    assert stored_prompts(cache.tree) == {(2, 2, 2, 2), (3, 3, 3, 3)}
    assert cache.evictions == 1 and cache.evicted_tokens == 4
    fill(pool, 0, list(range(10, 19)))
    assert not cache.save(pool, 0, PromptKey("", list(range(10, 19))))  # alone bigger than the limit
    cache.check()


def test_pins_survive_eviction_lapse_on_time_and_fit_their_budget() -> None:
    pool = fake_pool()
    cache = RadixPromptCache(limit_bytes=8 * BPT, pin_limit_bytes=6 * BPT)
    t0 = time.monotonic()  # saves expire pins against the clock: pins are made from now

    def save(p: list[int]) -> None:
        fill(pool, 0, p)
        assert cache.save(pool, 0, PromptKey("", p))
        cache.check()

    save([1, 1, 1, 1])
    assert cache.pin(PromptKey("", [1, 1, 1, 1]), 100.0, now=t0)
    assert not cache.pin(PromptKey("", [1, 1, 1, 1, 5]), 100.0, now=t0)  # not stored whole: no pin
    assert not cache.pin(PromptKey("other salt", [1, 1, 1, 1]), 100.0, now=t0)
    for p in ([2, 2, 2, 2], [3, 3, 3, 3], [4, 4, 4, 4]):  # LRU would evict [1]*4 first
        save(p)
    assert (1, 1, 1, 1) in stored_prompts(cache.tree) and cache.evictions == 2
    st = cache.stats()
    assert (st["pins"], st["pinned_bytes"]) == (1, 4 * BPT)
    # a second pin over the budget (4 + 4 > 6 tokens' bytes): the oldest lapses
    assert cache.pin(PromptKey("", [4, 4, 4, 4]), 100.0, now=t0 + 1)
    assert [p.end.tokens for p in cache.pins] == [[4, 4, 4, 4]] and cache.pins_lapsed == 1
    cache.check()
    # a pin past its time is released at the next update: then LRU applies again
    cache.expire_pins(now=t0 + 200)
    assert cache.stats()["pins"] == 0
    save([5, 5, 5, 5])
    save([6, 6, 6, 6])
    assert (4, 4, 4, 4) not in stored_prompts(cache.tree)
    # a prompt larger than the pin budget alone is not pinned; a flush drops pins with the rest
    save([7] * 7)
    assert not cache.pin(PromptKey("", [7] * 7), 100.0)
    save([8, 8])
    assert cache.pin(PromptKey("", [8, 8]), 100.0)
    cache.clear()
    assert cache.tree.bytes == 0 and not cache.pins
    cache.check()


def test_a_prefix_pin_keeps_exactly_that_prefix_through_eviction() -> None:
    """A pin whose key ends inside a stored edge splits the edge there: the prefix stays (its
    bytes are those tokens' rows, prorated as the split makes them), what follows it goes."""
    pool = fake_pool()
    cache = RadixPromptCache(limit_bytes=8 * BPT, pin_limit_bytes=6 * BPT)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    fill(pool, 0, prompt)
    assert cache.save(pool, 0, PromptKey("", prompt))
    assert cache.pin(PromptKey("", prompt[:4]), 100.0)
    assert [p.end.tokens for p in cache.pins] == [[1, 2, 3, 4]]
    assert cache.stats()["pinned_bytes"] == 4 * BPT
    cache.check()
    for p in ([8, 8, 8], [9, 9, 9]):  # 7 + 3 + 3 tokens > 8: the unpinned tail goes
        fill(pool, 0, p)
        assert cache.save(pool, 0, PromptKey("", p))
        cache.check()
    assert cache.tree.match(prompt).length == 4
    assert (1, 2, 3, 4) in stored_prompts(cache.tree)
    assert tuple(prompt) not in stored_prompts(cache.tree)
    assert match_rows(cache.tree, prompt) == prefix_hashes(prompt)[:4]


def test_a_pin_too_big_alone_changes_nothing() -> None:
    """A pin larger than the pin budget by itself is refused before anything changes: the
    other pins stay (none lapses for it) and the edge it ends inside is not split. One that
    fits exactly (its prefix's bytes, prorated) is taken, the older pins lapsing for it."""
    pool = fake_pool()
    cache = RadixPromptCache(limit_bytes=32 * BPT, pin_limit_bytes=6 * BPT)
    for p in ([1, 1, 1, 1], [2] * 8):
        fill(pool, 0, p)
        assert cache.save(pool, 0, PromptKey("", p))
    assert cache.pin(PromptKey("", [1, 1, 1, 1]), 100.0)
    before = snapshot(cache.tree)
    for n in (7, 8):  # inside the edge [2] * 8, and the whole of it: 7, 8 tokens > 6
        assert not cache.pin(PromptKey("", [2] * n), 100.0)
        assert snapshot(cache.tree) == before
        assert [p.end.tokens for p in cache.pins] == [[1, 1, 1, 1]] and cache.pins_lapsed == 0
        assert cache.stats()["pinned_bytes"] == 4 * BPT
        cache.check()
    assert cache.pin(PromptKey("", [2] * 6), 100.0)  # 6 tokens' bytes: the budget exactly
    assert [p.end.tokens for p in cache.pins] == [[2] * 6] and cache.pins_lapsed == 1
    assert cache.stats()["pinned_bytes"] == 6 * BPT
    cache.check()


def test_partitioned_pool_round_trip() -> None:
    pool = fake_pool(n_cells=16, n_seq=2, unified=False)
    cache = RadixPromptCache(-1)
    fill(pool, 0, [4, 5, 6])
    cache.save(pool, 0, PromptKey("", [4, 5, 6]))
    assert restore(cache, pool, 1, [], [4, 5, 6, 7]) == [4, 5, 6]
    assert pool_rows(pool, 1).tolist() == prefix_hashes([4, 5, 6])
    assert all(c >= 8 for c in pool.seq_cells(1))
    pool.check()


def test_not_enough_cells_skips_without_touching_the_slot() -> None:
    pool = fake_pool(n_cells=12)
    cache = RadixPromptCache(-1)
    fill(pool, 0, list(range(8)))
    cache.save(pool, 0, PromptKey("", list(range(8))))
    fill(pool, 1, [50, 51])  # 2 + 2 free < 8
    assert restore(cache, pool, 1, [50, 51], list(range(9))) is None
    assert pool_rows(pool, 1).tolist() == prefix_hashes([50, 51])
    assert cache.fallbacks == 0
    pool.check()


def test_out_of_cells_during_restore_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = fake_pool(n_cells=12)
    cache = RadixPromptCache(-1)
    for p in (list(range(8)), [0, 1, 2, 99]):  # two segments: [0, 1, 2] and [3..7]
        fill(pool, 0, p)
        cache.save(pool, 0, PromptKey("", p))
    pool.seq_rm(0)
    fill(pool, 0, [60] * 8)  # 4 cells left for seq 1
    before = snapshot(cache.tree)
    monkeypatch.setattr(cache, "can_restore", lambda pool, seq, n: True)  # skip the guard
    assert restore(cache, pool, 1, [], list(range(9))) == []  # 3 cells written, then OutOfCells
    assert pool.seq_len(1) == 0 and pool.n_free == 4 and cache.fallbacks == 1
    pool.check()
    cache.check()
    assert snapshot(cache.tree) == before


def test_bad_segment_falls_back() -> None:
    pool = fake_pool()
    cache = RadixPromptCache(-1)
    fill(pool, 0, [1, 2, 3])
    cache.save(pool, 0, PromptKey("", [1, 2, 3]))
    other = fake_pool(head_dim=4)  # rows of another shape
    assert restore(cache, other, 1, [], [1, 2, 3]) == []
    assert other.seq_len(1) == 0 and cache.fallbacks == 1
    other.check()
    cache.check()


def test_stats_and_log_line(caplog: pytest.LogCaptureFixture) -> None:
    pool = fake_pool()
    cache = RadixPromptCache(-1)
    proto: PromptCache = cache  # mypy checks the protocol
    assert proto.name == "radix"
    for p in ([1, 2, 3], [1, 2, 4, 5]):
        fill(pool, 0, p)
        cache.save(pool, 0, PromptKey("", p))
    restore(cache, pool, 1, [], [1, 2, 4, 6])
    s = cache.stats()
    assert all(isinstance(v, float) for v in s.values())
    assert s == {
        "nodes": 3.0,
        "terminal_nodes": 2.0,
        "bytes": 5.0 * BPT,
        "limit_bytes": 0.0,
        "limit_tokens": 0.0,
        "unique_tokens": 5.0,
        "logical_tokens": 7.0,
        "saves": 2.0,
        "loads": 1.0,
        "hit_tokens": 3.0,
        "skipped": 0.0,
        "evictions": 0.0,
        "evicted_tokens": 0.0,
        "fallbacks": 0.0,
        "pins": 0.0,
        "pinned_bytes": 0.0,
        "snapshots": 0.0,
        "snapshot_bytes": 0.0,
        "snapshots_dropped": 0.0,
    }
    with caplog.at_level(logging.INFO, logger="radixserve.memory.tiers.radix"):
        cache.log_stats()
    assert len(caplog.records) == 1 and "unique tokens 5, logical tokens 7" in caplog.text


def test_fault_hook_faults_only_the_first_restores() -> None:
    """The fault hook comes in through the constructor (no environment read at restore)."""
    pool = fake_pool()
    cache = RadixPromptCache(-1, fault_after_tokens=2, fault_restores=1)
    fill(pool, 0, [1, 2, 3, 4])
    cache.save(pool, 0, PromptKey("", [1, 2, 3, 4]))
    assert restore(cache, pool, 1, [], [1, 2, 3, 4, 5]) == [] and pool.seq_len(1) == 0
    assert restore(cache, pool, 1, [], [1, 2, 3, 4, 5]) == [1, 2, 3, 4]
    assert cache.stats()["fallbacks"] == 1 and cache.stats()["loads"] == 1
    cache.check()
    pool.check()


# ----- against a naive model -------------------------------------------------------------
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=10)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("save"), prompts),
        st.tuples(st.just("load"), prompts),
        st.tuples(st.just("limit"), st.integers(0, 30)),
    ),
    max_size=25,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_cache_agrees_with_naive_model(ops: list[tuple[str, object]]) -> None:
    """Saved prompts (a set) predict every match while nothing was evicted; after evictions a
    match never exceeds the model and the newest saved prompt survives if it fits."""
    pool = fake_pool(n_cells=32)
    cache = RadixPromptCache(-1)
    saved: set[tuple[int, ...]] = set()
    for op, arg in ops:
        if op == "save":
            assert isinstance(arg, list)
            fill(pool, 0, arg)
            if cache.save(pool, 0, PromptKey("", arg)):
                saved.add(tuple(arg))
                if cache.limit_bytes <= 0 or len(arg) * BPT <= cache.limit_bytes:
                    assert cache.tree.match(arg).length == len(arg)
        elif op == "load":
            assert isinstance(arg, list)
            model = max((common_prefix_len(arg, list(p)) for p in saved), default=0)
            stored = max(
                (common_prefix_len(arg, list(p)) for p in stored_prompts(cache.tree)), default=0
            )
            assert stored <= model
            if cache.evictions == 0:
                assert stored == model and stored_prompts(cache.tree) == saved
            before = pool.seq_cells(1)
            got = restore(cache, pool, 1, [], arg)
            if stored == 0:
                assert got is None and pool.seq_cells(1) == before
            else:
                assert got == arg[:stored] and pool.seq_positions(1) == list(range(stored))
                assert pool_rows(pool, 1).tolist() == prefix_hashes(arg[:stored])
        else:
            assert isinstance(arg, int)
            cache.limit_bytes = arg * BPT if arg else -1
            cache.update()
        cache.check()
        pool.check()
        assert all(any(p[: len(s)] == s for p in saved) for s in stored_prompts(cache.tree))


# ----- direct KV on the tiny model -------------------------------------------------------
P = [(7 * i + 3) % 50 + 5 for i in range(30)]
SPLITS = {1: [], 2: [12], 5: [5, 10, 15, 20]}


def build(
    tr: Transformer, n_segments: int, fault: int | None = None
) -> tuple[KVPool, RadixPromptCache]:
    """Slot 0 computes and saves P; branches computed in slot 2 then split P's edge so a match
    of P crosses `n_segments` nodes, all holding slot 0's original rows."""
    pool = make_pool(tr, n_cells=256, n_seq=3)
    cache = RadixPromptCache(-1, fault_after_tokens=fault)
    forward(tr, pool, [BatchSeq(0, P, 0, n_logits=0)])
    assert cache.save(pool, 0, PromptKey("", P))
    for s in SPLITS[n_segments]:
        branch = P[:s] + [(P[s] + 1 + j) % 60 for j in range(4)]
        pool.seq_rm(2)
        forward(tr, pool, [BatchSeq(2, branch, 0, n_logits=0)])
        assert cache.save(pool, 2, PromptKey("", branch))
        cache.check()
    pool.seq_rm(2)
    assert len(cache.tree.match(P).path) == n_segments
    # slot 1 holds something else first, so the restore must replace it
    forward(tr, pool, [BatchSeq(1, P[:3] + [1, 2], 0, n_logits=0)])
    return pool, cache


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("n_segments", [1, 2, 5])
def test_direct_restore_round_trip(tiny_tr: Transformer, n_segments: int) -> None:
    pool, cache = build(tiny_tr, n_segments)
    nxt = 17
    assert restore(cache, pool, 1, P[:3] + [1, 2], P + [nxt]) == P
    pool.check()
    cache.check()
    assert pool.seq_positions(1) == pool.seq_positions(0) == list(range(len(P)))
    a, b = pool.seq_cells(0), pool.seq_cells(1)
    for layer in range(pool.n_layer):
        for i in range(len(P)):  # per layer and per cell, bit for bit
            assert as_bytes(pool.k[layer, :, b[i]]) == as_bytes(pool.k[layer, :, a[i]])
            assert as_bytes(pool.v[layer, :, b[i]]) == as_bytes(pool.v[layer, :, a[i]])
    # Same K/V bytes, same single-token forward: the logits must be identical, not just close.
    la = forward(tiny_tr, pool, [BatchSeq(0, [nxt], len(P))])
    lb = forward(tiny_tr, pool, [BatchSeq(1, [nxt], len(P))])
    assert torch.equal(la, lb)
    assert cache.loads == 1 and cache.hit_tokens == len(P) and cache.fallbacks == 0


def test_fault_after_partial_restore_falls_back_and_tree_stays_usable(
    tiny_tr: Transformer, caplog: pytest.LogCaptureFixture
) -> None:
    pool, cache = build(tiny_tr, 2, fault=17)  # segments of 12 and 18: faults inside the second
    before = snapshot(cache.tree)
    n_free = pool.n_free + pool.seq_len(1)
    with caplog.at_level(logging.WARNING, logger="radixserve.memory.tiers.radix"):
        assert restore(cache, pool, 1, [], P + [3]) == []
    assert "after 17 restored tokens" in caplog.text
    assert pool.seq_len(1) == 0 and pool.n_free == n_free
    assert cache.fallbacks == 1 and cache.loads == 0
    pool.check()
    cache.check()
    assert snapshot(cache.tree) == before
    cache.fault_after_tokens = None
    assert restore(cache, pool, 1, [], P + [3]) == P
    assert torch.equal(pool.k[:, :, pool.seq_cells(1)], pool.k[:, :, pool.seq_cells(0)])
    pool.check()
    cache.check()


# ----- snapshots (a recurrent state kept on nodes: memory/pool/recurrent.py) ---------------

def test_snapshots_are_counted_split_with_their_node_and_dropped_when_superseded() -> None:
    """A snapshot sits on the node ending where its state was taken and counts in the tree's
    bytes; a split leaves it on the lower part (it still ends there); `drop_snapshots` takes
    only those of unlocked one-child nodes (a prompt went on past them), least recently used
    first, and only while over the limit; a leaf's goes with the leaf."""
    tree = RadixTree()
    a = [1, 2, 3, 4, 5, 6]
    end = tree.insert(a, *rows(a))
    base = tree.bytes
    tree.attach(tree.node_at(end, 6), b"x" * 100)
    tree.attach(tree.node_at(end, 3), b"y" * 50)  # splits the edge at 3
    mid = tree.node_at(end, 3)
    assert mid.depth == 3 and end.depth == 6 and mid.snapshot == b"y" * 50
    assert end.snapshot == b"x" * 100 and tree.bytes == base + 150
    tree.check()
    b = [1, 2, 3, 4, 5, 6, 7, 8]  # a longer prompt: the node at 6 is superseded
    leaf = tree.insert(b, *rows(b, 6))
    tree.attach(leaf, b"z" * 10)
    tree.touch(leaf)
    assert tree.drop_snapshots(tree.bytes) == 0  # within the limit: nothing goes
    assert tree.drop_snapshots(tree.bytes - 1) == 1  # the LRU one-child node's: depth 3
    assert not mid.snapshot and end.snapshot and leaf.snapshot
    assert tree.drop_snapshots(0) == 1 and not end.snapshot and leaf.snapshot
    tree.check()
    n_before = tree.bytes
    tree.evict(0)
    assert tree.bytes == 0 < n_before and not leaf.snapshot
    tree.check()
