"""A draft model's rows beside the target's in the same cells (memory/pool/draft.py), through the pool's
sequence operations, states and both host caches, and the n-gram drafters (engine/ngram.py)."""

from __future__ import annotations

import pytest
import torch

from radixserve.memory.key import PromptKey
from radixserve.memory.tiers.legacy import LegacyPromptCache
from radixserve.memory.tiers.radix import RadixPromptCache
from radixserve.engine.batch import BatchSeq, place
from radixserve.engine.ngram import NgramMod, ngram_simple_draft
from radixserve.memory.pool.draft import attach_draft
from radixserve.memory.pool.pool import KVPool
from radixserve.memory.pool.state import (StateError, draft_state_size, fingerprint_of,
                                  get_draft_state, parse_draft_state, set_draft_state)
from radixserve.model.forward import Transformer
from radixserve.model.arch import memory_layout
from radixserve.memory.pool.kv_types import resolve
from tests.conftest import make_pool, make_transformer, restore

A = list(range(1000, 1040))
B = list(range(2000, 2040))


@pytest.fixture(scope="module")
def draft_tr(tiny_paths: dict[str, str]) -> Transformer:
    """qwen3-shaped (another head count and head size than the tiny llama target)."""
    return make_transformer(tiny_paths["qwen3"])


def pool_with_draft(tr: Transformer, dtr: Transformer, draft_types: str = "", **kw) -> KVPool:
    """`draft_types`: the draft rows' cache type (-ctkd / -ctvd; "": the draft's dtype)."""
    pool = make_pool(tr, **kw)
    hp = dtr.hp
    attach_draft(pool, memory_layout(hp), dtr.dtype, dtr.rope.rotate, hp.arch,
                 resolve(draft_types, draft_types, dtr.dtype))
    return pool


def run(tr: Transformer, dtr: Transformer, pool: KVPool, batch: list[BatchSeq]) -> None:
    """Both models over the same new cells (what the scheduler does)."""
    steps = place(pool, batch)
    tr.hidden(pool.k, pool.v, steps, types=pool.types)
    dtr.hidden(pool.draft.k, pool.draft.v, steps, types=pool.draft.types)


