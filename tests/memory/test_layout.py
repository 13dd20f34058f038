"""The memory layout a model declares (memory/layout.py) and the pool the one factory builds from
it: each layer's group, what the owner and the engine ask (window, checkpoints, shifts), and
the layout the built pool holds (`--swa-full` folds the window away)."""

from __future__ import annotations

import pytest
import torch

from radixserve.memory.front import build_pool
from radixserve.memory.layout import CONV, FULL, SLIDING, MemoryLayout
from radixserve.model.hparams import HParams
from radixserve.model.arch import memory_layout


def no_rotate(k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    return k


def hparams(**kw: object) -> HParams:
    base = dict(arch="llama", n_layer=3, n_embd=8, n_ff=16, n_head=2, n_head_kv=1, head_dim=4,
                n_vocab=16, n_ctx_train=64, rms_eps=1e-5, rope_base=10000.0, rope_neox=False,
                rope_scale_linear=1.0, name="test")
    return HParams(**(base | kw))  # type: ignore[arg-type]


def build(layout: MemoryLayout, swa_full: bool = False):  # type: ignore[no-untyped-def]
    return build_pool(layout, 64, 2, True, torch.float32, no_rotate, no_rotate, 8,
                      swa_full=swa_full)


def test_the_groups_and_each_layers_place() -> None:
    lay = MemoryLayout(1, 4, (FULL, SLIDING, FULL, SLIDING, SLIDING), n_swa=6)
    assert (lay.n_full, lay.n_sliding, lay.n_conv) == (2, 3, 0)
    assert [lay.place(i) for i in range(5)] == [(FULL, 0), (SLIDING, 0), (FULL, 1),
                                                (SLIDING, 1), (SLIDING, 2)]
    assert lay.rows_per_token == 5 and lay.state_per_sequence == 0
    held = lay.held(swa_full=True)
    assert held.kinds == (FULL,) * 5 and held.window == 0 and lay.held(False) is lay


@pytest.mark.parametrize("kw", [dict(kinds=(FULL, SLIDING)),  # no window
                                dict(kinds=(SLIDING, CONV), n_swa=4, conv_rows=2,
                                     conv_width=8),  # two window parts
                                dict(kinds=(CONV,)),  # no state
                                dict(kinds=("mamba",))])
def test_a_layout_the_pools_cannot_hold_is_refused(kw: dict) -> None:
    with pytest.raises(ValueError):
        MemoryLayout(1, 4, **kw)


def test_capabilities_by_kind() -> None:
    full = MemoryLayout(1, 4, (FULL, FULL))
    swa = MemoryLayout(1, 4, (SLIDING, FULL), n_swa=6)
    conv = MemoryLayout(1, 4, (CONV, FULL), conv_rows=2, conv_width=8)
    assert [x.window for x in (full, swa, conv)] == [0, 6, 3]  # conv: the state and the token
    assert [x.needs_checkpoints for x in (full, swa, conv)] == [False, True, True]
    assert [x.can_shift for x in (full, swa, conv)] == [True, True, False]
    assert [x.shifts_chunks for x in (full, swa, conv)] == [True, False, False]
    assert conv.state_per_sequence == 2 and conv.rows_per_token == 1


def test_the_family_declares_its_layout_from_the_hyper_parameters() -> None:
    g = memory_layout(hparams(arch="gemma3", n_swa=4, swa_layers=(True, False, True)))
    assert g == MemoryLayout(1, 4, (SLIDING, FULL, SLIDING), n_swa=4)
    lfm = memory_layout(hparams(arch="lfm2", conv_layers=(True, True, False), l_cache=3))
    assert lfm == MemoryLayout(1, 4, (CONV, CONV, FULL), conv_rows=2, conv_width=8)
    assert memory_layout(hparams(n_swa=4)) == MemoryLayout(1, 4, (FULL,) * 3)  # no layer slides


def test_the_factory_builds_the_pool_the_layout_needs() -> None:
    swa = MemoryLayout(1, 4, (SLIDING, FULL, SLIDING), n_swa=6)
    pool = build(swa)
    assert pool.layout == swa and pool.windowed is pool and pool.n_layer == 1
    assert pool.window_cells > 0
    folded = build(swa, swa_full=True)
    assert folded.layout == swa.held(True) and folded.windowed is None
    assert folded.n_layer == 3 and folded.window_cells == 0
    conv = MemoryLayout(1, 4, (CONV, FULL), conv_rows=2, conv_width=8)
    cp = build(conv, swa_full=True)  # a state is windowed whatever --swa-full says
    assert cp.layout == conv and cp.windowed is cp and cp.n_layer == 1
    cells = cp.alloc_step(0, [0, 1])  # every part reserves
    assert cp.cells_at(0, [0, 1]) == cells and cp.swa.seq_positions(0) == [0, 1]
