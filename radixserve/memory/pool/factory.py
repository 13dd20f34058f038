"""The one place a pool is made: a model's declared memory layout (memory/layout.py) becomes the
pool that holds it. Callers pass the layout and the sizes; which class keeps which group is
decided here alone (a new kind of memory adds its branch here and its class in pool/)."""

from __future__ import annotations

import torch

from radixserve.memory.layout import MemoryLayout
from radixserve.memory.pool.conv import ConvPool
from radixserve.memory.pool.pool import KVPool, KVTypes, Rotate
from radixserve.memory.pool.recurrent import RecurrentPool
from radixserve.memory.pool.swa import SWAPool


def build_pool(layout: MemoryLayout, n_cells: int, n_seq: int, unified: bool,
               dtype: torch.dtype, rotate: Rotate, rotate_swa: Rotate, n_step: int,
               device: str | torch.device = "cpu", types: KVTypes | None = None,
               swa_full: bool = False) -> KVPool:
    """The pool `layout` needs, in `n_cells` cells for `n_seq` sequences (`unified`: one free
    list). `rotate` / `rotate_swa`: the full and sliding layers' K re-rotation (RoPE); `n_step`:
    the most new tokens one forward holds (a window part's headroom); `types`: the K and V
    cache types (`-ctk` / `-ctv`; None: `dtype`); `swa_full`: the sliding layers keep every
    position (`--swa-full`: no window; a short convolution's state is windowed regardless)."""
    held = layout.held(swa_full)
    shape = (held.n_head_kv, held.head_dim)
    if held.n_recurrent:
        return RecurrentPool(held, n_cells, n_seq, unified, dtype, rotate, device, types)
    if held.n_conv:
        return ConvPool(held.n_full, held.n_conv, *shape, held.conv_width, held.window,
                        n_cells, n_seq, unified, dtype, rotate, n_step, device, types,
                        layout=held)
    if held.n_sliding:
        return SWAPool(held.n_full, held.n_sliding, *shape, n_cells, n_seq, unified, dtype,
                       rotate, rotate_swa, held.n_swa, n_step, device, types, layout=held)
    return KVPool(held.n_full, *shape, n_cells, n_seq, unified, dtype, rotate, device, types,
                  layout=held)
