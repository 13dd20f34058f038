"""The draft model's K/V, kept in the target's cells (speculative decoding with a draft model).

A draft model reads the same tokens at the same positions as the target, so its K/V lives beside
the target's in the same cells: cell c's draft rows are the draft model's K/V of the token cell c
holds. Every sequence operation then carries the draft along without a second bookkeeping (what
llama.cpp does by hand for its second context at every call site): a shared prefix shares its
draft rows (`seq_cp` in unified KV), a copy or a shift copies or re-rotates them (`KVPool` calls
`copy_cells` / `rotate_cells`), a removed cell takes them with it. What cannot follow for free -
whether the draft rows of a slot's tokens have been computed at all - `SlotKV.n_draft` tracks.

A draft model with short-convolution layers (LFM2) keeps their input rows here too, one a cell
(`conv`: a second group of one head of width n_embd / 2 for each half of a row, in the compute
dtype), not only a window's: its state at any position a sequence holds is then its rows there,
so a rolled-back draft, a restored prefix or a checkpoint restore of the target needs nothing
else. These rows are never rotated: a context shift is refused for such a draft (its target
must be recurrent too, and a recurrent target refuses the shift).
"""

from __future__ import annotations

import torch

from radixserve.memory.layout import MemoryLayout
from radixserve.memory.pool.pool import KVPool, KVTypes, Rotate, cell_bytes, rotate_rows, typed_rows
from radixserve.memory.pool.state import Fingerprint
from radixserve.memory.pool.kv_types import of_dtype, types_name
from radixserve.memory.pool.rows import stored


class DraftRows:
    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, n_cells: int,
                 dtype: torch.dtype, rotate: Rotate, arch: str,
                 device: str | torch.device = "cpu", types: KVTypes | None = None) -> None:
        """`types`: the draft's cache types (`-ctkd` / `-ctvd`; None: as `dtype`)."""
        self.n_layer, self.n_head_kv, self.head_dim = n_layer, n_head_kv, head_dim
        self.dtype, self.rotate, self.device = dtype, rotate, torch.device(device)
        self.types, self.k, self.v = typed_rows(n_layer, n_head_kv, head_dim, n_cells, dtype,
                                                types, self.device)
        # a draft state of another draft model never loads (":draft": never a target's either)
        self.fp = Fingerprint(arch + ":draft", n_layer, n_head_kv, head_dim,
                              types_name(*self.types))
        self.conv: DraftRows | None = None  # a recurrent draft's conv input rows (`add_conv`)

    def add_conv(self, n_layer_conv: int, n_embd: int, arch: str) -> None:
        """The conv input rows of a draft with `n_layer_conv` short-convolution layers of
        width `n_embd`, exact (the compute dtype, whatever -ctkd / -ctvd say)."""
        if n_embd % 2:
            raise ValueError(f"a short convolution of odd width {n_embd}")
        exact = (of_dtype(self.dtype), of_dtype(self.dtype))
        self.conv = DraftRows(n_layer_conv, 1, n_embd // 2, self.k.shape[2], self.dtype,
                              self.rotate, arch + ":conv", self.device, exact)

    def caches(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                              torch.Tensor | None]:
        """The K and V tensors the draft's forward reads and writes: its attention layers',
        then a recurrent draft's conv rows (None: none), as KVPool's `caches`."""
        if self.conv is None:
            return self.k, self.v, None, None
        return self.k, self.v, self.conv.k, self.conv.v

    def parts(self) -> list[DraftRows]:
        """The groups of rows a cell has: the attention layers', then the conv layers'."""
        return [self] if self.conv is None else [self, self.conv]

    @property
    def bytes_per_cell(self) -> int:
        return sum(cell_bytes(d.n_layer, d.n_head_kv, d.head_dim, d.types) for d in self.parts())

    def gather(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """Every group's K and V rows of cells `idx` (new tensors), in `parts` order."""
        return [t[:, :, idx] for d in self.parts() for t in (d.k, d.v)]

    def write(self, idx: torch.Tensor, *rows: torch.Tensor) -> None:
        """Rows [n_layer, n_head_kv, n, width] of every group (`gather`'s order) into cells
        `idx`."""
        parts = self.parts()
        if len(rows) != 2 * len(parts):
            raise ValueError(f"draft rows of {len(rows) // 2} groups for a draft of "
                             f"{len(parts)}")
        for i, d in enumerate(parts):
            d.k[:, :, idx] = stored(rows[2 * i], d.k, d.device)
            d.v[:, :, idx] = stored(rows[2 * i + 1], d.v, d.device)

    def copy_cells(self, si: torch.Tensor, di: torch.Tensor) -> None:
        for d in self.parts():
            d.k[:, :, di] = d.k[:, :, si]
            d.v[:, :, di] = d.v[:, :, si]

    def rotate_cells(self, idx: torch.Tensor, delta: torch.Tensor) -> None:
        """Re-rotate K of cells whose position moved by `delta` (the draft's own RoPE)."""
        rotate_rows(self.k, self.types[0], idx, delta, self.rotate, self.dtype)


def attach_draft(pool: KVPool, layout: MemoryLayout, dtype: torch.dtype, rotate: Rotate,
                 arch: str, types: KVTypes | None = None) -> DraftRows:
    """Give every cell of `pool` the rows of a draft model of memory layout `layout` (beside a
    sliding-window pool's global part: draft models with sliding layers are refused before
    this): its attention layers' K/V, and a recurrent draft's conv input rows."""
    rows = DraftRows(layout.rows_per_token, layout.n_head_kv, layout.head_dim, pool.n_cells,
                     dtype, rotate, arch, pool.device, types)
    if layout.n_conv:
        rows.add_conv(layout.n_conv, layout.conv_width, arch)
    pool.draft = rows
    return rows
