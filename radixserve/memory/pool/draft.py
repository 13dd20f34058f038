"""The draft model's K/V, kept in the target's cells (speculative decoding with a draft model).

A draft model reads the same tokens at the same positions as the target, so its K/V lives beside
the target's in the same cells: cell c's draft rows are the draft model's K/V of the token cell c
holds. Every sequence operation then carries the draft along without a second bookkeeping (what
llama.cpp does by hand for its second context at every call site): a shared prefix shares its
draft rows (`seq_cp` in unified KV), a copy or a shift copies or re-rotates them (`KVPool` calls
`copy_cells` / `rotate_cells`), a removed cell takes them with it. What cannot follow for free -
whether the draft rows of a slot's tokens have been computed at all - `SlotKV.n_draft` tracks.
"""

from __future__ import annotations

import torch

from radixserve.memory.pool.pool import KVPool, KVTypes, Rotate, cell_bytes, rotate_rows, typed_rows
from radixserve.memory.pool.state import Fingerprint
from radixserve.memory.pool.kv_types import types_name
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

    @property
    def bytes_per_cell(self) -> int:
        return cell_bytes(self.n_layer, self.n_head_kv, self.head_dim, self.types)

    def write(self, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Draft rows [n_layer, n_head_kv, n, width] into cells `idx`."""
        self.k[:, :, idx] = stored(k, self.k, self.device)
        self.v[:, :, idx] = stored(v, self.v, self.device)

    def copy_cells(self, si: torch.Tensor, di: torch.Tensor) -> None:
        self.k[:, :, di] = self.k[:, :, si]
        self.v[:, :, di] = self.v[:, :, si]

    def rotate_cells(self, idx: torch.Tensor, delta: torch.Tensor) -> None:
        """Re-rotate K of cells whose position moved by `delta` (the draft's own RoPE)."""
        rotate_rows(self.k, self.types[0], idx, delta, self.rotate, self.dtype)


def attach_draft(pool: KVPool, n_layer: int, n_head_kv: int, head_dim: int,
                 dtype: torch.dtype, rotate: Rotate, arch: str,
                 types: KVTypes | None = None) -> DraftRows:
    """Give every cell of `pool` draft rows of this shape (a sliding-window pool's global part:
    draft models with a window of their own are refused before this)."""
    pool.draft = DraftRows(n_layer, n_head_kv, head_dim, pool.n_cells, dtype, rotate, arch,
                           pool.device, types)
    return pool.draft
