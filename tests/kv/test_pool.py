"""KVPool: llama.cpp's sequence operations, checked against real forwards and a naive model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.engine.batch import BatchSeq, forward
from radixserve.memory.pool.pool import KVPool, OutOfCells
from radixserve.model.forward import Transformer
from tests.conftest import make_pool

A = list(range(1000, 1040))
B = list(range(2000, 2040))


def fresh_logits(tr: Transformer, ids: list[int], pos0: int = 0) -> torch.Tensor:
    pool = make_pool(tr, n_cells=128, n_seq=1)
    return forward(tr, pool, [BatchSeq(0, ids, pos0, n_logits=len(ids))])


@pytest.mark.parametrize("unified", [True, False])
def test_seq_rm_then_recompute_equals_never_computed(tiny_tr: Transformer, unified: bool):
    pool = make_pool(tiny_tr, n_cells=256, n_seq=2, unified=unified)
    forward(tiny_tr, pool, [BatchSeq(1, A, 0)])
    pool.seq_rm(1, 20)
    pool.check()
    assert pool.seq_len(1) == 20 and pool.seq_pos_max(1) == 19
    got = forward(tiny_tr, pool, [BatchSeq(1, B[20:], 20, n_logits=20)])
    expect = fresh_logits(tiny_tr, A[:20] + B[20:])[20:]
    assert (got - expect).abs().max().item() < 1e-4


@pytest.mark.parametrize("delta", [7, -3])
def test_seq_add_equals_computing_at_new_positions(tiny_tr: Transformer, delta: int):
    pool = make_pool(tiny_tr, n_cells=128, n_seq=1)
    forward(tiny_tr, pool, [BatchSeq(0, A, 10)])
    pool.seq_add(0, 0, -1, delta)
    pool.check()
    assert pool.seq_positions(0) == list(range(10 + delta, 10 + delta + len(A)))
    got = forward(tiny_tr, pool, [BatchSeq(0, [77], 10 + delta + len(A))])
    expect = fresh_logits(tiny_tr, A + [77], 10 + delta)[-1:]
    assert (got - expect).abs().max().item() < 1e-4  # re-rotated K differs in the last bits


def test_seq_add_drops_negative_positions_and_rejects_clashes(tiny_tr: Transformer):
    pool = make_pool(tiny_tr, n_cells=128, n_seq=1)
    forward(tiny_tr, pool, [BatchSeq(0, A[:10], 0)])
    pool.seq_add(0, 0, -1, -3)
    assert pool.seq_positions(0) == list(range(7))
    with pytest.raises(ValueError):
        pool.seq_add(0, 5, -1, -2)  # 5,6 -> 3,4 which are taken
    pool.check()


@pytest.mark.parametrize("unified", [True, False])
def test_seq_cp_gives_independent_copy(tiny_tr: Transformer, unified: bool):
    pool = make_pool(tiny_tr, n_cells=256, n_seq=2, unified=unified)
    forward(tiny_tr, pool, [BatchSeq(0, A[:30], 0)])
    pool.seq_cp(0, 1)
    pool.check()
    # unified shares cells (no K/V copy); partitioned copies into seq 1's range
    assert pool.n_cells - pool.n_free == (30 if unified else 60)
    pool.seq_rm(0, 15)  # seq 0 diverges; seq 1 must not notice
    got0 = forward(tiny_tr, pool, [BatchSeq(0, B[15:30], 15, n_logits=15)])
    got1 = forward(tiny_tr, pool, [BatchSeq(1, A[30:], 30, n_logits=10)])
    pool.check()
    assert (got0 - fresh_logits(tiny_tr, A[:15] + B[15:30])[15:]).abs().max() < 1e-4
    assert (got1 - fresh_logits(tiny_tr, A)[30:]).abs().max() < 1e-4
    pool.seq_rm(0)
    pool.seq_rm(1)
    pool.check()
    assert pool.n_free == pool.n_cells


def test_seq_add_on_shared_cells_copies_first(tiny_tr: Transformer):
    pool = make_pool(tiny_tr, n_cells=128, n_seq=2)
    forward(tiny_tr, pool, [BatchSeq(0, A[:10], 0)])
    pool.seq_cp(0, 1)
    k_before = pool.k[:, :, pool.view(0).cells].clone()
    pool.seq_add(1, 0, -1, 4)
    pool.check()
    assert pool.seq_positions(0) == list(range(10)) and pool.seq_positions(1) == list(range(4, 14))
    assert torch.equal(pool.k[:, :, pool.view(0).cells], k_before)


def test_seq_keep(tiny_tr: Transformer):
    pool = make_pool(tiny_tr, n_cells=128, n_seq=3)
    forward(tiny_tr, pool, [BatchSeq(0, A[:5], 0), BatchSeq(1, B[:6], 0), BatchSeq(2, A[:7], 0)])
    pool.seq_cp(1, 0, 0, 3)  # 0 now shares 3 of 1's cells
    pool.seq_keep(1)
    pool.check()
    assert [pool.seq_len(s) for s in range(3)] == [0, 6, 0]
    assert pool.n_free == 128 - 6


@pytest.mark.parametrize("unified", [True, False])
def test_out_of_cells_leaves_pool_unchanged(tiny_tr: Transformer, unified: bool):
    pool = make_pool(tiny_tr, n_cells=64, n_seq=2, unified=unified)
    forward(tiny_tr, pool, [BatchSeq(0, A[:20], 0)])
    before = (pool.n_free, pool.seq_positions(0), pool.seq_positions(1))
    too_many = 64 - 20 + 1 if unified else 32 - 20 + 1
    with pytest.raises(OutOfCells):
        forward(tiny_tr, pool, [BatchSeq(1, B[:5], 0), BatchSeq(0, B[:too_many], 20)])
    pool.check()
    assert (pool.n_free, pool.seq_positions(0), pool.seq_positions(1)) == before


def test_partitioned_sequences_stay_in_their_range(tiny_tr: Transformer):
    pool = make_pool(tiny_tr, n_cells=64, n_seq=4, unified=False)
    assert pool.seq_capacity(2) == 16
    forward(tiny_tr, pool, [BatchSeq(2, A[:16], 0)])
    assert all(32 <= c < 48 for c in pool.seq_cells(2))
    with pytest.raises(OutOfCells):
        pool.alloc(2, [16])
    pool.alloc(3, [0])  # other partitions are unaffected
    pool.check()


def noop_rotate(k: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return k


ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "rm", "cp", "keep", "add"]),
        st.integers(0, 2), st.integers(0, 2), st.integers(0, 12), st.integers(1, 6),
        st.integers(-4, 4),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, unified=st.booleans())
def test_random_operations_match_naive_model(ops, unified: bool):
    pool = KVPool(1, 1, 2, 24, 3, unified, torch.float32, noop_rotate)
    model: dict[int, set[int]] = {0: set(), 1: set(), 2: set()}
    for op, s, t, p, n, delta in ops:
        if op == "alloc":
            positions = [q for q in range(p, p + n) if q not in model[s]]
            try:
                pool.alloc(s, positions)
                model[s] |= set(positions)
            except OutOfCells:
                pass
        elif op == "rm":
            pool.seq_rm(s, p, p + n)
            model[s] = {q for q in model[s] if not p <= q < p + n}
        elif op == "cp":
            try:
                pool.seq_cp(s, t, p, p + n)
            except OutOfCells:
                pool.check()
                continue
            if s != t:
                model[t] |= {q for q in model[s] if p <= q < p + n}
        elif op == "keep":
            pool.seq_keep(s)
            model = {q: (model[q] if q == s else set()) for q in model}
        elif op == "add":
            moved = {q for q in model[s] if p <= q}
            stay = model[s] - moved
            if {q + delta for q in moved if q + delta >= 0} & stay:
                with pytest.raises(ValueError):
                    pool.seq_add(s, p, -1, delta)
                pool.check()  # a rejected shift changes nothing
                assert pool.seq_positions(s) == sorted(model[s])
                continue
            try:
                pool.seq_add(s, p, -1, delta)
            except OutOfCells:
                model[s] = set(pool.seq_positions(s))
                pool.check()
                continue
            model[s] = stay | {q + delta for q in moved if q + delta >= 0}
        pool.check()
        for q in model:
            assert pool.seq_positions(q) == sorted(model[q])


def test_partitioned_seq_cp_out_of_cells_keeps_what_dst_held():
    """Found by the random-operations test: a copy into a sequence that already holds some of
    the positions, with too few free cells, raised OutOfCells after dropping those positions."""
    pool = KVPool(1, 1, 2, 24, 3, False, torch.float32, noop_rotate)
    pool.alloc(0, [0, 1, 2])
    pool.alloc(1, [0, 3, 4, 5, 6, 7, 8])  # 7 of its partition's 8 cells
    with pytest.raises(OutOfCells):
        pool.seq_cp(0, 1, 0, 3)  # needs 3 cells, 1 free + 1 its own position 0 frees
    pool.check()
    assert pool.seq_positions(1) == [0, 3, 4, 5, 6, 7, 8]
    assert pool.seq_positions(0) == [0, 1, 2]
