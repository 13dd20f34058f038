"""`radixserve perf`: engine micro-benchmark (no HTTP): prefill and decode tok/s, load, RSS.

Prints one JSON object per (dtype, weights) pair, each measured in a fresh process so RSS after
load belongs to that path alone. Decode steps sample greedily through the same head as the
server (model/head.py). Figures are medians over `repeats`; quote them with the machine and the
command (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import json
import multiprocessing
import platform
import resource
import statistics
import time
from dataclasses import replace

import psutil
import torch

from radixserve.engine.batch import BatchSeq, hidden
from radixserve.engine.build import model_pool
from radixserve.memory.front import Pool
from radixserve.model.device import device_name, resolve_device
from radixserve.model.forward import Transformer
from radixserve.model.head import RowNeed
from radixserve.model.kernel_config import KernelConfig
from radixserve.model.kernels import variant_name
from radixserve.model.loader import Model, load_model, resolve_dtype, resolve_weights


def _pool(model: Model, n_cells: int, n_seq: int) -> Pool:
    return model_pool(model, n_cells, n_seq, False, 512 * n_seq)


def _tokens(n: int, salt: int = 0) -> list[int]:
    return [100 + (i * 7919 + salt * 104729) % 40000 for i in range(n)]


def prefill_tps(model: Model, n: int, chunk: int = 512) -> float:
    pool = _pool(model, n + 16, 1)
    ids = _tokens(n)
    tr = model.transformer
    t = time.perf_counter()
    for s in range(0, n, chunk):
        h = hidden(tr, pool, [BatchSeq(0, ids[s : s + chunk], s)])
    tr.w.head.logits(h, [RowNeed(1)])
    return n / (time.perf_counter() - t)


def decode_tps(model: Model, batch: int, ctx: int = 512, steps: int = 32) -> float:
    """Greedy decode of `batch` sequences with `ctx` tokens of context each, one token per
    sequence per step, through the server's head (sampling included)."""
    tr = model.transformer
    pool = _pool(model, (ctx + steps + 8) * batch, batch)
    for s in range(batch):
        ids = _tokens(ctx, s)
        for c in range(0, ctx, 512):
            hidden(tr, pool, [BatchSeq(s, ids[c : c + 512], c, 0)])
    tok = [5] * batch
    needs = [RowNeed(1)] * batch
    t = time.perf_counter()
    for i in range(steps):
        h = hidden(tr, pool, [BatchSeq(s, [tok[s]], ctx + i) for s in range(batch)])
        tok = tr.w.head.logits(h, needs).argmax(1).tolist()
    return batch * steps / (time.perf_counter() - t)


def run(model_path: str, dtype: str, weights: str, repeats: int, ctx: int,
        modes: tuple[str, ...] = ("auto",), device: str = "cpu",
        batches: tuple[int, ...] = (1, 4), kernels: KernelConfig | None = None) -> list[dict]:
    """One figure set per deterministic mode (on the kernels `kernels`, as cli.py settled
    them); the modes share the loaded weights and take turns within each repeat, so their
    ratios come from the same minutes of this machine.
    Each figure ends in a host read (the head's logits, the sampled ids), so a device's
    queued work is inside the timing."""
    model = load_model(model_path, dtype, device=device, weights=weights,
                       deterministic=modes[0], kernels=kernels)
    rss_load = psutil.Process().memory_info().rss / 2**20
    on_cpu = model.device.type == "cpu"
    models = [model] + [
        replace(model, transformer=Transformer(model.hp, model.transformer.w, model.dtype,
                                               kern=model.transformer.kern,
                                               deterministic=m))
        for m in modes[1:]]
    figs: list[dict[str, list[float]]] = [{} for _ in models]
    if not on_cpu:  # a GPU's first calls load kernels and plan its libraries: not timed
        for m in models:
            prefill_tps(m, 512)
            decode_tps(m, max(batches), ctx, steps=4)
    for _ in range(repeats):
        for m, fig in zip(models, figs):
            for name, fn in (
                ("prefill_512_tok_s", lambda: prefill_tps(m, 512)),
                ("prefill_2048_tok_s", lambda: prefill_tps(m, 2048)),
                *((f"decode_b{b}_tok_s_ctx{ctx}", lambda b=b: decode_tps(m, b, ctx))
                  for b in batches),
            ):
                fig.setdefault(name, []).append(fn())
    return [_figures(m, dtype, fig, rss_load, repeats) for m, fig in zip(models, figs)]


