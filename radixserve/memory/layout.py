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
  when there are CONV layers; `state_width` when there are RECURRENT layers (a Gated DeltaNet
  or Mamba2: a state a sequence that is no function of a few rows, kept whole: each half of a
  layer's state cell, in f32 floats).

At most one group keeps a window (SLIDING, CONV or RECURRENT): a pool has one window part. A
RECURRENT layer's window is one position: the state after the sequence's last token, which
exists only where it was computed and is carried from there as a snapshot (a checkpoint).

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
- `state_per_sequence`: rows of recurrent state a conv layer keeps a sequence (0: none);
- `state_bytes`: a RECURRENT layout's state cell a sequence, in bytes;
- `rows_every_position`: the windowed group has a row for every position (a host tier that
  keeps per-token rows, the radix tree, can hold its memory); False for a RECURRENT state,
  which only snapshots carry;
- `rollback_recomputes`: a step cannot be cut back to one of its own positions (a rejected
  draft): what a later token reads there was never written, since a RECURRENT state is
  written after the step's last position only; so a rollback inside a step goes back to the
  state the step read, before its first position, and its kept tokens are computed again
  (engine/speculative.py). False where every position's rows (or a window of them) are kept.

A layout as held (`held`) may differ from the one declared: `--swa-full` keeps the sliding
layers' K/V for every position, so they are held as FULL and there is no window.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

FULL, SLIDING, CONV, RECURRENT = "full", "sliding", "conv", "recurrent"
KINDS = (FULL, SLIDING, CONV, RECURRENT)


@dataclass(slots=True, frozen=True)
class MemoryLayout:
    n_head_kv: int
    head_dim: int
    kinds: tuple[str, ...]  # per layer: FULL, SLIDING or CONV
    n_swa: int = 0  # SLIDING layers' window in positions
    conv_rows: int = 0  # CONV layers' state: input rows a sequence (kernel length - 1)
    conv_width: int = 0  # ... each this wide (n_embd)
    state_width: int = 0  # RECURRENT layers' state cell: f32 floats of each of its halves

    def __post_init__(self) -> None:
        if unknown := set(self.kinds) - set(KINDS):
            raise ValueError(f"unknown layer groups {sorted(unknown)}")
        if (self.n_sliding > 0) + (self.n_conv > 0) + (self.n_recurrent > 0) > 1:
            raise ValueError("two windowed layer groups (sliding, short-convolution, "
                             "recurrent) in one model")  # one window part a pool
        if self.n_sliding and self.n_swa <= 0:
            raise ValueError("sliding layers need a window n_swa > 0")
        if self.n_conv and (self.conv_rows < 1 or self.conv_width <= 0):
            raise ValueError("short-convolution layers need conv_rows >= 1 and a width")
        if self.n_recurrent and self.state_width <= 0:
            raise ValueError("recurrent layers need a state_width")

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

    @property
    def n_recurrent(self) -> int:
        return self.kinds.count(RECURRENT)

    @property
    def n_state(self) -> int:
        """Layers that keep a recurrent state instead of rows (CONV and RECURRENT)."""
        return self.n_conv + self.n_recurrent

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
        if self.n_recurrent:  # a token reads the state after the token before it
            return 2
        return 0

    @property
    def needs_checkpoints(self) -> bool:
        return self.window > 0

    @property
    def can_shift(self) -> bool:
        return self.n_conv == 0 and self.n_recurrent == 0

    @property
    def shifts_chunks(self) -> bool:
        return self.can_shift and self.window == 0

    @property
    def rows_per_token(self) -> int:
        return self.n_full + self.n_sliding

    @property
    def state_per_sequence(self) -> int:
        return self.conv_rows

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's recurrent state cell, every RECURRENT layer (f32 halves)."""
        return self.n_recurrent * 2 * self.state_width * 4

    @property
    def rows_every_position(self) -> bool:
        return self.n_recurrent == 0

    @property
    def rollback_recomputes(self) -> bool:
        return self.n_recurrent > 0