def drows(pool: KVPool, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.tensor(pool.seq_cells(seq))
    return pool.draft.k[:, :, idx], pool.draft.v[:, :, idx]


def fresh(tr, dtr, tokens, pos0=0):
    pool = pool_with_draft(tr, dtr, n_cells=128, n_seq=1)
    run(tr, dtr, pool, [BatchSeq(0, tokens, pos0)])
    return drows(pool, 0)


@pytest.mark.parametrize("unified", [True, False])
def test_seq_cp_carries_the_draft_rows(tiny_tr, draft_tr, unified):
    pool = pool_with_draft(tiny_tr, draft_tr, n_cells=256, n_seq=2, unified=unified)
    run(tiny_tr, draft_tr, pool, [BatchSeq(0, A, 0)])
    pool.seq_cp(0, 1)
    pool.seq_rm(0)  # the copy (or the shared cells) outlives the source
    pool.check()
    want = fresh(tiny_tr, draft_tr, A)
    assert all(torch.equal(a, b) for a, b in zip(drows(pool, 1), want))


def test_seq_add_re_rotates_the_draft_keys(tiny_tr, draft_tr):
    pool = pool_with_draft(tiny_tr, draft_tr, n_cells=128, n_seq=1)
    run(tiny_tr, draft_tr, pool, [BatchSeq(0, A, 10)])
    pool.seq_add(0, 0, -1, -10)
    k, v = drows(pool, 0)
    k0, v0 = fresh(tiny_tr, draft_tr, A, 0)
    # keys re-rotated with the draft's RoPE (attention is relative: the rest within rounding)
    assert (k.float() - k0.float()).abs().max() < 1e-4
    assert (v.float() - v0.float()).abs().max() < 1e-4
    k10, _ = fresh(tiny_tr, draft_tr, A, 10)
    assert (k10.float() - k0.float()).abs().max() > 1e-2  # (unrotated ones would differ)


def test_draft_state_round_trip_and_refusals(tiny_tr, draft_tr, tiny_path):
    pool = pool_with_draft(tiny_tr, draft_tr, n_cells=256, n_seq=2)
    run(tiny_tr, draft_tr, pool, [BatchSeq(0, A, 0), BatchSeq(1, B, 0)])
    data = get_draft_state(pool, 0)
    assert len(data) == draft_state_size(pool, 0)
    before = drows(pool, 1)
    with pytest.raises(StateError):  # another sequence's length: does not fit
        run(tiny_tr, draft_tr, pool, [BatchSeq(1, [5], len(B))])
        set_draft_state(pool, 1, data)
    assert all(torch.equal(a, b[:, :, : len(B)]) for a, b in zip(before, drows(pool, 1)))
    pool.seq_rm(1, len(A))  # same positions now: seq 1's draft rows become seq 0's
    set_draft_state(pool, 1, data)
    assert all(torch.equal(a, b) for a, b in zip(drows(pool, 1), drows(pool, 0)))
    for bad in (data[:-3], data + b"x", data.replace(b":draft", b":drafx", 1)):
        with pytest.raises(StateError):
            parse_draft_state(pool, 1, bad)
    other = pool_with_draft(tiny_tr, tiny_tr, n_cells=256, n_seq=2)  # a draft of another shape
    run(tiny_tr, tiny_tr, other, [BatchSeq(0, A, 0)])
    with pytest.raises(StateError, match="another model"):
        set_draft_state(other, 0, data)


def test_quantized_draft_rows_round_trip_and_another_type_is_refused(tiny_tr, draft_tr):
    """-ctkd q8_0: the draft rows are stored as q8_0 blocks (written by the draft's forward,
    on torch's path in f32), a draft state carries those bytes back exactly, and a pool whose
    draft rows are of another type refuses it naming the cache type."""
    pool = pool_with_draft(tiny_tr, draft_tr, "q8_0", n_cells=128, n_seq=2)
    run(tiny_tr, draft_tr, pool, [BatchSeq(0, A, 0)])
    k, v = drows(pool, 0)
    assert k.dtype == torch.uint8 and k.shape[-1] == 128 // 32 * 34
    assert pool.draft.fp.dtype == "q8_0"
    # layer 0's keys (which no attention precedes) are the float draft's, quantized
    fk, _ = fresh(tiny_tr, draft_tr, A)
    assert torch.equal(k[0], pool.draft.types[0].quantize(fk[0]))
    data = get_draft_state(pool, 0)
    pool.seq_cp(0, 1)
    pool.draft.k[:, :, torch.tensor(pool.seq_cells(1))] = 0
    set_draft_state(pool, 1, data)
    assert all(torch.equal(a, b) for a, b in zip(drows(pool, 1), (k, v)))
    other = pool_with_draft(tiny_tr, draft_tr, "q4_0", n_cells=128, n_seq=1)
    run(tiny_tr, draft_tr, other, [BatchSeq(0, A, 0)])
    with pytest.raises(StateError, match="cache type .dtype: file 'q8_0' != model 'q4_0'"):
        set_draft_state(other, 0, data)


def test_legacy_entry_carries_and_counts_the_draft(tiny_tr, draft_tr):
    pool = pool_with_draft(tiny_tr, draft_tr, n_cells=256, n_seq=2)
    cache = LegacyPromptCache(0, 256, fingerprint_of(pool, tiny_tr.hp.arch))
    run(tiny_tr, draft_tr, pool, [BatchSeq(0, A, 0)])
    assert cache.save(pool, 0, PromptKey("", A))
    e = cache.states[0]
    assert e.draft and e.size == len(e.data) + len(e.draft) and cache.size() == e.size
    want = drows(pool, 0)
    assert restore(cache, pool, 1, [], A + [1]) == A
    assert all(torch.equal(a, b) for a, b in zip(drows(pool, 1), want))
    # a draft part that does not load: neither part is restored, the entry stays
    cache.save(pool, 1, PromptKey("", A))
    e = cache.states[0]
    e.draft = e.draft.replace(b":draft", b":drafx", 1)  # (same size: the counters hold)
    pool.seq_rm(0)
    assert restore(cache, pool, 0, [], A + [1]) == []
    assert pool.seq_len(0) == 0 and len(cache.states) == 1
    cache.check()


def test_radix_nodes_hold_draft_rows_through_splits(tiny_tr, draft_tr):
    pool = pool_with_draft(tiny_tr, draft_tr, n_cells=256, n_seq=2)
    cache = RadixPromptCache(0)
    run(tiny_tr, draft_tr, pool, [BatchSeq(0, A, 0)])
    assert cache.save(pool, 0, PromptKey("", A))
    per_token = pool.bytes_per_cell + pool.draft.bytes_per_cell
    assert cache.tree.bytes == len(A) * per_token
    branch = A[:20] + B[:10]
    pool.seq_rm(0)
    run(tiny_tr, draft_tr, pool, [BatchSeq(0, branch, 0)])
    assert cache.save(pool, 0, PromptKey("", branch))  # splits A's edge at 20
    assert cache.tree.bytes == (len(A) + 10) * per_token
    cache.check()
    want = fresh(tiny_tr, draft_tr, A)
    assert restore(cache, pool, 1, [], A + [7]) == A
    assert all(torch.equal(a, b) for a, b in zip(drows(pool, 1), want))
    # a tree whose nodes lack draft rows cannot serve a pool with a draft: a fallback
    bare = RadixPromptCache(0)
    plain = make_pool(tiny_tr, n_cells=256, n_seq=2)
    run_plain = place(plain, [BatchSeq(0, A, 0)])
    tiny_tr.hidden(plain.k, plain.v, run_plain)
    assert bare.save(plain, 0, PromptKey("", A))
    assert restore(bare, pool, 1, [], A + [7]) == [] and bare.fallbacks == 1
    assert pool.seq_len(1) == 0


def test_ngram_simple_drafts_what_followed_the_last_match():
    seq = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 50, 51, 1, 2]
    # the last size_n tokens with the sampled one: (1, 2, 3); after it came 4..
    assert ngram_simple_draft(seq, 3, size_n=3, size_m=5) == [4, 5, 6, 7, 8]
    assert ngram_simple_draft(seq[1:], 3, size_n=3, size_m=5) == []  # position 0: no match
    assert ngram_simple_draft(seq, 99, size_n=3, size_m=5) == []  # no match
    assert ngram_simple_draft(seq[:8], 3, size_n=3, size_m=5) == []  # too short to look


def test_ngram_mod_chains_lookups_and_resets_on_poor_acceptance():
    mod = NgramMod(n_match=2, n_min=2, n_max=4, n_seq=1, size=1 << 12)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    mod.begin(0, prompt)
    assert mod.draft(0, prompt + [5], 6, n_max=4) == [7, 8, 9, 10]
    assert mod.draft(0, prompt + [5], 6, n_max=2) == [7, 8]
    assert mod.draft(0, prompt, 99, n_max=4) == []  # unknown: shorter than n_min
    for _ in range(5):
        mod.draft(0, prompt + [5], 6, n_max=4)
        mod.accept(0, 0)
    assert mod.used == 0  # five poor steps in a row: the table went stale and was reset
