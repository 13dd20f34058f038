"""Where the model meets the pool: a forward over pool sequences (cells reserved in the pool
first, then the model runs). The pool itself is built from the model's layout by memory/
(`memory/front.py`'s `build_pool`; `engine/build.py`'s `model_pool` for a loaded model).

The model takes cell indices and positions only (model/forward.py) and memory/ knows nothing of
the model; this is the join for callers that hold a pool and simply want "run these tokens of
sequence s" - the one-shot generator, the engine micro-benchmark and tests. The engine reserves
through its per-slot owners instead (and steps with `seq_step` and `run`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.memory.front import Pool
from radixserve.model.forward import SeqStep, SwaStep, Transformer


@dataclass(slots=True)
class BatchSeq:
    """New tokens of pool sequence `seq`, at consecutive positions from `pos0`."""

    seq: int
    tokens: list[int]
    pos0: int
    n_logits: int = 1  # logits for the last n_logits tokens (0: none)


def seq_step(pool: Pool, seq: int, tokens: list[int], pos0: int, cells: list[int],
             n_logits: int = 1) -> SeqStep:
    """The forward's view of `seq` once `cells` (for `tokens` at pos0..) are allocated to it
    (in both parts of a sliding-window pool)."""
    view = pool.view(seq)
    step = SeqStep(tokens, pos0, cells, view.cells, view.positions, n_logits)
    window = pool.window_view(seq, list(range(pos0, pos0 + len(tokens))))
    if window is not None:
        step.swa = SwaStep(*window)
    return step


def run(tr: Transformer, pool: Pool, steps: list[SeqStep]) -> torch.Tensor:
    """`Transformer.hidden` over the pool's caches (both parts of a sliding-window pool)."""
    k, v, k_swa, v_swa = pool.caches()
    return tr.hidden(k, v, steps, k_swa, v_swa, types=pool.types)


def place(pool: Pool, batch: list[BatchSeq]) -> list[SeqStep]:
    """Give every sequence its new cells (all or nothing: OutOfCells leaves the pool as it
    was) and describe what each one attends over."""
    done: list[tuple[int, list[int]]] = []
    try:
        for b in batch:
            positions = list(range(b.pos0, b.pos0 + len(b.tokens)))
            done.append((b.seq, pool.alloc_step(b.seq, positions)))
    except Exception:
        for seq, cells in done:
            pool.seq_rm(seq, pool.cell_pos[cells[0]], pool.cell_pos[cells[-1]] + 1)
        raise
    return [seq_step(pool, b.seq, b.tokens, b.pos0, cells, b.n_logits)
            for b, (_, cells) in zip(batch, done)]


def hidden(tr: Transformer, pool: Pool, batch: list[BatchSeq]) -> torch.Tensor:
    """Output-normed hidden states of the rows to sample (`Transformer.hidden`); a sliding
    window's cells no later query reads are dropped after the step."""
    out = run(tr, pool, place(pool, batch))
    for b in batch:
        pool.prune(b.seq)
    return out


def forward(tr: Transformer, pool: Pool, batch: list[BatchSeq]) -> torch.Tensor:
    """Exact f32 logits [sum n_logits, V] of `batch`, its K/V stored in `pool`."""
    return tr.w.head.full(hidden(tr, pool, batch))

