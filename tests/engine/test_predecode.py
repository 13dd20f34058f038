"""Pre-decode plans: prefix reuse, and --cache-reuse chunks shifted left and right."""

from __future__ import annotations

import torch

from radixserve.kv.pool import KVPool
from radixserve.engine.predecode import pre_decode


def pool_with(tokens: list[int]) -> KVPool:
    pool = KVPool(1, 1, 2, 256, 1, True, torch.float32, lambda k, d: k)
    pool.alloc(0, list(range(len(tokens))))
    return pool


A, B, X = list(range(100, 110)), list(range(200, 240)), list(range(300, 306))


def test_prefix_only_keeps_one_token_to_evaluate():
    tokens = A + B
    pool = pool_with(tokens)
    plan = pre_decode(pool, 0, tokens, A + B, True, 0)
    assert plan.n_past == len(A + B) - 1 and plan.todo == [(49, 50)]
    assert tokens == (A + B)[:49] and pool.seq_positions(0) == list(range(49))


def test_cache_prompt_false_computes_everything():
    tokens = A + B
    pool = pool_with(tokens)
    plan = pre_decode(pool, 0, tokens, A + B, False, 16)
    assert plan.n_reused == 0 and plan.todo == [(0, 50)] and pool.seq_len(0) == 0


def test_removed_text_shifts_the_tail_left():
    tokens = A + X + B
    pool = pool_with(tokens)
    cells_b = pool.seq_cells(0)[16:]
    plan = pre_decode(pool, 0, tokens, A + B, True, 16)
    # B moves from [16, 56) to [10, 50); its last token is recomputed
    assert plan.todo == [(49, 50)] and plan.n_reused == 49
    assert pool.seq_positions(0) == list(range(49))
    assert pool.seq_cells(0)[10:] == cells_b[:-1]  # the same cells, shifted, not copies
    pool.check()


def test_inserted_text_shifts_the_tail_right_and_leaves_a_hole():
    tokens = A + B + [7, 8]
    pool = pool_with(tokens)
    prompt = A + X + B + [9]
    plan = pre_decode(pool, 0, tokens, prompt, True, 16)
    assert plan.todo == [(10, 16), (56, 57)]  # the inserted text and the last token
    assert plan.n_reused == 10 + 40
    assert tokens == A  # the contiguous prefix only
    assert pool.seq_positions(0) == list(range(10)) + list(range(16, 56))
    pool.check()


def test_short_matches_are_not_reused():
    tokens = A + B[:10]
    pool = pool_with(tokens)
    plan = pre_decode(pool, 0, tokens, A + X + B[:10], True, 16)
    assert plan.todo == [(10, 26)] and pool.seq_positions(0) == list(range(10))
