"""The prefix planner: the slot's own prefix, --cache-reuse chunks shifted left and right, another
slot's cells, the host cache; and the KV owner holding exactly what each plan says."""

from __future__ import annotations

import torch

from radixserve.memory.key import PromptKey
from radixserve.memory.tiers.legacy import LegacyPromptCache
from radixserve.memory.tiers.radix import RadixPromptCache
from radixserve.memory.prefix_plan import (
    SHARE_MIN_TOKENS,
    Source,
    apply_plan,
    plan_prefix,
    take_prefix,
)
from radixserve.engine.slot import Slot
from radixserve.memory.seq_kv import SlotKV
from radixserve.memory.pool.pool import KVPool
from radixserve.memory.pool.state import fingerprint_of


def slots_with(*contents: list[int], n_cells: int = 256) -> list[Slot]:
    """Slots over one unified pool; slot i holds contents[i] (K row = the token id)."""
    pool = KVPool(1, 1, 2, n_cells, max(2, len(contents)), True, torch.float32, lambda k, d: k)
    slots = [Slot(SlotKV(pool, i), n_cells) for i in range(pool.n_seq)]
    for s, tokens in zip(slots, contents):
        k = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1).repeat(1, 1, 1, 2)
        s.kv.load_rows(list(tokens), k, -k)
    return slots


def held_rows(slot: Slot) -> dict[int, int]:
    """Position -> the token whose K row the pool holds there (K row = token id)."""
    pool, seq = slot.kv.pool, slot.kv.seq
    return {p: round(pool.k[0, 0, c, 0].item())
            for p, c in zip(pool.seq_positions(seq), pool.seq_cells(seq))}


def run(slot: Slot, prompt: list[int], n_reuse: int = 0, cache_prompt: bool = True,
        donors: list[Slot] | None = None, host=None):
    plan = take_prefix(slot, PromptKey("", prompt), donors or [], host, cache_prompt, n_reuse)
    slot.kv.check()
    slot.kv.pool.check()
    # the KV held is the KV of the prompt's tokens at those positions, not just the positions
    assert held_rows(slot) == {p: prompt[p] for p in held_rows(slot)}
    assert sum(p1 - p0 for p0, p1 in plan.todo) + slot.kv.n_held == len(prompt)
    return plan


A, B, X = list(range(100, 110)), list(range(200, 240)), list(range(300, 306))


def test_prefix_only_keeps_one_token_to_evaluate():
    (slot, _) = slots_with(A + B)
    plan = run(slot, A + B)
    assert plan.n_reused == len(A + B) - 1 and plan.todo == [(49, 50)]
    assert list(slot.kv.tokens) == (A + B)[:49] and slot.kv.pool.seq_positions(0) == list(range(49))


def test_cache_prompt_false_computes_everything():
    (slot, _) = slots_with(A + B)
    plan = run(slot, A + B, n_reuse=16, cache_prompt=False)
    assert plan.n_reused == 0 and plan.todo == [(0, 50)] and slot.kv.pool.seq_len(0) == 0


def test_removed_text_shifts_the_tail_left():
    (slot, _) = slots_with(A + X + B)
    pool = slot.kv.pool
    cells_b = pool.seq_cells(0)[16:]
    plan = run(slot, A + B, n_reuse=16)
    # B moves from [16, 56) to [10, 50); its last token is recomputed
    assert plan.todo == [(49, 50)] and plan.n_reused == 49
    assert pool.seq_positions(0) == list(range(49))
    assert pool.seq_cells(0)[10:] == cells_b[:-1]  # the same cells, shifted, not copies


def test_inserted_text_shifts_the_tail_right_and_leaves_a_hole():
    (slot, _) = slots_with(A + B + [7, 8])
    prompt = A + X + B + [9]
    plan = run(slot, prompt, n_reuse=16)
    assert plan.todo == [(10, 16), (56, 57)]  # the inserted text and the last token
    assert plan.n_reused == 10 + 40
    assert [s.source for s in plan.spans] == [Source.OWN, Source.COMPUTE, Source.OWN,
                                              Source.COMPUTE]
    assert list(slot.kv.tokens) == A  # the contiguous prefix only; B waits ahead of the hole
    assert slot.kv.n_held == 50
    assert slot.kv.pool.seq_positions(0) == list(range(10)) + list(range(16, 56))
    # filling the hole joins the chunk ahead: the slot then holds the contiguous prefix
    slot.kv.reserve(10, 6)
    slot.kv.commit(10, X)
    slot.kv.check()
    assert list(slot.kv.tokens) == (A + X + B)


