"""Sequence state bytes: exact round trips, and foreign or broken states change nothing."""

from __future__ import annotations

import pytest
import torch

from radixserve.engine.batch import BatchSeq, forward
from radixserve.memory.pool.pool import OutOfCells
from radixserve.memory.pool.state import StateError, fingerprint_of, get_state, set_state, state_size
from radixserve.model.forward import Transformer
from tests.conftest import make_pool

IDS = list(range(3000, 3025))


def snapshot(pool, seq):
    cells = pool.seq_cells(seq)
    return pool.seq_positions(seq), pool.k[:, :, cells].clone(), pool.v[:, :, cells].clone()


def test_round_trip_restores_identical_kv_and_logits(tiny_tr: Transformer):
    pool = make_pool(tiny_tr, n_cells=128, n_seq=2)
    fp = fingerprint_of(pool, "llama")
    forward(tiny_tr, pool, [BatchSeq(0, IDS, 0)])
    pos, k, v = snapshot(pool, 0)
    data = get_state(pool, 0, fp)
    assert len(data) == state_size(pool, 0, fp)
    expect = forward(tiny_tr, pool, [BatchSeq(0, [7], len(IDS))])
    pool.clear()
    assert set_state(pool, 1, data, fp) == len(IDS)
    pool.check()
    pos1, k1, v1 = snapshot(pool, 1)
    assert pos1 == pos and torch.equal(k1, k) and torch.equal(v1, v)
    got = forward(tiny_tr, pool, [BatchSeq(1, [7], len(IDS))])
    assert torch.equal(got, expect)


@pytest.mark.parametrize("change", ["arch", "n_layer", "dtype", "truncate", "magic", "extra"])
def test_foreign_or_broken_state_changes_nothing(tiny_tr: Transformer, change: str):
    pool = make_pool(tiny_tr, n_cells=128, n_seq=2)
    fp = fingerprint_of(pool, "llama")
    forward(tiny_tr, pool, [BatchSeq(0, IDS, 0), BatchSeq(1, IDS[:5], 0)])
    data = get_state(pool, 0, fp)
    target_fp = fp
    if change == "arch":
        target_fp = fingerprint_of(pool, "qwen2")
    elif change == "n_layer":
        target_fp = type(fp)(fp.arch, fp.n_layer + 1, fp.n_head_kv, fp.head_dim, fp.dtype)
    elif change == "dtype":
        target_fp = type(fp)(fp.arch, fp.n_layer, fp.n_head_kv, fp.head_dim, "bf16")
    elif change == "truncate":
        data = data[:-3]
    elif change == "magic":
        data = b"XXXX" + data[4:]
    else:
        data = data + b"\0"
    before = snapshot(pool, 1)
    with pytest.raises(StateError) as e:
        set_state(pool, 1, data, target_fp)
    if change in ("arch", "n_layer", "dtype"):
        assert change.split("_")[0] in str(e.value)  # the message names the mismatch
    pool.check()
    after = snapshot(pool, 1)
    assert after[0] == before[0] and torch.equal(after[1], before[1])


def test_state_too_big_for_free_cells_changes_nothing(tiny_tr: Transformer):
    pool = make_pool(tiny_tr, n_cells=40, n_seq=2)
    fp = fingerprint_of(pool, "llama")
    forward(tiny_tr, pool, [BatchSeq(0, IDS, 0), BatchSeq(1, IDS[:10], 0)])
    data = get_state(pool, 0, fp)  # 25 tokens; seq 1 can reach 10 own + 5 free
    with pytest.raises(OutOfCells):
        set_state(pool, 1, data, fp)
    pool.check()
    assert pool.seq_len(1) == 10
