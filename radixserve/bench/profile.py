"""Where a prefill's time goes: `python -m radixserve.bench.profile MODEL.gguf [--prompt N]
[--chunk C]`.

Runs one prompt of N random tokens through the model in chunks of C (as the server's prefill
does with `-ub C`), timing every call into our C kernels by entry point, and prints each
group's share of the wall time: the matmuls (the tiles with 8-bit activations, the file's
blocks, dense bf16), attention over the context (with RoPE and the K/V store), norms and
gates, the output head, and the rest (Python, torch's ops and the glue between kernels). A
warm-up chunk runs first, untimed. One JSON object, and a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

import torch

# the C entry points (model/cabi.py) by what they do
GROUPS = {
    "matmul: tiles, 8-bit activations": ("i8a_matmul",),
    "matmul: file's blocks": ("qmm_bf16",),
    "matmul: dense bf16": ("bf16_matmul",),
    "attention (RoPE, K/V store)": ("attn_step_win_bf16", "attn_causal_win_bf16",
                                    "kv_store_rows_bf16", "attn_head_norm_bf16"),
    "norms and gates": ("add_rms_norm_bf16", "post_norm_add_bf16", "silu_mul_bf16",
                        "gelu_mul_bf16", "short_conv_bf16"),
    "output head": ("int8_head", "int8_head_bound", "head_candidates", "f32_head_dots",
                    "qmm_head_dots"),
}


def timed(kern, spent: dict[str, float]) -> None:
    """Every entry point of the kernels' binding (model/cabi.py's bind, which every caller
    shares), and the ones `kern` holds, wrapped to add its wall time to spent[name]."""
    from radixserve.model.cabi import bind

    ns = bind(kern.lib)
    wrapped = {}
    for name, fn in list(vars(ns).items()):
        def wrap(*args, _fn=fn, _name=name):
            t = time.perf_counter()
            try:
                return _fn(*args)
            finally:
                spent[_name] += time.perf_counter() - t
        wrapped[id(fn)] = wrap
        setattr(ns, name, wrap)
    for attr, value in list(vars(kern).items()):
        if id(value) in wrapped:
            setattr(kern, attr, wrapped[id(value)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=1600, help="prompt tokens")
    ap.add_argument("--chunk", type=int, default=512, help="tokens a forward")
    args = ap.parse_args(argv)
    from radixserve.engine.batch import BatchSeq, hidden
    from radixserve.engine.build import model_pool
    from radixserve.model.kernel_config import KernelConfig
    from radixserve.model.loader import load_model

    kernels = KernelConfig.from_env()  # this tool's start-up: RADIXSERVE_KERNELS and siblings
    kern = kernels.load()
    if kern is None:
        raise SystemExit("no kernels of ours run here: nothing to profile by entry point")
    spent: dict[str, float] = defaultdict(float)
    timed(kern, spent)
    model = load_model(args.model, "bf16", weights="native", kernels=kernels)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.hp.n_vocab - 100, (args.prompt + args.chunk,),
                        generator=g).tolist()
    pool = model_pool(model, len(ids) + 1, 2, True, args.chunk)
    tr = model.transformer
    hidden(tr, pool, [BatchSeq(1, ids[: args.chunk], 0)])  # warm-up, untimed
    spent.clear()
    t0 = time.perf_counter()
    for s in range(0, args.prompt, args.chunk):
        part = ids[args.chunk + s: args.chunk + min(s + args.chunk, args.prompt)]
        hidden(tr, pool, [BatchSeq(0, part, s)])
    wall = time.perf_counter() - t0
    shares = {g: sum(spent.get(n, 0.0) for n in names) for g, names in GROUPS.items()}
    known = {n for names in GROUPS.values() for n in names}
    other_c = sum(v for n, v in spent.items() if n not in known)
    shares["other kernels"] = other_c
    shares["the rest (Python, torch ops, glue)"] = wall - sum(shares.values())
    out = {"model": model.name, "kernels": kern.variant, "prompt": args.prompt,
           "chunk": args.chunk, "prefill_tok_s": round(args.prompt / wall, 1),
           "seconds": {k: round(v, 3) for k, v in shares.items()}}
    print(json.dumps(out))
    for k, v in shares.items():
        print(f"{k:<40} {v:8.3f} s {100 * v / wall:6.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
