"""Short-convolution state (LFM2's recurrent layers) as a window of the convolution's inputs.

A short-convolution layer's output at position p reads its input rows (B * x, one per token)
at positions p - L + 1 .. p only (L = the kernel's length, `shortconv.l_cache`): its recurrent
state after position p is exactly the last L - 1 input rows, the state llama.cpp keeps
(n_embd_r = (L - 1) * n_embd a sequence). That is the sliding window's shape of memory with
another row, so this layout is the sliding-window pool (swa.py) whose window part holds those
rows: the attention layers' K/V in the pool's cells, the conv layers' input rows in a part
that keeps a sequence's last n_swa = L positions (pruned in runs of PRUNE_SLACK positions).

What follows from keeping the state as rows rather than as one opaque vector:
- every position's state is exact, and recoverable wherever the rows are: the radix tree keeps
  every token's rows (written through before the window slides), so a prefix it holds is
  reusable up to any token, not only at a snapshot; a slot, a whole-prompt entry and a slot
  file keep the window at their positions as context checkpoints (checkpoint.py), which are
  this model's snapshots;
- rolling back a speculative draft is removing the rejected positions' rows (the window keeps
  the rows of the positions before them);
- the rows are stored in the compute dtype, whatever -ctk / -ctv say (quantized KV is for the
  attention rows; the state stays exact), and are never rotated: a context shift would need a
  state at positions that were never computed, so it is refused, as llama.cpp refuses it.

Rows leave the pool as their own group (`row_layout`: the attention layers' K and V, then the
window's two halves of each input row, then a draft model's): the window's row is n_embd wide,
stored as two halves (the K and V of one head of width n_embd / 2) so the window part is a
plain KVPool and every sequence operation, checkpoint and state block works on it unchanged.
"""

from __future__ import annotations

import torch

from radixserve.memory.layout import CONV, FULL, MemoryLayout
from radixserve.memory.pool.kv_types import of_dtype
from radixserve.memory.pool.pool import KVTypes, Rotate
from radixserve.memory.pool.rows import RowSpec
from radixserve.memory.pool.swa import SWAPool


class ShiftRefused(ValueError):
    """A position shift asked of a recurrent state (it exists only where it was computed)."""


def _not_rotated(k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    raise ShiftRefused("a short convolution's state cannot be shifted")


# positions of input rows a sequence may hold past its window before `prune` drops them: the
# radix tier's write-through (before rows leave) then stores runs of this many tokens, not one
# tree node a decode step, and a prompt that leaves the slot's text within them reuses the
# slot without a checkpoint; a checkpoint still keeps only the window (`snapshot_from`)
PRUNE_SLACK = 64


class ConvPool(SWAPool):
    window_tag = "conv"

    def __init__(self, n_layer_attn: int, n_layer_conv: int, n_head_kv: int, head_dim: int,
                 n_embd: int, l_cache: int, n_cells: int, n_seq: int, unified: bool,
                 dtype: torch.dtype, rotate: Rotate, n_step: int,
                 device: str | torch.device = "cpu", types: KVTypes | None = None,
                 layout: MemoryLayout | None = None) -> None:
        """`n_layer_attn` attention layers in `n_cells` cells; `n_layer_conv` short-convolution
        layers of width `n_embd` and kernel length `l_cache` in their window part; `layout`:
        as KVPool's (None: the attention layers, then the conv ones)."""
        if n_embd % 2:
            raise ValueError(f"a short convolution of odd width {n_embd}")
        exact = (of_dtype(dtype), of_dtype(dtype))
        super().__init__(n_layer_attn, n_layer_conv, n_head_kv, head_dim, n_cells, n_seq,
                         unified, dtype, rotate, _not_rotated, l_cache, n_step, device, types,
                         window_rows=(1, n_embd // 2), window_types=exact,
                         n_keep=l_cache + PRUNE_SLACK,
                         layout=layout or MemoryLayout(
                             n_head_kv, head_dim, (FULL,) * n_layer_attn + (CONV,) * n_layer_conv,
                             conv_rows=l_cache - 1, conv_width=n_embd))

    # -- the window, pruned in runs --------------------------------------------------------
    def prune(self, seq: int) -> None:
        if self.swa.seq_len(seq) >= self.n_keep:
            super().prune(seq)

    def window_start(self, seq: int) -> int:
        if self.swa.seq_len(seq) >= self.n_keep:
            return super().window_start(seq)
        return max(0, self.swa_pos_min(seq))

    # -- rows by layer group: the window's rows are a group of their own shape --------------
    def _row_layers(self) -> int:
        return self.n_layer

    def row_layout(self) -> list[RowSpec]:
        rows, w = super().row_layout(), self.swa  # own K and V, then a draft's
        conv = [RowSpec(w.n_layer, w.n_head_kv, w.head_dim, t.storage) for t in w.types]
        return rows[:2] + conv + rows[2:]

    def _gather(self, seq: int, positions: list[int],
                idx: torch.Tensor) -> list[torch.Tensor]:
        widx = self._window_idx(seq, positions)
        return [self.k[:, :, idx], self.v[:, :, idx], self.swa.k[:, :, widx],
                self.swa.v[:, :, widx]]

    def _split(self, rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor,
                                                        torch.Tensor, torch.Tensor,
                                                        list[torch.Tensor]]:
        k, v, wk, wv, *draft = rows
        return k, v, wk, wv, draft

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        if delta:
            raise ShiftRefused("a short convolution's state cannot be shifted: the model "
                               "has recurrent layers (context shift is off for it)")