def test_a_chunk_at_the_start_is_shifted_even_without_a_common_prefix():
    """No common prefix (no BOS, raw prompts): a chunk found later in the slot moves to
    position 0 (it must not be kept where it was and labelled with the prompt's tokens)."""
    (slot, _) = slots_with([9] + B[:20])
    plan = run(slot, B[:20] + [7], n_reuse=4)
    assert plan.n_reused == 20 and plan.todo == [(20, 21)]
    assert held_rows(slot) == {p: B[p] for p in range(20)}


def test_legacy_entry_past_the_common_prefix_feeds_cache_reuse():
    """A legacy entry is restored whole; --cache-reuse then shifts its chunks as for the
    slot's own KV (A + X + B cached, A + B asked: B is reused, not only A)."""
    a = list(range(100, 120))  # f_keep = 20 / 66 >= 0.25: the entry qualifies
    holder, slot = slots_with(a + X + B)
    pool = holder.kv.pool
    cache = LegacyPromptCache(0, 10_000, fingerprint_of(pool, "llama"))
    assert holder.kv.save_to(cache)
    holder.kv.drop()
    plan = run(slot, a + B + [1], n_reuse=16, host=cache)
    assert plan.n_reused == 60 and plan.todo == [(60, 61)]
    assert list(slot.kv.tokens) == a + B and len(cache.states) == 0  # consumed


def test_a_shift_without_room_falls_back_to_computing():
    """Shifting cells shared with another slot copies them; with no free cell the slot keeps
    its prefix and computes the rest (not left half-shifted)."""
    tokens = A + X + B
    pool = KVPool(1, 1, 2, len(tokens), 2, True, torch.float32, lambda k, d: k)
    slot, other = (Slot(SlotKV(pool, i), 64) for i in range(2))
    k = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1).repeat(1, 1, 1, 2)
    slot.kv.load_rows(tokens, k, -k)
    assert other.kv.share_from(slot.kv, len(tokens)) and pool.n_free == 0
    plan = run(slot, A + B + [1], n_reuse=16)
    assert plan.todo == [(10, 51)] and plan.n_reused == 10  # A kept, B's shift had no room
    other.kv.check()


def test_short_matches_are_not_reused():
    (slot, _) = slots_with(A + B[:10])
    plan = run(slot, A + X + B[:10], n_reuse=16)
    assert plan.todo == [(10, 26)] and slot.kv.pool.seq_positions(0) == list(range(10))


def test_another_slots_prefix_is_shared_when_it_is_clearly_longer():
    doc = list(range(500, 560))
    mine, donor = slots_with(doc[:30], doc)
    plan = run(mine, doc + [1, 2], donors=[mine, donor])
    assert plan.source is Source.SLOT and plan.donor is donor
    assert plan.n_reused == 60 and plan.todo == [(60, 62)]
    assert mine.kv.pool.seq_cells(0) == donor.kv.pool.seq_cells(1)  # shared cells, no copy
    donor.kv.check()
    # less than SHARE_MIN_TOKENS more than the slot's own: not worth it
    mine2, donor2 = slots_with(doc[: 60 - SHARE_MIN_TOKENS + 1], doc)
    plan = run(mine2, doc + [1, 2], donors=[mine2, donor2])
    assert plan.source is Source.OWN and plan.donor is None


def test_host_cache_wins_when_it_restores_more_and_failure_empties_the_slot():
    doc = list(range(600, 640))
    holder, slot = slots_with(doc, doc[:5])
    cache = RadixPromptCache(-1)
    assert holder.kv.save_to(cache)
    plan = run(slot, doc + [3], host=cache)
    assert plan.n_reused == 40 and cache.stats()["loads"] == 1
    assert list(slot.kv.tokens) == doc
    # a restore that fails leaves nothing behind, and the prompt is planned again without it
    faulty = RadixPromptCache(-1, fault_after_tokens=7)
    assert holder.kv.save_to(faulty)
    slot.kv.drop()
    plan = plan_prefix(slot, PromptKey("", doc + [3]), [], faulty, True, 0)
    assert plan.source is Source.HOST
    assert not apply_plan(slot.kv, plan, PromptKey("", doc + [3]), faulty)
    assert len(slot.kv) == 0 and slot.kv.pool.seq_len(1) == 0
    slot.kv.check()
    plan = run(slot, doc + [3], host=faulty, donors=[holder, slot])
    assert plan.source is Source.SLOT and plan.n_reused == 40 and faulty.fallbacks == 2
