"""LegacyPromptCache: one test per server_prompt_cache rule, on real states of a tiny model."""

from __future__ import annotations

import pytest
import torch

from radixserve.memory.checkpoint import Checkpoint
from radixserve.memory.key import PromptKey
from radixserve.memory.tiers.base import STAT_NAMES
from radixserve.memory.tiers.legacy import LegacyPromptCache
from radixserve.engine.batch import BatchSeq, forward
from radixserve.memory.pool.state import fingerprint_of
from radixserve.model.forward import Transformer
from tests.conftest import make_pool, restore

T = list(range(4000, 4100))
U = list(range(6000, 6100))
W = list(range(8000, 8100))


@pytest.fixture
def env(tiny_tr: Transformer):
    pool = make_pool(tiny_tr, n_cells=512, n_seq=4)
    return tiny_tr, pool, fingerprint_of(pool, "llama")


def fill(tr: Transformer, pool, seq: int, tokens: list[int]) -> None:
    pool.seq_rm(seq)
    forward(tr, pool, [BatchSeq(seq, tokens, 0)])


def per_token(pool, fp) -> int:
    return pool.bytes_per_cell + 4


def cache_for(pool, fp, n_tokens_room: int | None, limit_tokens: int = 100000) -> LegacyPromptCache:
    limit = 0 if n_tokens_room is None else n_tokens_room * per_token(pool, fp) + 200
    return LegacyPromptCache(limit, limit_tokens, fp)


def test_dedupe_when_an_entry_already_covers_the_prompt(env):
    tr, pool, fp = env
    c = cache_for(pool, fp, None)
    fill(tr, pool, 0, T[:20])
    assert c.save(pool, 0, PromptKey("", T[:20]))
    fill(tr, pool, 1, T[:10])
    assert not c.save(pool, 1, PromptKey("", T[:10]))  # T[:10] is a prefix of a cached entry
    assert len(c.states) == 1
    c.check()


def test_entry_larger_than_the_limit_is_skipped_without_evicting(env):
    tr, pool, fp = env
    c = cache_for(pool, fp, 15)
    fill(tr, pool, 0, U[:5])
    assert c.save(pool, 0, PromptKey("", U[:5]))
    fill(tr, pool, 1, T[:20])
    assert not c.save(pool, 1, PromptKey("", T[:20]))
    assert [e.tokens for e in c.states] == [U[:5]] and c.counters["skipped"] == 1
    c.check()


def test_entries_covered_by_the_new_prompt_are_dropped(env):
    tr, pool, fp = env
    c = cache_for(pool, fp, None)
    fill(tr, pool, 0, T[:10])
    c.save(pool, 0, PromptKey("", T[:10]))
    fill(tr, pool, 0, T[:20])
    assert c.save(pool, 0, PromptKey("", T[:20]))
    assert [len(e.tokens) for e in c.states] == [20] and c.counters["evicted_obsolete"] == 1
    c.check()


def test_fifo_makes_room(env):
    tr, pool, fp = env
    c = cache_for(pool, fp, 45)
    for seq, toks in enumerate((T[:20], U[:20], W[:20])):
        fill(tr, pool, seq, toks)
        assert c.save(pool, seq, PromptKey("", toks))
        c.check()
    assert [e.tokens[0] for e in c.states] == [U[0], W[0]]  # the oldest went first
    assert c.counters["evicted_fifo"] == 1
    assert c.size() <= c.limit_size
    # the figures every backend reports, under the same names: evictions are pressure only
    fill(tr, pool, 0, W[:30])
    assert c.save(pool, 0, PromptKey("", W[:30]))  # W[:20] is obsolete now, and U[:20] has to go
    s = c.stats()
    assert list(s) == list(STAT_NAMES) and all(isinstance(v, float) for v in s.values())
    assert s["nodes"] == s["terminal_nodes"] == 1 and s["bytes"] == c.size()
    assert s["unique_tokens"] == s["logical_tokens"] == 30 and s["saves"] == 4
    assert c.counters["evicted_obsolete"] == 1
    assert s["evictions"] == 2 and s["evicted_tokens"] == 40


def test_memory_error_shrinks_limit_to_40_percent(env, monkeypatch):
    tr, pool, fp = env
    c = cache_for(pool, fp, None)
    for seq, toks in enumerate((T[:20], U[:20])):
        fill(tr, pool, seq, toks)
        c.save(pool, seq, PromptKey("", toks))
    size_before = c.size()

    def boom(*a, **k):
        raise MemoryError("injected")

    monkeypatch.setattr(c, "_read_state", boom)
    fill(tr, pool, 2, W[:20])
    assert not c.save(pool, 2, PromptKey("", W[:20]))
    assert c.limit_size == int(0.4 * size_before)
    assert c.size() <= c.limit_size and c.counters["alloc_failures"] == 1
    c.check()


def test_load_skips_entries_with_f_keep_below_quarter(env):
    tr, pool, fp = env
    c = cache_for(pool, fp, None)
    fill(tr, pool, 0, T[:100])
    c.save(pool, 0, PromptKey("", T[:100]))
    prompt = T[:20] + U[:10]  # lcp 20 -> f_keep = 0.2 for the 100-token entry
    assert restore(c, pool, 1, [], prompt) is None
    assert pool.seq_len(1) == 0 and len(c.states) == 1


