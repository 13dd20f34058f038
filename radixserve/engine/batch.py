"""Where the model meets the pool: the pool a loaded model needs (`model_pool`), and a forward
over pool sequences (cells reserved in the pool first, then the model runs).

The model takes cell indices and positions only (model/forward.py) and kv/ knows nothing of the
model; this is the join for callers that hold a `KVPool` and simply want "run these tokens of
sequence s" - the one-shot generator, the engine micro-benchmark and tests. The engine reserves
through its per-slot owners instead (and steps with `seq_step` and `run`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.memory.pool.conv import ConvPool
from radixserve.memory.pool.pool import KVPool, KVTypes
from radixserve.memory.pool.swa import alloc_step, make_pool
from radixserve.model.forward import SeqStep, SwaStep, Transformer
from radixserve.model.loader import Model


@dataclass(slots=True)
class BatchSeq:
    """New tokens of pool sequence `seq`, at consecutive positions from `pos0`."""

    seq: int
    tokens: list[int]
    pos0: int
    n_logits: int = 1  # logits for the last n_logits tokens (0: none)


def seq_step(pool: KVPool, seq: int, tokens: list[int], pos0: int, cells: list[int],
             n_logits: int = 1) -> SeqStep:
    """The forward's view of `seq` once `cells` (for `tokens` at pos0..) are allocated to it
    (in both parts of a sliding-window pool)."""
    view = pool.view(seq)
    step = SeqStep(tokens, pos0, cells, view.cells, view.positions, n_logits)
    window = pool.window_view(seq, list(range(pos0, pos0 + len(tokens))))
    if window is not None:
        step.swa = SwaStep(*window)
    return step


def run(tr: Transformer, pool: KVPool, steps: list[SeqStep]) -> torch.Tensor:
    """`Transformer.hidden` over the pool's caches (both parts of a sliding-window pool)."""
    k, v, k_swa, v_swa = pool.caches()
    return tr.hidden(k, v, steps, k_swa, v_swa, types=pool.types)


def place(pool: KVPool, batch: list[BatchSeq]) -> list[SeqStep]:
    """Give every sequence its new cells (all or nothing: OutOfCells leaves the pool as it
    was) and describe what each one attends over."""
    done: list[tuple[int, list[int]]] = []
    try:
        for b in batch:
            positions = list(range(b.pos0, b.pos0 + len(b.tokens)))
            done.append((b.seq, alloc_step(pool, b.seq, positions)))
    except Exception:
        for seq, cells in done:
            pool.seq_rm(seq, pool.cell_pos[cells[0]], pool.cell_pos[cells[-1]] + 1)
        raise
    return [seq_step(pool, b.seq, b.tokens, b.pos0, cells, b.n_logits)
            for b, (_, cells) in zip(batch, done)]


def hidden(tr: Transformer, pool: KVPool, batch: list[BatchSeq]) -> torch.Tensor:
    """Output-normed hidden states of the rows to sample (`Transformer.hidden`); a sliding
    window's cells no later query reads are dropped after the step."""
    out = run(tr, pool, place(pool, batch))
    for b in batch:
        pool.prune(b.seq)
    return out


def forward(tr: Transformer, pool: KVPool, batch: list[BatchSeq]) -> torch.Tensor:
    """Exact f32 logits [sum n_logits, V] of `batch`, its K/V stored in `pool`."""
    return tr.w.head.full(hidden(tr, pool, batch))


def model_pool(model: Model, n_cells: int, n_seq: int, unified: bool, n_step: int,
               swa_full: bool = False, types: KVTypes | None = None) -> KVPool:
    """The pool a loaded model needs: `make_pool`'s, or the short-convolution layout for a
    model with conv layers (`swa_full` is for sliding attention only); `n_step`: the most new tokens one forward holds;
    `types`: the K and V cache types (`-ctk` / `-ctv`; None: the compute dtype)."""
    hp = model.hp
    if hp.n_layer_conv:
        return ConvPool(hp.n_layer - hp.n_layer_conv, hp.n_layer_conv, hp.n_head_kv,
                        hp.head_dim, hp.n_embd, hp.l_cache, n_cells, n_seq, unified,
                        model.dtype, model.rope.rotate, n_step, model.device, types)
    return make_pool(hp.n_layer, hp.swa_layers, hp.n_swa, swa_full, hp.n_head_kv, hp.head_dim,
                     n_cells, n_seq, unified, model.dtype, model.rope.rotate,
                     model.rope_swa.rotate, n_step, model.device, types)
