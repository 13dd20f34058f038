"""A Gated DeltaNet's or Mamba2's recurrent state (Qwen3.5's linear-attention layers, Granite
4.0-H's SSM layers) kept whole, one cell a sequence, beside the attention layers' K/V cells.

Unlike a short convolution (conv.py), a delta-rule or selective-scan layer's state after
position p is no function of a few input rows: it is one [dk, dv] matrix a head (plus the
conv's last rows), megabytes a sequence, and it exists only at the positions it was computed at. So the
window part holds one *state cell* a sequence, at the position of its last token:

- a forward allocates one new state cell at its last new position and reads the cell at the
  position before its first (two cells a sequence during a step, one after: `prune` drops the
  old), so the state a step starts from is never overwritten in place: a step that fails, or a
  sequence that shares the cell (`seq_cp` shares cells, as for rows), keeps it;
- truncating a sequence drops its state cell (the state at an earlier position was never kept
  here): what is reusable is the whole sequence, or a context checkpoint (checkpoint.py),
  which is this state cell's bytes at the position it was taken: the model's snapshots, carried
  by a slot, the whole-prompt host cache and slot files;
- a host tier that keeps rows a token holds the attention rows only (`row_layout`: the state
  is no row group) and the state as snapshots where they were kept: the radix tree on its
  nodes (tiers/radix.py), never written through a token at a time; the disk tier the
  attention rows in its blocks and each snapshot in a snapshot file beside them, with the
  rows of its tail past the last whole block (tiers/disk.py; `layout.rows_every_position` is
  False: a prefix is served only up to a snapshot);
- a context shift is refused (the state exists only at the positions it was computed at).

A cell's two halves (the window part's K and V rows, f32, never quantized) hold one layer's
state: K the conv's last rows then the first value heads' matrices, V the other heads'
(model/delta_net.py reads them where they lie: no copy a step).
"""

from __future__ import annotations

import torch

from radixserve.memory.layout import MemoryLayout
from radixserve.memory.pool.conv import ShiftRefused
from radixserve.memory.pool.kv_types import of_dtype
from radixserve.memory.pool.pool import KVPool, KVTypes, Rotate
from radixserve.memory.pool.swa import SWAPool

CELLS_PER_SEQ = 2  # a sequence's state between steps, and the one a step writes


def _not_rotated(k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    raise ShiftRefused("a recurrent state cannot be shifted")


class RecurrentPool(SWAPool):
    window_tag = "rec"

    def __init__(self, layout: MemoryLayout, n_cells: int, n_seq: int, unified: bool,
                 dtype: torch.dtype, rotate: Rotate, device: str | torch.device = "cpu",
                 types: KVTypes | None = None) -> None:
        """The layout's FULL layers' K/V in `n_cells` cells; its RECURRENT layers' states in
        CELLS_PER_SEQ cells a sequence of layout.state_width f32 floats a half."""
        KVPool.__init__(self, layout.n_full, layout.n_head_kv, layout.head_dim, n_cells, n_seq,
                        unified, dtype, rotate, device, types, layout)
        exact = (of_dtype(torch.float32),) * 2
        self.swa = KVPool(layout.n_recurrent, 1, layout.state_width, CELLS_PER_SEQ * n_seq,
                          n_seq, unified, torch.float32, _not_rotated, device, exact)
        self.n_keep = 1
        self.n_swa = 1

    # -- one state cell a sequence -------------------------------------------------------------
    def alloc_step(self, seq: int, positions: list[int]) -> list[int]:
        cells = self.alloc(seq, positions)
        try:
            self.swa.alloc(seq, positions[-1:])
        except Exception:
            KVPool.seq_rm(self, seq, positions[0], positions[-1] + 1)
            raise
        return cells

    def window_view(self, seq: int, positions: list[int]
                    ) -> tuple[list[int], slice | torch.Tensor, list[int]] | None:
        """The state cell the step writes (at its last position) and the cells held with their
        positions (the one before the step's first position is the state it reads)."""
        view = self.swa.view(seq)
        return self.swa.cells_at(seq, positions[-1:]), view.cells, view.positions

    def prune(self, seq: int) -> None:
        """Keep only the state after the sequence's last token."""
        pos_max = self.seq_pos_max(seq)
        if pos_max > 0:
            self.swa.seq_rm(seq, 0, pos_max)

    def window_start(self, seq: int) -> int:
        return max(0, self.seq_pos_max(seq))

    def snapshot_from(self, seq: int) -> int:
        pm = self.swa_pos_min(seq)
        return pm if pm < 0 else max(pm, self.seq_pos_max(seq))

    def window_from(self, n: int) -> int:
        return max(0, n - 1)

    @property
    def bytes_per_token(self) -> int:
        """The attention rows only: the state is a sequence's, not a token's."""
        return KVPool.bytes_per_token.fget(self)  # type: ignore[attr-defined]

    def n_free_for(self, seq: int) -> int:
        return KVPool.n_free_for(self, seq) if self.swa.n_free_for(seq) else 0

    def n_reclaimable(self, seq: int) -> int:
        return KVPool.n_reclaimable(self, seq) if self.swa.n_reclaimable(seq) else 0

    # -- rows a token: the attention layers' only (the state travels as snapshots) -----------
    def _row_layers(self) -> int:
        return self.n_layer

    def rows_held_from(self, seq: int) -> int:
        return 0

    def _gather(self, seq: int, positions: list[int],
                idx: torch.Tensor) -> list[torch.Tensor]:
        return KVPool._gather(self, seq, positions, idx)

    def _window(self, pos0: int, k: torch.Tensor, v: torch.Tensor, n: int,
                window_from: int) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
        return None

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """The attention rows of [p0, p1), and the state only where it is the state at the
        copy's end (the cell at p1 - 1): any other cell of `src` is no state of `dst`'s."""
        KVPool.seq_cp(self, src, dst, p0, p1)
        end = self.seq_pos_max(src) + 1 if p1 < 0 else p1
        if end - 1 in self.swa.seq_positions(src):
            try:
                self.swa.seq_cp(src, dst, end - 1, end)
            except Exception:
                KVPool.seq_rm(self, dst, p0, p1)
                raise

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        if delta:
            raise ShiftRefused("a recurrent state cannot be shifted: the model has Gated "
                               "DeltaNet layers (context shift is off for it)")
