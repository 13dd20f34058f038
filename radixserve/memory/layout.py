"""A model's memory layout: what one token and one sequence need kept, by layer group.

The model family declares it (`Model.layout`); memory/ builds the pool from it (the one
factory, pool/factory.py's `build_pool`) and everyone who must know what kind of memory a pool
holds asks the layout the pool was built with (`pool.layout`), never the pool's class: a new
kind of memory then changes no caller, and does not inherit another kind's branches.

The contract
------------
A layout's author (a model family) states, and nothing else:

- `n_head_kv`, `head_dim`: the K/V row shape of its attention layers;
- `kinds`: each layer's group, in layer order: FULL (attention over every position), SLIDING
  (attention over the last `n_swa` positions) or CONV (a short convolution: a recurrent state
  of `conv_rows` input rows a sequence, each `conv_width` wide; llama.cpp's n_embd_r is
  conv_rows * conv_width). A layer's index in its group follows from the order (`place`);
- `n_swa` when there are SLIDING layers; `conv_rows` (the kernel length - 1) and `conv_width`
  when there are CONV layers.

At most one group keeps a window (SLIDING or CONV): a pool has one window part.

What the owner (seq_kv.py), the manager, slot files, the host tiers and the engine ask:

- `window`: how many positions of the windowed group a token reads, its own included (0: no
  group drops anything; a prefix held is usable whole);
- `needs_checkpoints`: a held prefix can lose rows its next token reads (the window slid), so
  context checkpoints are taken and restored (checkpoint.py);
- `can_shift`: held rows may move to other positions (context shift); a recurrent state exists
  only at the positions it was computed at, so it cannot;
- `shifts_chunks`: `--cache-reuse` may shift chunks of a slot's KV into place (every position's
  rows are held, and they can move);
- `rows_per_token`: attention layers whose K/V rows a token adds (a draft model's rows a cell);
- `state_per_sequence`: rows of recurrent state a conv layer keeps a sequence (0: none).

A layout as held (`held`) may differ from the one declared: `--swa-full` keeps the sliding
layers' K/V for every position, so they are held as FULL and there is no window.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

FULL, SLIDING, CONV = "full", "sliding", "conv"
KINDS = (FULL, SLIDING, CONV)


@dataclass(slots=True, frozen=True)
class MemoryLayout:
    n_head_kv: int
    head_dim: int
    kinds: tuple[str, ...]  # per layer: FULL, SLIDING or CONV
    n_swa: int = 0  # SLIDING layers' window in positions
    conv_rows: int = 0  # CONV layers' state: input rows a sequence (kernel length - 1)
    conv_width: int = 0  # ... each this wide (n_embd)

    def __post_init__(self) -> None:
        if unknown := set(self.kinds) - set(KINDS):
            raise ValueError(f"unknown layer groups {sorted(unknown)}")
        if self.n_sliding and self.n_conv:  # one window part a pool
            raise ValueError("sliding-window and short-convolution layers in one model")
        if self.n_sliding and self.n_swa <= 0:
            raise ValueError("sliding layers need a window n_swa > 0")
        if self.n_conv and (self.conv_rows < 1 or self.conv_width <= 0):
            raise ValueError("short-convolution layers need conv_rows >= 1 and a width")

    # -- the groups ----------------------------------------------------------------------------
    @property
    def n_full(self) -> int:
        return self.kinds.count(FULL)

    @property
    def n_sliding(self) -> int:
        return self.kinds.count(SLIDING)

    @property
    def n_conv(self) -> int:
        return self.kinds.count(CONV)

    def place(self, layer: int) -> tuple[str, int]:
        """The group of `layer` and its index among that group's layers."""
        kind = self.kinds[layer]
        return kind, self.kinds[:layer].count(kind)

    def held(self, swa_full: bool) -> MemoryLayout:
        """The layout a pool keeps: `--swa-full` holds the sliding layers as full ones."""
        if not swa_full or not self.n_sliding:
            return self
        return replace(self, kinds=tuple(FULL if k == SLIDING else k for k in self.kinds),
                       n_swa=0)

    # -- capabilities (the module's docstring) -----------------------------------------------
    @property
    def window(self) -> int:
        if self.n_sliding:
            return self.n_swa
        if self.n_conv:  # a token reads its own input row and the state's
            return self.conv_rows + 1
        return 0

    @property
    def needs_checkpoints(self) -> bool:
        return self.window > 0

    @property
    def can_shift(self) -> bool:
        return self.n_conv == 0

    @property
    def shifts_chunks(self) -> bool:
        return self.can_shift and self.window == 0

    @property
    def rows_per_token(self) -> int:
        return self.n_full + self.n_sliding

    @property
    def state_per_sequence(self) -> int:
        return self.conv_rows
