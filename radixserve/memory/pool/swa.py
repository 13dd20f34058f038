"""Sliding-window KV (llama.cpp's `llama_kv_cache_iswa`): the global layers' cells in the pool
itself, the sliding layers' in a second, smaller pool (`swa`) that keeps only the window.

A sliding layer's query at position p reads keys at positions p - n_swa < k <= p only, so once
a sequence's last position is P, keys at P - n_swa and before can never be read again: `prune`
drops them (llama.cpp keeps exactly the last n_swa positions). The sliding pool therefore needs
n_swa cells per sequence plus one forward's new tokens, however long the context: memory bound
by window x slots, which is the point of the layout (`--swa-full` keeps full-size caches
instead: one plain pool for every layer, the window applied by the attention mask).

The price: a prefix whose window has gone cannot be reused from the slot as it stands (the
sliding layers lack the keys before its end); a context checkpoint (memory/checkpoint.py) or a host
tier that kept every token (the radix tree) supplies them.

Sequence operations fan out to both pools. Allocation does not: a forward reserves cells in
both (`alloc_step`), a restore writes each part where it belongs (memory/pool/state.py). The
owner and the state bytes reach the window through `windowed` (pool.py's `Windowed`).
"""

from __future__ import annotations

import torch

from radixserve.memory.layout import FULL, SLIDING, MemoryLayout
from radixserve.memory.pool.pool import KVPool, KVTypes, OutOfCells, Rotate, Windowed
from radixserve.memory.pool.rows import Segment

PAD = 256  # llama.cpp pads cache sizes to 256 cells


def _pad(n: int) -> int:
    return (n + PAD - 1) // PAD * PAD


