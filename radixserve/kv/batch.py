"""A forward over pool sequences: cells reserved in the pool first, then the model runs.

The model takes cell indices and positions only (model/forward.py); this is the join for callers
that hold a `KVPool` and simply want "run these tokens of sequence s" - the one-shot generator,
the engine micro-benchmark and tests. The engine reserves through its per-slot owners instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.kv.pool import KVPool
from radixserve.model.forward import SeqStep, Transformer


@dataclass(slots=True)
class BatchSeq:
    """New tokens of pool sequence `seq`, at consecutive positions from `pos0`."""

    seq: int
    tokens: list[int]
    pos0: int
    n_logits: int = 1  # logits for the last n_logits tokens (0: none)


def seq_step(pool: KVPool, seq: int, tokens: list[int], pos0: int, cells: list[int],
             n_logits: int = 1) -> SeqStep:
    """The forward's view of `seq` once `cells` (for `tokens` at pos0..) are allocated to it."""
    view = pool.view(seq)
    return SeqStep(tokens, pos0, cells, view.cells, view.positions, n_logits)


def place(pool: KVPool, batch: list[BatchSeq]) -> list[SeqStep]:
    """Give every sequence its new cells (all or nothing: OutOfCells leaves the pool as it
    was) and describe what each one attends over."""
    cells = pool.alloc_batch([(b.seq, list(range(b.pos0, b.pos0 + len(b.tokens))))
                              for b in batch])
    steps, at = [], 0
    for b in batch:
        n = len(b.tokens)
        steps.append(seq_step(pool, b.seq, b.tokens, b.pos0, cells[at : at + n], b.n_logits))
        at += n
    return steps


def hidden(tr: Transformer, pool: KVPool, batch: list[BatchSeq]) -> torch.Tensor:
    """Output-normed hidden states of the rows to sample (`Transformer.hidden`)."""
    return tr.hidden(pool.k, pool.v, place(pool, batch))


def forward(tr: Transformer, pool: KVPool, batch: list[BatchSeq]) -> torch.Tensor:
    """Exact f32 logits [sum n_logits, V] of `batch`, its K/V stored in `pool`."""
    return tr.w.head.full(hidden(tr, pool, batch))
