"""The sliding-window pool (memory/pool/swa.py): the sliding layers' memory is bounded by the window,
pruning never changes what attention computes, and states and checkpoints round-trip exactly."""

from __future__ import annotations

import pytest
import torch

from radixserve.engine.batch import BatchSeq, forward
from radixserve.memory.pool.pool import KVPool
from radixserve.memory.pool.state import (
    StateError,
    fingerprint_of,
    get_state,
    get_swa_state,
    set_state,
    set_swa_state,
    state_size,
)
from radixserve.memory.pool.swa import SWAPool
from radixserve.model.forward import Transformer
from tests.conftest import make_pool, make_transformer

IDS = [3000 + (i * 37) % 500 for i in range(120)]


@pytest.fixture(scope="module")
def swa_tr(tiny_swa_path: str) -> Transformer:
    return make_transformer(tiny_swa_path)


def run(tr: Transformer, pool: KVPool, seq: int, ids: list[int], pos0: int,
        chunk: int) -> torch.Tensor:
    """Logits of every chunk's last token, `ids` fed in chunks from pos0."""
    out = []
    for s in range(0, len(ids), chunk):
        out.append(forward(tr, pool, [BatchSeq(seq, ids[s : s + chunk], pos0 + s)]))
        pool.check()
    return torch.cat(out)


def test_sliding_memory_is_bounded_by_window_times_slots(swa_tr: Transformer):
    hp = swa_tr.hp
    assert hp.n_swa == 16 and hp.swa_layers == (True,) * 5 + (False,)
    small = make_pool(swa_tr, n_cells=1024, n_seq=2, n_step=32)
    big = make_pool(swa_tr, n_cells=8192, n_seq=2, n_step=32)
    assert isinstance(small, SWAPool) and isinstance(big, SWAPool)
    # llama.cpp's size: n_swa x slots + one step's tokens, padded to 256, whatever n_ctx is
    assert small.swa.n_cells == big.swa.n_cells == 256
    assert small.swa.n_layer == 5 and small.n_layer == 1
    for seq in (0, 1):
        run(swa_tr, small, seq, IDS[: 100 + 7 * seq], 0, 32)
        for i in range(20):  # decode steps slide the window one position each
            forward(swa_tr, small, [BatchSeq(seq, [IDS[i]], 100 + 7 * seq + i)])
            window = small.swa.seq_positions(seq)
            end = 100 + 7 * seq + i
            assert window == list(range(end - 15, end + 1))
    assert small.seq_len(0) == 120 and small.seq_len(1) == 127
    assert small.swa.n_cells - small.swa.n_free == 32  # 16 a sequence
    small.check()


def test_pruned_window_computes_what_full_caches_compute(swa_tr: Transformer):
    full = make_pool(swa_tr, n_cells=512, n_seq=1, swa_full=True)
    assert not isinstance(full, SWAPool) and full.n_layer == 6
    swa = make_pool(swa_tr, n_cells=512, n_seq=1, n_step=64)
    for chunk in (1, 7, 64):
        full.clear()
        swa.clear()
        a = run(swa_tr, full, 0, IDS, 0, chunk)
        b = run(swa_tr, swa, 0, IDS, 0, chunk)
        assert torch.allclose(a, b, atol=1e-5, rtol=0), (chunk, (a - b).abs().max())
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_state_round_trip_keeps_the_window(swa_tr: Transformer):
    pool = make_pool(swa_tr, n_cells=512, n_seq=2, n_step=64)
    fp = fingerprint_of(pool, "gemma3")
    run(swa_tr, pool, 0, IDS[:90], 0, 64)
    data = get_state(pool, 0, fp)
    assert len(data) == state_size(pool, 0, fp)
    expect = forward(swa_tr, pool, [BatchSeq(0, [11], 90)])
    assert set_state(pool, 1, data, fp) == 90
    pool.check()
    assert pool.swa.seq_positions(1) == list(range(74, 90))
    got = forward(swa_tr, pool, [BatchSeq(1, [11], 90)])
    assert torch.equal(got, expect)


def test_state_of_another_layout_or_broken_changes_nothing(swa_tr: Transformer):
    swa = make_pool(swa_tr, n_cells=256, n_seq=2, n_step=64)
    full = make_pool(swa_tr, n_cells=256, n_seq=2, swa_full=True)
    run(swa_tr, swa, 0, IDS[:40], 0, 64)
    run(swa_tr, full, 0, IDS[:40], 0, 64)
    run(swa_tr, swa, 1, IDS[40:60], 0, 64)
    fp = fingerprint_of(swa, "gemma3")
    before = (swa.seq_positions(1), swa.swa.seq_positions(1), swa.n_free, swa.swa.n_free)
    foreign = get_state(full, 0, fingerprint_of(full, "gemma3"))
    good = get_state(swa, 0, fp)
    bad = [foreign, good[:-1], good + b"\0", good[: len(good) // 2]]
    bad += [good[:i] for i in range(0, 200, 7)]
    for data in bad:
        with pytest.raises(StateError):
            set_state(swa, 1, data, fp)
        after = (swa.seq_positions(1), swa.swa.seq_positions(1), swa.n_free, swa.swa.n_free)
        assert after == before
    swa.check()


def test_checkpoint_restores_a_prefix_the_window_has_left(swa_tr: Transformer):
    """A checkpoint (the sliding part at 50 tokens) plus the global part truncated to 50 holds
    what 50 tokens computed afresh hold: the next token's logits are the same."""
    pool = make_pool(swa_tr, n_cells=512, n_seq=2, n_step=64)
    fp = fingerprint_of(pool, "gemma3")
    run(swa_tr, pool, 0, IDS[:50], 0, 64)
    ckpt = get_swa_state(pool, 0, fp)
    run(swa_tr, pool, 0, IDS[50:110], 50, 64)
    assert pool.swa_pos_min(0) > 50 - 16  # the window has left position 50's keys
    set_swa_state(pool, 0, ckpt, fp)
    pool.seq_rm(0, 50)
    pool.check()
    got = forward(swa_tr, pool, [BatchSeq(0, [IDS[50]], 50)])
    run(swa_tr, pool, 1, IDS[:50], 0, 64)
    expect = forward(swa_tr, pool, [BatchSeq(1, [IDS[50]], 50)])
    assert torch.equal(got, expect)
    with pytest.raises(StateError):  # a whole state is not a checkpoint
        set_swa_state(pool, 0, get_state(pool, 1, fp), fp)


def test_fan_out_keeps_both_parts_in_step(swa_tr: Transformer):
    pool = make_pool(swa_tr, n_cells=256, n_seq=3, n_step=64)
    run(swa_tr, pool, 0, IDS[:40], 0, 64)
    pool.seq_cp(0, 1, 0, 30)  # shares what the window still holds of [0, 30)
    assert pool.seq_positions(1) == list(range(30))
    assert pool.swa.seq_positions(1) == list(range(24, 30))
    pool.seq_rm(0, 30)
    assert pool.swa.seq_positions(0) == list(range(24, 30))
    pool.seq_add(1, 0, 30, 5)
    assert pool.swa.seq_positions(1) == list(range(29, 35))
    cells = pool.alloc_step(2, [0, 1, 2])
    assert len(cells) == 3 and pool.swa.seq_positions(2) == [0, 1, 2]
    pool.check()
    pool.clear()
    assert pool.n_free == pool.n_cells and pool.swa.n_free == pool.swa.n_cells
