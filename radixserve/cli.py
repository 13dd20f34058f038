"""`radixserve serve | generate | perf | bench`; `serve` takes llama-server's command line."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Any

import torch

from radixserve.config import DTYPES, WEIGHTS
from radixserve.log_setup import setup_logging

if TYPE_CHECKING:
    from radixserve.model.kernel_config import KernelConfig


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default="default",
                   help="GGUF file, or 'default' for the bundled SmolLM2-135M (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="compute dtype; auto = bf16 where the CPU runs it fast (default: %(default)s)")
    p.add_argument("--weights", default="auto", choices=WEIGHTS,
                   help="native: Q4_0/Q4_1/Q4_K matrices run packed (our Q4 kernel, or torch's int4) and "
                        "the output head is re-scored exactly from an int8 pass; dequant: every "
                        "weight dense in the compute dtype; auto: native unless --dtype is f32 "
                        "(torch's int4 f32 path is slow) (default: %(default)s)")
    p.add_argument("-t", "--threads", type=int, default=-1,
                   help="CPU threads for compute, -1 = all cores (default: %(default)s)")
    p.add_argument("-s", "--seed", type=int, default=-1,
                   help="default sampling seed, -1 = random (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="radixserve", description=__doc__, allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter

    g = sub.add_parser("generate", help="complete one prompt and print it", formatter_class=fmt,
                       allow_abbrev=False)
    _model_args(g)
    g.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate, -1 = until EOS")
    g.add_argument("--temp", type=float, default=0.8, help="temperature, 0 = greedy")
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--min-p", type=float, default=0.05)
    g.add_argument("--repeat-penalty", type=float, default=1.0)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("prompt", help="the prompt text")

    sub.add_parser("serve", help="start the HTTP server (llama-server's flags: serve --help)",
                   add_help=False)
    sub.add_parser("cluster", help="replicas on Ray Serve, routed by prompt prefix "
                   "(cluster --help)", add_help=False)
    pf = sub.add_parser("perf", help="engine micro-benchmark (prefill/decode tok/s), prints JSON",
                        formatter_class=fmt, allow_abbrev=False)
    pf.add_argument("-m", "--model", default="default")
    pf.add_argument("--dtypes", default=None, help="compute dtypes, comma separated (default: "
                    "f32,bf16; auto with --routes)")
    pf.add_argument("--weights", default=None,
                    help="weight paths to measure, comma separated (default: auto,dequant; auto "
                         "with --routes)")
    pf.add_argument("--ctx", type=int, default=512, help="context of the decode figures")
    pf.add_argument("--batches", default="1,4",
                    help="decode batch sizes (sequences a step), comma separated")
    pf.add_argument("--device", default="cpu",
                    help="where the model runs, as serve's --device (auto, cpu, cuda[:N])")
    pf.add_argument("--repeats", type=int, default=3)
    pf.add_argument("--routes", action="store_true",
                    help="print the kernel route table for this CPU and which route each "
                         "layer matrix of the model takes (at the first of --dtypes and "
                         "--weights), then exit")
    pf.add_argument("--deterministic", default="auto",
                    help="deterministic modes to measure, comma separated (auto, on, off); "
                         "they take turns in one process")

    b = sub.add_parser("bench", help="HTTP benchmark scenarios (see radixserve.bench)",
                       add_help=False)
    b.add_argument("rest", nargs=argparse.REMAINDER)
    return ap


def settle_kernels() -> tuple[KernelConfig | None, str | None]:
    """Our kernels' configuration, settled once from the environment (RADIXSERVE_KERNELS,
    RADIXSERVE_KERNEL_CHECKS, CC, XDG_CACHE_HOME: model/kernel_config.py) and handed to the
    model's load, or what is wrong with it (an unknown value, a variant this CPU cannot run):
    checked before a command loads a model, so the message ends start-up rather than a model
    load on another thread."""
    from radixserve.model.kernel_build import KernelsError
    from radixserve.model.kernel_config import KernelConfig

    try:
        return KernelConfig.from_env(), None
    except KernelsError as e:
        return None, str(e)


def device_error(device: str, gpu_layers: str) -> str | None:
    """What is wrong with --device (a CUDA device torch cannot reach), or None: checked before
    `serve` loads the model, as the kernels are. A partial -ngl needs the model's layer count:
    the load refuses it."""
    from radixserve.model.device import DeviceError, resolve_device

    try:
        resolve_device(device, "0" if gpu_layers == "0" else "all", 1)
    except DeviceError as e:
        return str(e)
    return None


def is_router(parsed: Any) -> bool:
    """Router mode, as llama-server: --models-dir or --models-preset, and no model (-m or
    LLAMA_ARG_MODEL) of its own; with -m those two are ignored."""
    import os

    cfg = parsed.cfg
    if not (cfg.models_dir or cfg.models_preset):
        return False
    if parsed.seen & {"-m", "--model"} or "LLAMA_ARG_MODEL" in os.environ:
        logging.getLogger("radixserve.router").warning(
            "-m is given: --models-dir/--models-preset ignored (router mode needs no -m)")
        return False
    return True


def run_serve(argv: list[str]) -> int:
    """`radixserve serve`: llama-server's command line, parsed llama.cpp's way (flags/)."""
    from radixserve.flags import FlagError, FlagExit, parse_serve

    try:
        parsed = parse_serve(argv)
        parsed.cfg.validate()
    except FlagExit as e:
        print(e.text, end="")
        return 0
    except (FlagError, ValueError) as e:
        print(f"radixserve serve: error: {e}\n(run `radixserve serve --help` for the flags)",
              file=sys.stderr)
        return 1
    kernels, error = settle_kernels()
    error = error or device_error(parsed.cfg.device, parsed.cfg.gpu_layers)
    if error is not None:  # before listening: a server that cannot load never answers
        print(f"radixserve serve: error: {error}", file=sys.stderr)
        return 1
    cfg = parsed.cfg
    cfg.kernels = kernels
    setup_logging(cfg)
    for note in parsed.notes:
        logging.getLogger("radixserve.flags").warning("%s", note)
    if is_router(parsed):  # llama-server's router mode: no model here, one child server each
        from radixserve.router.app import serve_router

        return serve_router(cfg, argv)
    from radixserve.http.run import serve

    return serve(cfg)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the benchmark has its own parser (and --help)
        from radixserve.bench.cli import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["serve"]:
        return run_serve(argv[1:])
    kernels = None  # settled below for the commands that load a model (or start servers)
    if argv[:1] in (["cluster"], ["perf"], ["generate"]) and "-h" not in argv \
            and "--help" not in argv:
        kernels, error = settle_kernels()
        if error is not None:
            print(f"radixserve {argv[0]}: error: {error}", file=sys.stderr)
            return 1
    if argv[:1] == ["cluster"]:  # its own flags, then serve's (radixserve/cluster/cli.py)
        from radixserve.cluster.cli import main as cluster_main

        return cluster_main(argv[1:])
    ap = build_parser()
    a = ap.parse_args(argv)
    if getattr(a, "threads", -1) > 0 and a.cmd != "serve":  # serve: set on the engine thread
        torch.set_num_threads(a.threads)
    if a.cmd == "perf" and a.routes:
        from radixserve.perf import print_routes

        return print_routes(a.model, (a.dtypes or "auto").split(",")[0],
                            (a.weights or "auto").split(",")[0], kernels)
    if a.cmd == "perf":
        from radixserve.perf import main as perf_main

        a.dtypes, a.weights = a.dtypes or "f32,bf16", a.weights or "auto,dequant"
        try:
            batches = tuple(int(b) for b in a.batches.split(","))
            if min(batches) < 1:
                raise ValueError(f"--batches {a.batches}: each batch is 1 sequence or more")
            perf_main(a.model, a.dtypes.split(","), a.weights.split(","), a.repeats, a.ctx,
                      tuple(a.deterministic.split(",")), a.device, batches, kernels)
        except ValueError as e:  # a bad --batches, --device, or a weights mode it cannot run
            print(f"radixserve perf: error: {e}", file=sys.stderr)
            return 1
        return 0
    if a.cmd == "generate":
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        from radixserve.generate import run_generate
        from radixserve.model.loader import load_model
        from radixserve.sampling.chain import SamplingParams

        params = SamplingParams(temperature=a.temp, top_k=a.top_k, top_p=a.top_p,
                                min_p=a.min_p, repeat_penalty=a.repeat_penalty, seed=a.seed)
        try:
            params.validate()
            model = load_model(a.model, a.dtype, weights=a.weights, kernels=kernels)
            run_generate(model, a.prompt, a.n_predict, params, a.chat)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    ap.error(f"unknown command {a.cmd!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