def _figures(model: Model, dtype: str, fig: dict[str, list[float]], rss_load: float,
             repeats: int) -> dict:
    return {
        "model": model.name,
        "dtype": dtype,
        "weights": model.weights,
        "deterministic": model.deterministic,
        # our C step kernels' variant (model/kernels.py), "none" for torch's ops
        # (RADIXSERVE_KERNELS=0, f32 compute); RADIXSERVE_KERNELS=avx2 etc. measures another
        "kernels": variant_name(model.transformer.kern),
        "device": device_name(model.device),
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "load_s": round(model.load_s, 3),
        "weights_mib": round(model.transformer.w.nbytes / 2**20, 1),
        "rss_after_load_mib": round(rss_load, 1),
        **{k: round(statistics.median(v), 1) for k, v in fig.items()},
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "repeats": repeats,
    }


def _run_in_child(args: tuple, out: multiprocessing.Queue) -> None:
    torch.set_num_threads(args[-1])
    out.put(run(*args[:-1]))


def main(model_path: str, dtypes: list[str], weights: list[str], repeats: int,
         ctx: int = 512, modes: tuple[str, ...] = ("auto",), device: str = "cpu",
         batches: tuple[int, ...] = (1, 4), kernels: KernelConfig | None = None) -> int:
    ctx_mp = multiprocessing.get_context("spawn")
    dev = resolve_device(device, "auto", 1)  # -ngl auto: the layer count does not matter
    kernels = kernels if kernels is not None else KernelConfig.from_env()
    kern = kernels.load() if dev.type == "cpu" else None  # what load_model would give
    seen = set()
    for dt in dtypes:
        for w in weights:
            key = (dt, resolve_weights(w, resolve_dtype(dt, dev, kern), dev))
            if key in seen:
                continue
            seen.add(key)
            q: multiprocessing.Queue = ctx_mp.Queue()
            p = ctx_mp.Process(target=_run_in_child,
                               args=((model_path, *key, repeats, ctx, modes, str(dev), batches,
                                      kernels, torch.get_num_threads()), q))
            p.start()
            for fig in q.get():
                print(json.dumps(fig), flush=True)
            p.join()
    return 0


def print_routes(model_path: str, dtype: str, weights: str,
                 kernels: KernelConfig | None = None) -> int:
    """`radixserve perf --routes`: the route table's rows for this CPU's kernel build, then the
    route of each layer matrix of the loaded model."""
    from radixserve.model.kernel_routes import build_of, table_text

    model = load_model(model_path, dtype=dtype, weights=weights, kernels=kernels)
    kern = model.transformer.kern
    build = build_of(kern.variant if kern is not None else None, model.dtype)
    dense = ": every type takes the 'other' row" if model.weights == "dequant" else ""
    print(f"kernel build: {build} (RADIXSERVE_KERNELS; compute {model.dtype}, "
          f"{model.weights} weights{dense})")
    print(table_text(build))
    print(f"{model.name}:  (held: the bytes the layers' matrices take in memory, the file-rows "
          f"route's as the mapped file's pages once read; file: in the GGUF)")
    w = model.transformer.w
    held, file = w.route_bytes(), layer_file_bytes(model_path)
    for name, routes in w.routes().items():
        size = f"held {held[name] / 2**20:.1f} MiB, file {file.get(name, 0) / 2**20:.1f} MiB"
        print(f"  {name:<10} " + ", ".join(f"{r} x{n}" for r, n in routes.items()) + f"  {size}")
    return 0


# the GGUF tensors each layer matrix is made of (a fused one of several)
_PARTS = {"wqkv": ("attn_q", "attn_k", "attn_v", "attn_qkv", "shortconv.in_proj"),
          "wo": ("attn_output", "shortconv.out_proj"),
          "w_gate_up": ("ffn_gate", "ffn_up"), "w_down": ("ffn_down",),
          "ffn_router": ("ffn_gate_inp",), "ffn_gate_up_exps": ("ffn_gate_exps", "ffn_up_exps"),
          "ffn_down_exps": ("ffn_down_exps",)}


def layer_file_bytes(model_path: str) -> dict[str, int]:
    """Bytes each layer matrix takes in the GGUF over all layers, {matrix: bytes}."""
    import gguf

    out: dict[str, int] = {}
    for t in gguf.GGUFReader(model_path).tensors:
        parts = t.name.split(".")
        if len(parts) >= 4 and parts[0] == "blk" and parts[-1] == "weight":
            for name, kinds in _PARTS.items():
                if ".".join(parts[2:-1]) in kinds:
                    out[name] = out.get(name, 0) + int(t.n_bytes)
    return out
