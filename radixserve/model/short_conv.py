"""LFM2's short-convolution layer over the pool's window part (memory/pool/conv.py).

The layer (HF's Lfm2ShortConv, llama.cpp's build_shortconv_block): the in-projection gives
[B | C | x] for each token; the convolution's input row is B * x; the output row at position p
is C * sum_j w[:, j] * (B * x)[p - L + 1 + j] (a causal depthwise convolution of kernel length
L, zero before position 0); the out-projection follows (the layer's `wo`).

Each new token's input row is stored in the window part's cells (two halves: the part's K and
V of width n_embd / 2), then every output row reads its L input rows back from those cells, so
a token's arithmetic is the same whether its predecessors were computed in this step, an
earlier chunk or restored from a tier. The sum is in f32, one element at a time in a fixed order
of j: a token's bits do not depend on how many tokens a step holds (deterministic mode).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixserve.model.hparams import HParams

if TYPE_CHECKING:
    from radixserve.model.forward import SeqStep


class ShortConv:
    """One step's short-convolution plan, shared by every conv layer of the step."""

    def __init__(self, hp: HParams, k: torch.Tensor, v: torch.Tensor, new: torch.Tensor,
                 reads: torch.Tensor, valid: torch.Tensor) -> None:
        self.n_embd, self.l_cache = hp.n_embd, hp.l_cache
        self.k, self.v = k, v  # [n_layer_conv, 1, n_cells, n_embd / 2]
        self.new = new  # [T] the cells the step's input rows go to
        self.reads = reads  # [T * L] the cells each output row reads, j = 0..L-1 in order
        self.valid = valid  # [T, L, 1] False where the position is before 0

    @classmethod
    def plan(cls, hp: HParams, batch: list[SeqStep], k: torch.Tensor | None,
             v: torch.Tensor | None) -> ShortConv:
        """Where each token's input row goes and which L rows its output reads, from every
        step's `.swa` (the window part's cells; the new tokens' included)."""
        if k is None or v is None or any(b.swa is None for b in batch):
            raise ValueError("a model with short-convolution layers needs the pool's window "
                             "part and every step's .swa")
        L = hp.l_cache
        new: list[int] = []
        reads: list[int] = []
        valid: list[bool] = []
        for b in batch:
            w = b.swa
            assert w is not None
            cells = w.kv_cells
            cell_list = (list(range(cells.start, cells.stop)) if isinstance(cells, slice)
                         else cells.tolist())
            at = dict(zip(w.kv_positions, cell_list))
            new.extend(w.cells)
            for p in range(b.pos0, b.pos0 + len(b.tokens)):
                for q in range(p - L + 1, p + 1):
                    if q < 0:
                        reads.append(0)
                        valid.append(False)
                    elif q in at:
                        reads.append(at[q])
                        valid.append(True)
                    else:
                        raise ValueError(f"the window holds no input row at position {q} for "
                                         f"a token at {p}")
        dev = k.device
        return cls(hp, k, v, torch.tensor(new, dtype=torch.long, device=dev),
                   torch.tensor(reads, dtype=torch.long, device=dev),
                   torch.tensor(valid, device=dev).view(-1, L, 1))

    def run(self, ci: int, kernel: torch.Tensor, bcx: torch.Tensor) -> torch.Tensor:
        """Conv layer `ci` (its row in the window part) on the in-projection's rows bcx
        [T, 3 n_embd]; returns C * conv(B * x) [T, n_embd] in bcx's dtype (the out-projection's
        input)."""
        e, h, L = self.n_embd, self.n_embd // 2, self.l_cache
        b, c, x = bcx[:, :e], bcx[:, e:2 * e], bcx[:, 2 * e:]
        bx = b * x
        self.k[ci, 0, self.new] = bx[:, :h].to(self.k.dtype)
        self.v[ci, 0, self.new] = bx[:, h:].to(self.v.dtype)
        rows = torch.cat([self.k[ci, 0, self.reads], self.v[ci, 0, self.reads]], dim=-1)
        rows = rows.view(-1, L, e).float().masked_fill_(~self.valid, 0.0)
        acc = rows[:, 0] * kernel[:, 0]
        for j in range(1, L):
            acc.add_(rows[:, j] * kernel[:, j])
        return (c.float() * acc).to(bcx.dtype)
