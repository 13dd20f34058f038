"""`radixserve serve | generate | perf | bench` with llama-server's flag names."""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from radixserve.config import DTYPES, WEIGHTS, ServerConfig


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


def _on_off(v: str) -> bool:
    if v.lower() in ("on", "true", "1", "yes"):
        return True
    if v.lower() in ("off", "false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on|off, got {v!r}")


def build_parser() -> argparse.ArgumentParser:
    d = ServerConfig()
    ap = argparse.ArgumentParser(prog="radixserve", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter

    g = sub.add_parser("generate", help="complete one prompt and print it", formatter_class=fmt)
    _model_args(g)
    g.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate, -1 = until EOS")
    g.add_argument("--temp", type=float, default=0.8, help="temperature, 0 = greedy")
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--min-p", type=float, default=0.05)
    g.add_argument("--repeat-penalty", type=float, default=1.0)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("prompt", help="the prompt text")

    s = sub.add_parser("serve", help="start the HTTP server", formatter_class=fmt)
    _model_args(s)
    s.add_argument("--host", default=d.host, help="address to listen on")
    s.add_argument("--port", type=int, default=d.port, help="port to listen on")
    s.add_argument("-a", "--alias", default=None, help="model name reported by the API")
    s.add_argument("-c", "--ctx-size", type=int, default=0,
                   help="KV cells in total, 0 = the model's training context")
    s.add_argument("-np", "--parallel", type=int, default=-1,
                   help="number of slots, -1 = auto (4 slots, unified KV)")
    s.add_argument("-kvu", "--kv-unified", action="store_true", default=False,
                   help="all slots draw KV cells from one shared pool")
    s.add_argument("--kv-unified-per-slot", type=int, default=d.kv_unified_per_slot,
                   help="with --kv-unified: cap of one slot's context, 0 = no cap")
    s.add_argument("-b", "--batch-size", type=int, default=d.batch_size,
                   help="logical batch size; a step holds at most min(-b, -ub) tokens")
    s.add_argument("-ub", "--ubatch-size", type=int, default=d.ubatch_size,
                   help="tokens per forward step (prefill chunk + decode tokens)")
    s.add_argument("-sps", "--slot-prompt-similarity", type=float,
                   default=d.slot_prompt_similarity,
                   help="reuse an idle slot whose prompt shares more than this fraction, 0 = off")
    s.add_argument("--cache-reuse", type=int, default=d.cache_reuse,
                   help="min chunk size to reuse from the slot's KV via shifting, 0 = off")
    s.add_argument("--no-cache-prompt", dest="cache_prompt", action="store_false",
                   help="requests default to cache_prompt=false")
    s.add_argument("--api-key", default=None, help="API key(s), comma separated")
    s.add_argument("--slots", dest="slots", action="store_true", default=True,
                   help="enable GET /slots")
    s.add_argument("--no-slots", dest="slots", action="store_false",
                   help="disable GET /slots")
    s.add_argument("--metrics", action="store_true", help="enable GET /metrics")
    s.add_argument("-cram", "--cache-ram", type=int, default=d.cache_ram_mib,
                   help="host prompt cache size in MiB, -1 = no limit, 0 = off")
    s.add_argument("--cache-idle-slots", dest="cache_idle_slots", action="store_true", default=True,
                   help="save idle slots to the host cache when a new task starts")
    s.add_argument("--no-cache-idle-slots", dest="cache_idle_slots", action="store_false",
                   help="keep idle slots out of the host cache")
    s.add_argument("--cache-radix-prompt", type=_on_off, default=True, metavar="on|off",
                   help="radix-tree backend for the host prompt cache")
    s.add_argument("--cache-radix-min-restore-tokens", type=int,
                   default=d.cache_radix_min_restore_tokens,
                   help="restore from the radix cache only when at least this many tokens match")
    s.add_argument("--slot-save-path", default=None, help="directory for slot save/restore files")
    s.add_argument("-n", "--n-predict", type=int, default=-1, help="default max tokens per request")
    s.add_argument("-lv", "--log-verbosity", type=int, default=d.log_verbosity,
                   help="0 errors .. 4 debug")
    s.add_argument("-v", "--verbose", action="store_true", help="same as --log-verbosity 4")

    pf = sub.add_parser("perf", help="engine micro-benchmark (prefill/decode tok/s), prints JSON",
                        formatter_class=fmt)
    pf.add_argument("-m", "--model", default="default")
    pf.add_argument("--dtypes", default="f32,bf16")
    pf.add_argument("--weights", default="auto,dequant",
                    help="weight paths to measure, comma separated")
    pf.add_argument("--ctx", type=int, default=512, help="context of the decode figures")
    pf.add_argument("--repeats", type=int, default=3)

    b = sub.add_parser("bench", help="HTTP benchmark scenarios (see radixserve.bench)",
                       add_help=False)
    b.add_argument("rest", nargs=argparse.REMAINDER)
    return ap


def config_from_args(a: argparse.Namespace) -> ServerConfig:
    cfg = ServerConfig(
        model=a.model, alias=a.alias, dtype=a.dtype, weights=a.weights, threads=a.threads,
        seed=a.seed, host=a.host, port=a.port,
        api_key=[k for k in (a.api_key or "").split(",") if k],
        ctx_size=a.ctx_size, n_parallel=a.parallel, kv_unified=a.kv_unified,
        kv_unified_per_slot=a.kv_unified_per_slot, batch_size=a.batch_size,
        ubatch_size=a.ubatch_size, slot_prompt_similarity=a.slot_prompt_similarity,
        cache_reuse=a.cache_reuse, cache_prompt=a.cache_prompt, slots_endpoint=a.slots,
        metrics=a.metrics, log_verbosity=4 if a.verbose else a.log_verbosity,
        cache_ram_mib=a.cache_ram, cache_idle_slots=a.cache_idle_slots,
        cache_radix_prompt=a.cache_radix_prompt,
        cache_radix_min_restore_tokens=a.cache_radix_min_restore_tokens,
        slot_save_path=a.slot_save_path, n_predict=a.n_predict,
    )
    cfg.validate()
    return cfg


def _log_level(verbosity: int) -> int:
    return [logging.ERROR, logging.WARNING, logging.WARNING, logging.INFO, logging.DEBUG][
        max(0, min(verbosity, 4))
    ]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the benchmark has its own parser (and --help)
        from radixserve.bench.cli import main as bench_main

        return bench_main(argv[1:])
    ap = build_parser()
    a = ap.parse_args(argv)
    if getattr(a, "threads", -1) > 0 and a.cmd != "serve":  # serve: set on the engine thread
        torch.set_num_threads(a.threads)
    if a.cmd == "perf":
        from radixserve.perf import main as perf_main

        return perf_main(a.model, a.dtypes.split(","), a.weights.split(","), a.repeats, a.ctx)
    if a.cmd == "generate":
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        from radixserve.generate import run_generate
        from radixserve.model.loader import load_model
        from radixserve.model.sampling import SamplingParams

        params = SamplingParams(temperature=a.temp, top_k=a.top_k, top_p=a.top_p,
                                min_p=a.min_p, repeat_penalty=a.repeat_penalty, seed=a.seed)
        try:
            params.validate()
            model = load_model(a.model, a.dtype, weights=a.weights)
            run_generate(model, a.prompt, a.n_predict, params, a.chat)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    try:
        cfg = config_from_args(a)
    except ValueError as e:
        ap.error(str(e))
    logging.basicConfig(level=_log_level(cfg.log_verbosity),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from radixserve.http.run import serve

    return serve(cfg)


if __name__ == "__main__":
    sys.exit(main())