def test_load_restores_the_entry_and_removes_it(env):
    tr, pool, fp = env
    c = cache_for(pool, fp, None)
    fill(tr, pool, 0, T[:30])
    cells = pool.seq_cells(0)
    k, v = pool.k[:, :, cells].clone(), pool.v[:, :, cells].clone()
    expect = forward(tr, pool, [BatchSeq(0, [U[0]], 30)])
    pool.seq_rm(0, 30)
    c.save(pool, 0, PromptKey("", T[:30]))
    pool.seq_rm(0)
    fill(tr, pool, 1, U[:8])
    got_tokens = restore(c, pool, 1, U[:8], T[:30] + W[:5])
    assert got_tokens == T[:30]
    assert len(c.states) == 0 and c.counters["loads"] == 1 and c.counters["hit_tokens"] == 30
    cells1 = pool.seq_cells(1)
    assert torch.equal(pool.k[:, :, cells1], k) and torch.equal(pool.v[:, :, cells1], v)
    assert torch.equal(forward(tr, pool, [BatchSeq(1, [U[0]], 30)]), expect)
    pool.check()
    c.check()


def test_load_needs_improvement_on_both_f_keep_and_f_sim(env):
    tr, pool, fp = env
    c = cache_for(pool, fp, None)
    prompt = T[:40]
    fill(tr, pool, 0, T[:30] + U[:70])  # lcp 30: f_keep 0.3, f_sim 0.75
    c.save(pool, 0, PromptKey("", T[:30] + U[:70]))
    fill(tr, pool, 1, T[:20] + W[:5])  # lcp 20: f_keep 0.8, f_sim 0.5
    c.save(pool, 1, PromptKey("", T[:20] + W[:5]))
    # slot holds T[:10] + U[:2]: f_keep 10/12 = 0.83, f_sim 0.25 -> nothing beats f_keep
    fill(tr, pool, 2, T[:10] + U[:2])
    assert restore(c, pool, 2, T[:10] + U[:2], prompt) is None
    # empty slot (f_keep -1): first entry wins, second does not dominate it (f_sim 0.5 < 0.75)
    got = restore(c, pool, 3, [], prompt)
    assert got == T[:30] + U[:70]
    c.check()


def test_update_enforces_bytes_then_soft_token_limit(env):
    tr, pool, fp = env
    c = cache_for(pool, fp, None, limit_tokens=50)  # no byte limit: tokens capped at 50
    for seq, toks in enumerate((T[:30], U[:30], W[:30])):
        fill(tr, pool, seq, toks)
        c.save(pool, seq, PromptKey("", toks))
    c.update()
    assert c.n_tokens() <= 50 and c.counters["evicted_tokens"] == 2
    # with a byte limit the token limit rises to what the bytes allow
    c2 = LegacyPromptCache(100 * per_token(pool, fp), 50, fp)
    for seq, toks in enumerate((T[:30], U[:30], W[:30])):
        fill(tr, pool, seq, toks)
        c2.save(pool, seq, PromptKey("", toks))
    c2.update()
    assert c2.n_tokens() == 90 and c2.size() <= c2.limit_size
    c2.check()


def test_bytes_counted_beside_the_entries_shrink_their_room(env):
    """What `beside` counts outside the cache (the slots' own checkpoints) comes off the byte
    limit: the entries that fit the whole limit are evicted, oldest first, to fit the rest,
    and `beside` sees the buffers the entries hold (none here: no checkpoints)."""
    tr, pool, fp = env
    c = LegacyPromptCache(100 * per_token(pool, fp), 100000, fp)
    for seq, toks in enumerate((T[:30], U[:30], W[:30])):
        fill(tr, pool, seq, toks)
        assert c.save(pool, seq, PromptKey("", toks))
    assert c.n_tokens() == 90
    seen = []
    c.beside = lambda held: seen.append(held) or 45 * per_token(pool, fp)
    c.update()
    assert [e.tokens for e in c.states] == [W[:30]] and seen[0] == {}
    assert c.size() <= c.limit_size - 45 * per_token(pool, fp)
    c.check()


def test_a_saved_entrys_checkpoints_are_counted_once(env):
    """The checkpoints an entry is saved with count in its size, not again as the slot's own
    (`beside`): 30 tokens held, then 20 tokens with a checkpoint of 30 tokens' bytes, fit a
    limit of 100 tokens without evicting the first entry."""
    tr, pool, fp = env
    c = LegacyPromptCache(100 * per_token(pool, fp), 100000, fp)
    fill(tr, pool, 0, T[:30])
    assert c.save(pool, 0, PromptKey("", T[:30]))
    ck = Checkpoint(20, 0, 19, b"x" * (30 * per_token(pool, fp) - 8))
    c.beside = lambda held: 0 if id(ck.target) in held else ck.size
    fill(tr, pool, 1, U[:20])
    assert c.save(pool, 1, PromptKey("", U[:20]), [ck])
    assert [e.tokens for e in c.states] == [T[:30], U[:20]]
    assert c.counters["evicted_fifo"] == 0
    c.check()
