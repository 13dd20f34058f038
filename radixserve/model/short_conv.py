"""LFM2's short-convolution layer over the pool's window part (memory/pool/conv.py).

The layer (HF's Lfm2ShortConv, llama.cpp's build_shortconv_block): the in-projection gives
[B | C | x] for each token; the convolution's input row is B * x; the output row at position p
is C * sum_j w[:, j] * (B * x)[p - L + 1 + j] (a causal depthwise convolution of kernel length
L, zero before position 0); the out-projection follows (the layer's `wo`).

Each new token's input row is stored in the window part's cells (two halves: the part's K and
V of width n_embd / 2), then every output row reads its L input rows back from those cells, so
a token's arithmetic is the same whether its predecessors were computed in this step, an
earlier chunk or restored from a tier. The sum is in f32, one element at a time in a fixed order
of j: a token's bits do not depend on how many tokens a step holds (deterministic mode). With
the kernels built and bf16 rows, one C call a layer does the same arithmetic (csrc/short_conv.c:
the same roundings, so the same bits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixserve.model.hparams import HParams
from radixserve.model.kernels import Kernels

if TYPE_CHECKING:
    from radixserve.model.forward import SeqStep


def _positions_to_cells(w: SeqStep, n: int) -> dict[int, int]:
    """The cell of each of the last `n` positions of the view `w` (kv_positions, kv_cells)."""
    positions, cells = w.kv_positions, w.kv_cells
    k0 = max(0, len(positions) - n)
    if isinstance(cells, slice):
        start = (cells.start or 0) + k0
        tail: list[int] = list(range(start, start + len(positions) - k0))
    else:
        tail = cells[k0:].tolist()
    return dict(zip(positions[k0:], tail))


class ShortConv:
    """One step's short-convolution plan, shared by every conv layer of the step."""

    def __init__(self, hp: HParams, k: torch.Tensor, v: torch.Tensor, new: torch.Tensor,
                 reads: torch.Tensor, kern: Kernels | None) -> None:
        self.n_embd, self.l_cache = hp.n_embd, hp.l_cache
        self.k, self.v = k, v  # [n_layer_conv, 1, n_cells, n_embd / 2]
        self.new = new  # [T] the cells the step's input rows go to
        self.reads = reads  # [T * L] the cells each output row reads, j = 0..L-1 in order
        # the C step where it applies (bf16 rows), else the torch ops of `run`
        self.kern = kern if kern is not None and k.dtype == torch.bfloat16 \
            and k.is_contiguous() and v.is_contiguous() else None
        if self.kern is None:
            self.valid = (reads >= 0).view(-1, hp.l_cache, 1)  # False: a position before 0
            self.cells = reads.clamp(min=0)

    @classmethod
    def plan(cls, hp: HParams, batch: list[SeqStep], k: torch.Tensor | None,
             v: torch.Tensor | None, kern: Kernels | None = None) -> ShortConv:
        """Where each token's input row goes and which L rows its output reads (-1: a position
        before 0), from every step's `.swa` (the window part's cells; the new tokens'
        included)."""
        if k is None or v is None or any(b.swa is None for b in batch):
            raise ValueError("a model with short-convolution layers needs the pool's window "
                             "part and every step's .swa")
        L = hp.l_cache
        new: list[int] = []
        reads: list[int] = []
        for b in batch:
            w = b.swa
            assert w is not None
            new.extend(w.cells)
            # the rows read are the view's last ones where its positions run in order (a
            # window; a draft's view of the whole sequence), else found in the whole view
            at = _positions_to_cells(w, len(b.tokens) + L - 1)
            for p in range(b.pos0, b.pos0 + len(b.tokens)):
                for q in range(p - L + 1, p + 1):
                    if q >= 0 and q not in at and len(at) < len(w.kv_positions):
                        at = _positions_to_cells(w, len(w.kv_positions))
                    if q < 0:
                        reads.append(-1)
                    elif q in at:
                        reads.append(at[q])
                    else:
                        raise ValueError(f"the window holds no input row at position {q} for "
                                         f"a token at {p}")
        if max(new + reads, default=0) >= k.shape[2]:  # the C step trusts every cell
            raise ValueError("a short-convolution step names a cell outside the window part")
        dev = k.device
        return cls(hp, k, v, torch.tensor(new, dtype=torch.long, device=dev),
                   torch.tensor(reads, dtype=torch.long, device=dev), kern)

    def run(self, ci: int, kernel: torch.Tensor, bcx: torch.Tensor) -> torch.Tensor:
        """Conv layer `ci` (its row in the window part) on the in-projection's rows bcx
        [T, 3 n_embd]; returns C * conv(B * x) [T, n_embd] in bcx's dtype (the out-projection's
        input)."""
        if self.kern is not None:
            return self.kern.short_conv(bcx.contiguous(), self.k[ci, 0], self.v[ci, 0],
                                        self.new, self.reads, kernel)
        e, h, L = self.n_embd, self.n_embd // 2, self.l_cache
        b, c, x = bcx[:, :e], bcx[:, e:2 * e], bcx[:, 2 * e:]
        bx = b * x
        self.k[ci, 0, self.new] = bx[:, :h].to(self.k.dtype)
        self.v[ci, 0, self.new] = bx[:, h:].to(self.v.dtype)
        rows = torch.cat([self.k[ci, 0, self.cells], self.v[ci, 0, self.cells]], dim=-1)
        rows = rows.view(-1, L, e).float().masked_fill_(~self.valid, 0.0)
        acc = rows[:, 0] * kernel[:, 0]
        for j in range(1, L):
            acc.add_(rows[:, j] * kernel[:, j])
        return (c.float() * acc).to(bcx.dtype)
