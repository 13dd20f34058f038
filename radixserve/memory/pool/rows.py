"""Rows as they leave and re-enter the pool: the description of a token's rows in every layer
group (`RowSpec`, what disk blocks are made of), a run of positions' rows in the pool's layout
(`Segment`, what a host tier hands back for a restore), and the one conversion rule for rows
written into a pool (`stored`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class RowSpec:
    """One row tensor of a block: [n_layer, n_head_kv, block, width] of `dtype`, the stored
    rows of KV cache type `kind` (a quantized type: width bytes of blocks; "" for the dtype's
    own values). The kind is in the header and the layout's repr, so in the files' names."""

    n_layer: int
    n_head_kv: int
    width: int
    dtype: torch.dtype
    kind: str = ""

    def shape(self, n: int) -> list[int]:
        return [self.n_layer, self.n_head_kv, n, self.width]

    @property
    def dtype_name(self) -> str:
        return self.kind or str(self.dtype).removeprefix("torch.")

    def nbytes(self, n: int) -> int:
        return self.n_layer * self.n_head_kv * n * self.width * self.dtype.itemsize


@dataclass(slots=True)
class Segment:
    """K/V rows of one run of positions, in the pool's layout: `k`/`v` [n_layer, n_head_kv, n,
    head_dim] of the pool's own layers (a sliding-window pool's global ones) at `positions`;
    `swa` a sliding-window pool's sliding layers as (positions, k, v), only the window's
    positions; `draft` a draft model's rows at `positions`: (k, v) of each of its groups
    (memory/pool/draft.py: its attention layers', then a recurrent draft's conv rows)."""

    positions: list[int]
    k: torch.Tensor
    v: torch.Tensor
    swa: tuple[list[int], torch.Tensor, torch.Tensor] | None = None
    draft: tuple[torch.Tensor, ...] | None = None


def stored(rows: torch.Tensor, into: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rows as `into` stores them: a float dtype converted, a quantized row's bytes never (a
    uint8 row of another width, or floats into bytes, is another cache type: ValueError)."""
    if (rows.shape[-1] != into.shape[-1]
            or (torch.uint8 in (rows.dtype, into.dtype) and rows.dtype != into.dtype)):
        raise ValueError(f"rows {rows.dtype} of width {rows.shape[-1]} are not this pool's "
                         f"({into.dtype}, width {into.shape[-1]})")
    return rows.to(device, into.dtype)