class SWAPool(KVPool):
    window_tag = "swa"  # names the window's part in state bytes (state.py's fingerprints)

    def __init__(self, n_layer: int, n_layer_swa: int, n_head_kv: int, head_dim: int,
                 n_cells: int, n_seq: int, unified: bool, dtype: torch.dtype, rotate: Rotate,
                 rotate_swa: Rotate, n_swa: int, n_step: int,
                 device: str | torch.device = "cpu", types: KVTypes | None = None,
                 window_rows: tuple[int, int] | None = None,
                 window_types: KVTypes | None = None, n_keep: int = 0,
                 layout: MemoryLayout | None = None) -> None:
        """`n_layer` global layers in `n_cells` cells; `n_layer_swa` sliding layers in
        n_swa cells per sequence plus `n_step` (the most new tokens one forward holds), never
        more than the global part (llama.cpp's size_swa). `window_rows` (heads, width) and
        `window_types`: the window's rows when they are not the global part's (conv.py);
        `n_keep`: the most positions a sequence holds between two prunes (default n_swa);
        `layout`: as KVPool's (None: the global layers, then the sliding ones)."""
        layout = layout or MemoryLayout(n_head_kv, head_dim,
                                        (FULL,) * n_layer + (SLIDING,) * n_layer_swa, n_swa)
        super().__init__(n_layer, n_head_kv, head_dim, n_cells, n_seq, unified, dtype, rotate,
                         device, types, layout)
        self.n_keep = max(n_keep, n_swa)
        per_part = self.n_keep * (n_seq if unified else 1) + n_step
        n_part = 1 if unified else n_seq
        n_swa_cells = min(self.n_cells, _pad(per_part) * n_part)
        heads, width = window_rows or (n_head_kv, head_dim)
        self.swa = KVPool(n_layer_swa, heads, width, n_swa_cells, n_seq, unified, dtype,
                          rotate_swa, device, window_types or self.types)  # default: -ctk / -ctv
        self.n_swa = n_swa

    @property
    def windowed(self) -> Windowed:
        return self

    @property
    def window_cells(self) -> int:
        return self.swa.n_cells

    def alloc_step(self, seq: int, positions: list[int]) -> list[int]:
        cells = self.alloc(seq, positions)
        try:
            self.swa.alloc(seq, positions)
        except Exception:
            KVPool.seq_rm(self, seq, positions[0], positions[-1] + 1)
            raise
        return cells

    # -- rows by layer group: the sliding layers after the global ones ------------------------
    def _row_layers(self) -> int:
        return self.n_layer + self.swa.n_layer

    @property
    def bytes_per_token(self) -> int:
        return super().bytes_per_token + self.swa.bytes_per_cell

    def caches(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                              torch.Tensor | None]:
        return self.k, self.v, self.swa.k, self.swa.v

    def window_view(self, seq: int, positions: list[int]
                    ) -> tuple[list[int], slice | torch.Tensor, list[int]] | None:
        view = self.swa.view(seq)
        return self.swa.cells_at(seq, positions), view.cells, view.positions

    def rows_held_from(self, seq: int) -> int:
        return self.swa_pos_min(seq)

    def window_from(self, n: int) -> int:
        return max(0, n - self.n_swa)

    def can_hold(self, seq: int, n: int) -> bool:
        return (n <= KVPool.n_reclaimable(self, seq)
                and min(n, self.n_swa) <= self.swa.n_reclaimable(seq))

    def _window_idx(self, seq: int, positions: list[int]) -> torch.Tensor:
        return torch.tensor(self.swa.cells_at(seq, positions), dtype=torch.long,
                            device=self.device)

    def _gather(self, seq: int, positions: list[int],
                idx: torch.Tensor) -> list[torch.Tensor]:
        sidx = self._window_idx(seq, positions)
        return [torch.cat([self.k[:, :, idx], self.swa.k[:, :, sidx]]),
                torch.cat([self.v[:, :, idx], self.swa.v[:, :, sidx]])]

    def _window(self, pos0: int, k: torch.Tensor, v: torch.Tensor, n: int,
                window_from: int) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
        if pos0 + n <= window_from:
            return None
        a = max(window_from, pos0) - pos0
        return list(range(pos0 + a, pos0 + n)), k[:, :, a:n], v[:, :, a:n]

    def write_segment(self, seq: int, seg: Segment) -> None:
        window = seg.swa
        super().write_segment(seq, Segment(seg.positions, seg.k, seg.v, None, seg.draft))
        if window is not None:
            self.swa.write_rows(seq, *window)

    # -- sizes -------------------------------------------------------------------------------
    def n_free_for(self, seq: int) -> int:
        return min(super().n_free_for(seq), self.swa.n_free_for(seq))

    def n_reclaimable(self, seq: int) -> int:
        return min(super().n_reclaimable(seq), self.swa.n_reclaimable(seq))

    def swa_pos_min(self, seq: int) -> int:
        """The oldest position the sliding layers hold for `seq` (-1: none)."""
        pos = self.swa.seq_positions(seq)
        return pos[0] if pos else -1

    # -- the window --------------------------------------------------------------------------
    def prune(self, seq: int) -> None:
        """Drop the sliding cells no later query of `seq` can read."""
        pos_max = self.seq_pos_max(seq)
        if pos_max >= self.n_swa:
            self.swa.seq_rm(seq, 0, pos_max - self.n_swa + 1)

    def window_start(self, seq: int) -> int:
        """First position `prune` would keep now (positions before it go)."""
        return max(0, self.seq_pos_max(seq) - self.n_swa + 1)

    def snapshot_from(self, seq: int) -> int:
        """The first position a context checkpoint of `seq` keeps: the window's, for a token
        after the last (-1: none held)."""
        pm = self.swa_pos_min(seq)
        return pm if pm < 0 else max(pm, self.seq_pos_max(seq) - self.n_swa + 1)

    # -- fan-out of llama.cpp's sequence operations --------------------------------------------
    def seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> None:
        super().seq_rm(seq, p0, p1)
        self.swa.seq_rm(seq, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """Both parts or neither (a partition without room for the sliding copy)."""
        super().seq_cp(src, dst, p0, p1)
        try:
            self.swa.seq_cp(src, dst, p0, p1)
        except OutOfCells:
            super().seq_rm(dst, p0, p1)
            raise

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        super().seq_add(seq, p0, p1, delta)
        self.swa.seq_add(seq, p0, p1, delta)

    def check(self) -> None:
        super().check()
        self.swa.check()

