"""`radixserve perf`: engine micro-benchmark (no HTTP): prefill and decode tok/s, load, RSS.

Prints one JSON object per dtype. Figures are medians over `repeats`; quote them with the
machine and the command (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import json
import platform
import resource
import statistics
import time

import torch

from radixserve.kv.pool import KVPool
from radixserve.model.forward import BatchSeq
from radixserve.model.loader import Model, load_model


def _pool(model: Model, n_cells: int, n_seq: int) -> KVPool:
    hp = model.hp
    return KVPool(hp.n_layer, hp.n_head_kv, hp.head_dim, n_cells, n_seq, False, model.dtype,
                  model.rope.rotate, model.device)


def _tokens(n: int, salt: int = 0) -> list[int]:
    return [100 + (i * 7919 + salt * 104729) % 40000 for i in range(n)]


def prefill_tps(model: Model, n: int, chunk: int = 512) -> float:
    pool = _pool(model, n + 16, 1)
    ids = _tokens(n)
    t = time.perf_counter()
    for s in range(0, n, chunk):
        model.transformer.forward(pool, [BatchSeq(0, ids[s : s + chunk], s)])
    return n / (time.perf_counter() - t)


def decode_tps(model: Model, batch: int, ctx: int = 512, steps: int = 32) -> float:
    pool = _pool(model, (ctx + steps + 8) * batch, batch)
    for s in range(batch):
        model.transformer.forward(pool, [BatchSeq(s, _tokens(ctx, s), 0)])
    tok = [[5] for _ in range(batch)]
    t = time.perf_counter()
    for i in range(steps):
        model.transformer.forward(pool, [BatchSeq(s, tok[s], ctx + i) for s in range(batch)])
    return batch * steps / (time.perf_counter() - t)


def run(model_path: str, dtype: str, repeats: int) -> dict:
    model = load_model(model_path, dtype)
    fig: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name, fn in (
            ("prefill_512_tok_s", lambda: prefill_tps(model, 512)),
            ("prefill_2048_tok_s", lambda: prefill_tps(model, 2048)),
            ("decode_b1_tok_s", lambda: decode_tps(model, 1)),
            ("decode_b4_tok_s", lambda: decode_tps(model, 4)),
        ):
            fig.setdefault(name, []).append(fn())
    return {
        "model": model.name,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "load_s": round(model.load_s, 3),
        **{k: round(statistics.median(v), 1) for k, v in fig.items()},
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "repeats": repeats,
    }


def main(model_path: str, dtypes: list[str], repeats: int) -> int:
    for dt in dtypes:
        print(json.dumps(run(model_path, dt, repeats)), flush=True)
    return 0
