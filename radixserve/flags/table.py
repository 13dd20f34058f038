"""Every flag of llama-server's --help (tests/fixtures/llama-server-help.txt) and what it does
here, plus radixserve's own. The spellings, value placeholders and environment variables are
llama-server's, so its command lines and deployments carry over unchanged."""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable
from typing import Any

from radixserve.memory.tiers.disk_block import load_key
from radixserve.config import POOLINGS, SPEC_TYPES
from radixserve.model.device import list_devices, parse_device, parse_gpu_layers
from radixserve.model.kernel_routes import LOAD_MODES
from radixserve.memory.pool.kv_types import NOT_BUILT, TYPES
from radixserve.flags.spec import (
    ACTION,
    HONORED,
    NOT_APPLICABLE,
    REFUSED,
    Flag,
    FlagError,
    FlagExit,
    Handler,
    Parsed,
    parse_bool,
)
from radixserve.sampling import chain as sampling
from radixserve.text.builtin_templates import BUILTIN_NAMES

GPU = "the whole model and its KV pool sit on one device (--device, -ngl 0 or all)"
PLACEMENT = "threads are placed by the OS and PyTorch"
# --cpu-moe / --n-cpu-moe / -ot: where llama-server keeps tensors in host memory beside a GPU
HOST_TENSORS = ("on the CPU every tensor, the experts' included, is in host memory already, "
                "and mixture-of-experts models run on the CPU only")
NO_MULTIMODAL = "no multimodal input without a projector"
DRAFT_THREADS = "the draft model runs on the target's threads (-t), placed by the OS and PyTorch"
DRAFT_DEVICE = "the draft model runs where the target model runs"
# llama-server's --spec-type values this server has no drafter for
SPEC_TYPES_LLAMA_ONLY = ("draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark",
                         "ngram-map-k", "ngram-map-k4v", "ngram-cache")
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
KV_BUILT = tuple(TYPES)


def _spellings(spec: str) -> tuple[tuple[str, ...], str | None]:
    """'-c,    --ctx-size N' -> (('-c', '--ctx-size'), 'N')."""
    names: list[str] = []
    rest = spec.strip()
    while rest.startswith("-"):
        m = re.match(r"(-[^\s,]+)(,\s*|\s+|$)", rest)
        assert m, spec
        names.append(m.group(1))
        rest = rest[m.end():]
        if not m.group(2).startswith(","):
            break
    return tuple(names), (rest or None)


def flag(spec: str, outcome: str, help: str, handler: Handler | None = None, *,
         env: str | None = None, neg: str = "", n_values: int = 1) -> Flag:
    names, hint = _spellings(spec)
    return Flag(names, _spellings(neg)[0] if neg else (), hint, env, outcome, help, handler,
                n_values)


# -- handlers ------------------------------------------------------------------------------
def _int(v: str) -> int:
    try:
        return int(v.strip(), 10)
    except ValueError:
        raise FlagError(f"expected an integer, got {v!r}") from None


def _float(v: str) -> float:
    try:
        return float(v.strip())
    except ValueError:
        raise FlagError(f"expected a number, got {v!r}") from None


def _csv(v: str) -> list[str]:
    return [x.strip() for x in v.split(",") if x.strip()]


def set_(attr: str, conv: Callable[[Any], Any] = lambda v: v) -> Handler:
    """Store the converted value in the config (`sampling.x`: the default sampling params)."""
    obj_name, _, name = attr.rpartition(".")

    def h(p: Parsed, v: Any) -> None:
        obj = getattr(p.cfg, obj_name) if obj_name else p.cfg
        if not hasattr(obj, name):
            raise FlagError(f"no setting {attr!r} (a bug: the flag table is out of date)")
        setattr(obj, name, conv(v))

    h.attr = attr  # type: ignore[attr-defined]  # --help shows the setting's default
    return h


def check(conv: Callable[[str], Any]) -> Handler:
    """Not applicable, but a malformed value is still an error (as llama-server's)."""

    def h(p: Parsed, v: Any) -> None:
        if not isinstance(v, bool):
            conv(v)

    return h


def _key_file(path: str) -> str:
    """A --cache-disk-key file, read now: a bad one stops start-up before the model loads."""
    try:
        load_key(path)
    except ValueError as e:
        raise FlagError(str(e)) from None
    return path


def _choice(*allowed: str) -> Callable[[str], str]:
    def conv(v: str) -> str:
        if v not in allowed:
            raise FlagError(f"expected one of {', '.join(allowed)}, got {v!r}")
        return v

    return conv


def _pooling(v: str) -> str:
    """llama.cpp's pooling names; rank pools through a classification head (a reranker's),
    which no model this server loads has."""
    if v == "rank":
        raise FlagError("rank pooling needs a reranking model's classification head (the "
                        "cls / cls.output tensors), which radixserve does not implement")
    return _choice(*POOLINGS)(v)


def _kv_type(v: str) -> str:
    """A cache type as llama.cpp's kv_cache_type_from_str takes it (its error for another);
    the types radixserve has no kernels for are refused naming the ones it has."""
    if v not in KV_TYPES:
        raise FlagError(f"Unsupported cache type: {v} (allowed: {', '.join(KV_TYPES)})")
    if v in NOT_BUILT:
        raise FlagError(f"cache type {v} is not implemented in radixserve (it stores "
                        f"{', '.join(KV_BUILT)})")
    return v


def _cache_type(spec: str, whose: str, attr: str, env: str) -> Flag:
    return flag(spec, HONORED, f"{whose} cache type: {' '.join(KV_BUILT)} (default: the compute "
                "dtype); every tier stores it", set_(attr, _kv_type), env="LLAMA_ARG_" + env)


def _api_key(p: Parsed, v: str) -> None:
    p.cfg.api_key += _csv(v)


def _read_text(path: str) -> str:
    """A flag's file, or llama.cpp's error naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise FlagError(f"failed to open file '{path}': {e.strerror}") from None


def _api_key_file(p: Parsed, v: str) -> None:
    lines = _read_text(v).splitlines()
    p.cfg.api_key += [k for k in lines if k and not k.startswith("#")]


def _alias(p: Parsed, v: str) -> None:
    names = sorted(set(_csv(v)))  # llama-server keeps a std::set: the first sorted name leads
    p.cfg.aliases, p.cfg.alias = names, (names[0] if names else None)


def _logit_bias(p: Parsed, v: str) -> None:
    m = re.fullmatch(r"\s*(\d+)\s*([+-])\s*(\S+)", v)
    if not m:
        raise FlagError("expected TOKEN_ID(+/-)BIAS, e.g. 15043+1")
    bias = _float(m.group(3)) * (1 if m.group(2) == "+" else -1)
    p.cfg.sampling.logit_bias = [*p.cfg.sampling.logit_bias, (int(m.group(1)), bias)]


def _dry_breaker(p: Parsed, v: str) -> None:
    s = p.cfg.sampling
    if "dry-breakers" not in p.once:  # the first one clears llama.cpp's defaults
        p.once.add("dry-breakers")
        s.dry_sequence_breakers = []
    s.dry_sequence_breakers = [] if v == "none" else [*s.dry_sequence_breakers, v]


def _samplers(p: Parsed, v: str) -> None:
    p.cfg.sampling.samplers = sampling.samplers_from_names(v.split(";"))


def _sampling_seq(p: Parsed, v: str) -> None:
    p.cfg.sampling.samplers = sampling.samplers_from_chars(v)


def _reverse_prompt(p: Parsed, v: str) -> None:
    p.cfg.stop = [*p.cfg.stop, v]


def _grammar(p: Parsed, v: str, kind: str) -> None:
    """The default grammar, compiled and checked now (a bad one stops start-up); the last of
    --grammar/-j wins, as they set one parameter in llama.cpp."""
    from radixserve.text import grammar

    try:
        g = grammar.from_gbnf(v) if kind == "gbnf" else grammar.from_json_schema(v)
        p.cfg.grammar = grammar.check(g, None, "grammar" if kind == "gbnf" else "JSON schema")
    except ValueError as e:
        raise FlagError(str(e)) from None


def _chat_template(p: Parsed, v: str) -> None:
    """A Jinja text, or a name of llama.cpp's built-in templates (its Jinja text here,
    text/builtin_templates.py); anything else is refused with llama-server's message (its
    common_params_parse: "the supplied chat template is not supported: X")."""
    from radixserve.text.builtin_templates import builtin_template
    from radixserve.text.chat_template import ChatTemplate

    if "{{" in v or "{%" in v:
        ChatTemplate(v)  # ValueError (-> exit 1) naming the syntax error, before loading
        p.cfg.chat_template = v
    elif (text := builtin_template(v)) is not None:
        p.cfg.chat_template = text
    else:
        raise FlagError(f"the supplied chat template is not supported: {v} (neither a Jinja "
                        "template nor a built-in name; see --help)")


def _json_object(v: str) -> dict[str, Any]:
    try:
        obj = json.loads(v)
    except json.JSONDecodeError as e:
        raise FlagError(f"not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise FlagError("must be a JSON object")
    return obj


def _chat_template_kwargs(p: Parsed, v: str) -> None:
    p.cfg.chat_template_kwargs = {**p.cfg.chat_template_kwargs, **_json_object(v)}


def _ui_config(p: Parsed, v: str) -> None:
    """llama-server fails at start on JSON it cannot parse; the page reads an object's keys."""
    p.cfg.ui_settings = _json_object(v)


def _reasoning_format(p: Parsed, v: str) -> None:
    p.cfg.reasoning_format = _choice("none", "auto", "deepseek", "deepseek-legacy")(v)


def _reasoning(p: Parsed, v: str) -> None:
    v = _choice("on", "off", "auto")(v)
    if v == "on":
        raise FlagError("forcing reasoning on is not implemented (no thinking control)")


def _reasoning_budget(p: Parsed, v: str) -> None:
    if _int(v) != -1:
        raise FlagError("a reasoning token budget is not implemented")


def _reasoning_effort(p: Parsed, v: str) -> None:
    if v != "default":  # llama-server hands the level to the chat template
        p.cfg.chat_template_kwargs = {**p.cfg.chat_template_kwargs, "reasoning_effort": v}


def spec_type_names(v: str) -> list[str]:
    """A --spec-type value -> the drafters it names, in order, duplicates dropped; `none`
    anywhere in it: none (llama.cpp's common_speculative_types_from_names)."""
    names = _csv(v)
    if not names:
        raise FlagError("expected a comma-separated list of speculative types")
    for n in names:
        if n in SPEC_TYPES_LLAMA_ONLY:
            raise FlagError(f"speculative type {n} is not supported; this server drafts with "
                            f"{', '.join(SPEC_TYPES)} (or none)")
        if n != "none" and n not in SPEC_TYPES:
            raise FlagError(f"unknown speculative type: {n} (supported: none, "
                            f"{', '.join(SPEC_TYPES)})")
    return [] if "none" in names else list(dict.fromkeys(names))


def _spec_type(p: Parsed, v: str) -> None:
    """llama-server appends each --spec-type to the list; the environment's value is replaced
    by the command line's (the first --spec-type on the command line starts a new list)."""
    types = spec_type_names(v)
    if "--spec-type" in p.seen and "spec-type-cli" not in p.once:
        p.once.add("spec-type-cli")
        p.cfg.spec.types = []
    p.cfg.spec.types = list(dict.fromkeys([*p.cfg.spec.types, *types]))


def _spec_default(p: Parsed, on: bool) -> None:
    """llama-server's --spec-default: add ngram-mod with its default sizes."""
    s = p.cfg.spec
    s.types = list(dict.fromkeys([*s.types, "ngram-mod"]))
    s.ngram_mod_n_match, s.ngram_mod_n_min, s.ngram_mod_n_max = 24, 48, 64


def _sleep_idle(v: str) -> int:
    """llama-server's check: "invalid value: cannot be 0 or less than -1"."""
    n = _int(v)
    if n == 0 or n < -1:
        raise FlagError("invalid value: cannot be 0 or less than -1")
    return n


def _int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An integer within [lo, hi] (llama.cpp's range checks of the --spec-* sizes)."""

    def conv(v: str) -> int:
        n = _int(v)
        if n < lo or (hi is not None and n > hi):
            bounds = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            raise FlagError(f"must be {bounds}, got {n}")
        return n

    return conv


def _probability(v: str) -> float:
    x = _float(v)
    if not 0.0 <= x <= 1.0:
        raise FlagError(f"must be within [0, 1], got {x}")
    return x


def _verbose(p: Parsed, on: bool) -> None:
    p.cfg.log_verbosity = 2**31 - 1  # llama.cpp's "infinity" (INT_MAX)


def _escape(p: Parsed, on: bool) -> None:
    p.cfg.escape = on


def _no_op(p: Parsed, v: Any) -> None:
    return None


def _exit(text: Callable[[], str]) -> Handler:
    def h(p: Parsed, v: Any) -> None:
        raise FlagExit(text())

    return h


def _version() -> str:
    from importlib.metadata import version

    return f"radixserve {version('radixserve')} (llama-server compatible command line)\n"


def _help() -> str:
    from radixserve.flags.spec import render_help

    return render_help(ALL_FLAGS, "radixserve serve")


def _completion_bash() -> str:
    words = " ".join(n for f in ALL_FLAGS for n in f.spellings)
    return ("_radixserve_serve() {\n"
            f'  COMPREPLY=( $(compgen -W "{words}" -- "${{COMP_WORDS[COMP_CWORD]}}") )\n'
            "}\ncomplete -F _radixserve_serve radixserve\n")


def _cache_list() -> str:
    from radixserve.model.default_model import default_model_path

    try:
        return f"models available offline:\n  default: {default_model_path()}\n"
    except FileNotFoundError as e:
        return f"no models available offline ({e})\n"


def process_escapes(s: str) -> str:
    """llama.cpp's string_process_escapes for -r values (\\n, \\t, \\', \\", \\\\)."""
    return codecs.decode(s.encode("latin-1", "backslashreplace"), "unicode_escape")


H, NA, NO, ACT = HONORED, NOT_APPLICABLE, REFUSED, ACTION
I, F = _int, _float

SERVE_FLAGS: list[Flag] = [
    # ----- common params -----
    flag("-h, --help, --usage", ACT, "print usage and exit", _exit(_help)),
    flag("--version", ACT, "print version and exit", _exit(_version)),
    flag("-cl, --cache-list", ACT, "list the models available offline and exit",
         _exit(_cache_list)),
    flag("--completion-bash", ACT, "print a source-able bash completion script",
         _exit(_completion_bash)),
    flag("-t, --threads N", H, "CPU threads for compute, -1 = all cores", set_("threads", I),
         env="LLAMA_ARG_THREADS"),
    flag("-tb, --threads-batch N", NA, "one thread count (-t) serves prompts and decoding",
         check(I)),
    flag("-C, --cpu-mask M", NA, PLACEMENT),
    flag("-Cr, --cpu-range lo-hi", NA, PLACEMENT),
    flag("--cpu-strict <0|1>", NA, PLACEMENT, check(I)),
    flag("--prio N", NA, PLACEMENT, check(I)),
    flag("--poll <0...100>", NA, PLACEMENT, check(I)),
    flag("-Cb, --cpu-mask-batch M", NA, PLACEMENT),
    flag("-Crb, --cpu-range-batch lo-hi", NA, PLACEMENT),
    flag("--cpu-strict-batch <0|1>", NA, PLACEMENT, check(I)),
    flag("--prio-batch N", NA, PLACEMENT, check(I)),
    flag("--poll-batch <0|1>", NA, PLACEMENT, check(I)),
    flag("-c, --ctx-size N", H, "KV cells in total, 0 = the model's training context",
         set_("ctx_size", I), env="LLAMA_ARG_CTX_SIZE"),
    flag("-n, --predict, --n-predict N", H, "default and maximum tokens per request, -1 = no limit",
         set_("n_predict", I), env="LLAMA_ARG_N_PREDICT"),
    flag("-b, --batch-size N", H, "logical batch size; a step holds at most min(-b, -ub) tokens",
         set_("batch_size", I), env="LLAMA_ARG_BATCH"),
    flag("-ub, --ubatch-size N", H, "tokens per forward step (prefill chunk + decode tokens)",
         set_("ubatch_size", I), env="LLAMA_ARG_UBATCH"),
    flag("--keep N", H, "prompt tokens a context shift keeps (-1 = all); request `n_keep`",
         set_("n_keep", I)),
    flag("--swa-full", H, "full-size KV for sliding-window layers (no window pruning, no "
         "checkpoints needed)", set_("swa_full", bool), env="LLAMA_ARG_SWA_FULL"),
    flag("-fa, --flash-attn [on|off|auto]", NA, "attention uses PyTorch's SDPA kernels",
         check(_choice("on", "off", "auto")), env="LLAMA_ARG_FLASH_ATTN"),
    flag("--perf", NA, "libllama's internal timings; see timings and /metrics",
         neg="--no-perf", env="LLAMA_ARG_PERF"),
    flag("-e, --escape", H, "process escapes (\\n, \\t...) in -r stop strings", _escape,
         neg="--no-escape"),
    flag("--rope-scaling {none,linear,yarn}", NO, "RoPE scaling overrides are not implemented",
         env="LLAMA_ARG_ROPE_SCALING_TYPE"),
    flag("--rope-scale N", NO, "RoPE scaling overrides are not implemented",
         env="LLAMA_ARG_ROPE_SCALE"),
    flag("--rope-freq-base N", NO, "RoPE base overrides are not implemented",
         env="LLAMA_ARG_ROPE_FREQ_BASE"),
    flag("--rope-freq-scale N", NO, "RoPE scaling overrides are not implemented",
         env="LLAMA_ARG_ROPE_FREQ_SCALE"),
    flag("--yarn-orig-ctx N", NO, "YaRN RoPE scaling is not implemented",
         env="LLAMA_ARG_YARN_ORIG_CTX"),
    flag("--yarn-ext-factor N", NO, "YaRN RoPE scaling is not implemented",
         env="LLAMA_ARG_YARN_EXT_FACTOR"),
    flag("--yarn-attn-factor N", NO, "YaRN RoPE scaling is not implemented",
         env="LLAMA_ARG_YARN_ATTN_FACTOR"),
    flag("--yarn-beta-slow N", NO, "YaRN RoPE scaling is not implemented",
         env="LLAMA_ARG_YARN_BETA_SLOW"),
    flag("--yarn-beta-fast N", NO, "YaRN RoPE scaling is not implemented",
         env="LLAMA_ARG_YARN_BETA_FAST"),
    flag("-kvo, --kv-offload", NA, GPU, neg="-nkvo, --no-kv-offload", env="LLAMA_ARG_KV_OFFLOAD"),
    flag("--repack", NA, "weights are packed by radixserve's own loader (--weights)",
         neg="-nr, --no-repack", env="LLAMA_ARG_REPACK"),
    flag("--no-host", NA, GPU, env="LLAMA_ARG_NO_HOST"),
    _cache_type("-ctk, --cache-type-k TYPE", "K", "cache_type_k", "CACHE_TYPE_K"),
    _cache_type("-ctv, --cache-type-v TYPE", "V", "cache_type_v", "CACHE_TYPE_V"),
    flag("-dt, --defrag-thold N", NA, "deprecated in llama-server; the KV pool never fragments "
         "a sequence's reads", check(F), env="LLAMA_ARG_DEFRAG_THOLD"),
    flag("--rpc SERVERS", NO, "RPC backends (model split over machines) are not implemented",
         env="LLAMA_ARG_RPC"),
    flag("-lm, --load-mode MODE", H, "what a mixture-of-experts model's Q8_0, MXFP4, Q4_K "
         "and Q6_K expert tensors are read from: mmap, the mapped file's pages (not copied); "
         "none, a copy packed in our tiles; auto: mmap for Q8_0 and MXFP4 on the AVX-512 and "
         "AVX-VNNI builds (their gather of the file's rows keeps up with the tiles), else none; "
         "dio as none; mlock and mmap+mlock as none and mmap, no page locked (said at "
         "start-up); every other tensor is packed either way",
         set_("load_mode", _choice(*LOAD_MODES)), env="LLAMA_ARG_LOAD_MODE"),
    flag("-lzm, --lazy-mode MODE", NA, "every tensor is kept resident",
         check(_choice("on", "off", "auto")), env="LLAMA_ARG_LAZY_MODE"),
    flag("--numa TYPE", NA, PLACEMENT, check(_choice("distribute", "isolate", "numactl")),
         env="LLAMA_ARG_NUMA"),
    flag("-dev, --device <dev1,dev2,..>", H, "the one device the model and its KV pool use: "
         "auto (the first CUDA device torch sees, else the CPU), cpu / none, cuda[:N] or "
         "CUDA<N>", set_("device", parse_device), env="LLAMA_ARG_DEVICE"),
    flag("--list-devices", ACT, "print the devices (the CPU, each CUDA device) and exit",
         _exit(list_devices)),
    flag("-ot, --override-tensor <tensor name pattern>=<buffer type>,...", NA, HOST_TENSORS,
         env="LLAMA_ARG_OVERRIDE_TENSOR"),
    flag("-cmoe, --cpu-moe", NA, HOST_TENSORS, env="LLAMA_ARG_CPU_MOE"),
    flag("-ncmoe, --n-cpu-moe N", NA, HOST_TENSORS, check(I), env="LLAMA_ARG_N_CPU_MOE"),
    flag("-ncffn, --n-cpu-ffn N", NA, GPU, check(I), env="LLAMA_ARG_N_CPU_FFN"),
    flag("-ngl, --gpu-layers, --n-gpu-layers N", H, "0: the model runs on the CPU; auto, all "
         "or every layer's count: all of it on --device (a part is refused: no CPU/GPU split)",
         set_("gpu_layers", parse_gpu_layers), env="LLAMA_ARG_N_GPU_LAYERS"),
    flag("-sm, --split-mode {none,layer,row,tensor}", NA, GPU,
         check(_choice("none", "layer", "row", "tensor")), env="LLAMA_ARG_SPLIT_MODE"),
    flag("-ts, --tensor-split N0,N1,N2,...", NA, GPU, env="LLAMA_ARG_TENSOR_SPLIT"),
    flag("-mg, --main-gpu INDEX", NA, GPU, check(I), env="LLAMA_ARG_MAIN_GPU"),
    flag("-fit, --fit [on|off]", NA, GPU, check(parse_bool), env="LLAMA_ARG_FIT"),
    flag("-fitt, --fit-target MiB0,MiB1,MiB2,...", NA, GPU, env="LLAMA_ARG_FIT_TARGET"),
    flag("-fitc, --fit-ctx N", NA, GPU, check(I), env="LLAMA_ARG_FIT_CTX"),
    flag("--check-tensors", NA, "tensor data is checked by the GGUF reader's sizes only"),
    flag("--override-kv KEY=TYPE:VALUE,...", NO, "overriding model metadata is not implemented"),
    flag("--op-offload", NA, GPU, neg="--no-op-offload"),
    flag("--lora FNAME", NO, "LoRA adapters are not implemented"),
    flag("--lora-scaled FNAME:SCALE,...", NO, "LoRA adapters are not implemented"),
    flag("--control-vector FNAME", NO, "control vectors are not implemented"),
    flag("--control-vector-scaled FNAME:SCALE,...", NO, "control vectors are not implemented"),
    flag("--control-vector-layer-range START END", NO, "control vectors are not implemented",
         n_values=2),
    flag("-m, --model FNAME", H, "GGUF file, or 'default' for the bundled SmolLM2-135M",
         set_("model"), env="LLAMA_ARG_MODEL"),
    flag("-mu, --model-url MODEL_URL", NO, "downloading models is not implemented (offline "
         "server: give a local GGUF with -m)", env="LLAMA_ARG_MODEL_URL"),
    flag("-dr, --docker-repo [<repo>/]<model>[:quant]", NO, "downloading models is not "
         "implemented (give a local GGUF with -m)", env="LLAMA_ARG_DOCKER_REPO"),
    flag("-hf, -hfr, --hf-repo <user>/<model>[:quant]", NO, "downloading models from Hugging "
         "Face is not implemented (give a local GGUF with -m)", env="LLAMA_ARG_HF_REPO"),
    flag("-hff, --hf-file FILE", NO, "downloading models from Hugging Face is not implemented",
         env="LLAMA_ARG_HF_FILE"),
    flag("-hft, --hf-token TOKEN", NA, "nothing is downloaded", env="HF_TOKEN"),
    flag("--log-disable", H, "no log output", set_("log_disable", bool)),
    flag("--log-file FNAME", H, "log to this file too", set_("log_file"),
         env="LLAMA_ARG_LOG_FILE"),
    flag("--log-jsonl", H, "log as one JSON object per line", set_("log_jsonl", bool),
         neg="--no-log-jsonl", env="LLAMA_ARG_LOG_JSONL"),
    flag("--log-colors [on|off|auto]", NA, "logs are never coloured",
         check(_choice("on", "off", "auto")), env="LLAMA_ARG_LOG_COLORS"),
    flag("-v, --verbose, --log-verbose", H, "log everything (verbosity infinity); answers carry `__verbose`", _verbose),
    flag("--offline", H, "no network access (radixserve never downloads)", _no_op,
         env="LLAMA_ARG_OFFLINE"),
    flag("-lv, --verbosity, --log-verbosity N", H, "0 output .. 1 errors .. 3 info .. 5 debug",
         set_("log_verbosity", I), env="LLAMA_ARG_LOG_VERBOSITY"),
    flag("--log-prefix", H, "level and logger name in log lines", set_("log_prefix", bool),
         neg="--no-log-prefix", env="LLAMA_ARG_LOG_PREFIX"),
    flag("--log-timestamps", H, "timestamps in log lines", set_("log_timestamps", bool),
         neg="--no-log-timestamps", env="LLAMA_ARG_LOG_TIMESTAMPS"),
    _cache_type("--spec-draft-type-k, -ctkd, --cache-type-k-draft TYPE", "the draft model's K",
                "spec.cache_type_k", "SPEC_DRAFT_CACHE_TYPE_K"),
    _cache_type("--spec-draft-type-v, -ctvd, --cache-type-v-draft TYPE", "the draft model's V",
                "spec.cache_type_v", "SPEC_DRAFT_CACHE_TYPE_V"),
    # ----- sampling params (the defaults of every request) -----
    flag("--samplers SAMPLERS", H, "sampler order, names separated by ';'", _samplers),
    flag("-s, --seed SEED", H, "default sampling seed, -1 = random", set_("seed", I)),
    flag("--sampler-seq, --sampling-seq SEQUENCE", H, "sampler order as letters (edskypmxt)",
         _sampling_seq),
    flag("--ignore-eos", H, "keep generating past end-of-stream tokens",
         set_("ignore_eos", bool)),
    flag("--temp, --temperature N", H, "temperature, 0 = greedy",
         set_("sampling.temperature", lambda v: max(F(v), 0.0)), env="LLAMA_ARG_TEMPERATURE"),
    flag("--top-k N", H, "top-k, 0 = off", set_("sampling.top_k", I), env="LLAMA_ARG_TOP_K"),
    flag("--top-p N", H, "top-p, 1.0 = off", set_("sampling.top_p", F), env="LLAMA_ARG_TOP_P"),
    flag("--min-p N", H, "min-p, 0.0 = off", set_("sampling.min_p", F), env="LLAMA_ARG_MIN_P"),
    flag("--top-nsigma, --top-n-sigma N", H, "top-n-sigma, -1 = off",
         set_("sampling.top_n_sigma", F)),
    flag("--xtc-probability N", H, "XTC probability, 0 = off",
         set_("sampling.xtc_probability", F)),
    flag("--xtc-threshold N", H, "XTC threshold", set_("sampling.xtc_threshold", F)),
    flag("--typical, --typical-p N", H, "locally typical p, 1.0 = off",
         set_("sampling.typical_p", F)),
    flag("--repeat-last-n N", H, "tokens the penalties look at, 0 = off, -1 = context",
         set_("sampling.repeat_last_n", I)),
    flag("--repeat-penalty N", H, "repeat penalty, 1.0 = off", set_("sampling.repeat_penalty", F),
         env="LLAMA_ARG_REPEAT_PENALTY"),
    flag("--presence-penalty N", H, "presence penalty, 0 = off",
         set_("sampling.presence_penalty", F), env="LLAMA_ARG_PRESENCE_PENALTY"),
    flag("--frequency-penalty N", H, "frequency penalty, 0 = off",
         set_("sampling.frequency_penalty", F), env="LLAMA_ARG_FREQUENCY_PENALTY"),
    flag("--dry-multiplier N", H, "DRY multiplier, 0 = off", set_("sampling.dry_multiplier", F)),
    flag("--dry-base N", H, "DRY base", set_("sampling.dry_base", F)),
    flag("--dry-allowed-length N", H, "DRY allowed length",
         set_("sampling.dry_allowed_length", I)),
    flag("--dry-penalty-last-n N", H, "DRY window, 0 = off, -1 = context",
         set_("sampling.dry_penalty_last_n", I)),
    flag("--dry-sequence-breaker STRING", H, "add a DRY sequence breaker (the first clears the "
         "defaults; 'none' = no breakers)", _dry_breaker),
    flag("--adaptive-target N", H, "adaptive-p target, negative = off",
         set_("sampling.adaptive_target", F)),
    flag("--adaptive-decay N", H, "adaptive-p decay", set_("sampling.adaptive_decay", F)),
    flag("--dynatemp-range N", H, "dynamic temperature range, 0 = off",
         set_("sampling.dynatemp_range", F)),
    flag("--dynatemp-exp N", H, "dynamic temperature exponent",
         set_("sampling.dynatemp_exponent", F)),
    flag("--mirostat N", H, "0 = off, 1 = Mirostat, 2 = Mirostat 2.0",
         set_("sampling.mirostat", I)),
    flag("--mirostat-lr N", H, "Mirostat eta", set_("sampling.mirostat_eta", F)),
    flag("--mirostat-ent N", H, "Mirostat tau", set_("sampling.mirostat_tau", F)),
    flag("-l, --logit-bias TOKEN_ID(+/-)BIAS", H, "add a logit bias, e.g. 15043+1", _logit_bias),
    flag("--grammar GRAMMAR", H, "default GBNF grammar (or %llguidance Lark) for requests "
         "that set none", lambda p, v: _grammar(p, v, "gbnf")),
    flag("--grammar-file FNAME", H, "--grammar read from a file",
         lambda p, v: _grammar(p, _read_text(v), "gbnf")),
    flag("-j, --json-schema SCHEMA", H, "default JSON schema for requests that set no grammar",
         lambda p, v: _grammar(p, v, "json")),
    flag("-jf, --json-schema-file FILE", H, "-j read from a file",
         lambda p, v: _grammar(p, _read_text(v), "json")),
    flag("-bs, --backend-sampling", NA, "sampling always runs in PyTorch",
         env="LLAMA_ARG_BACKEND_SAMPLING"),
    # ----- speculative params -----
    flag("--spec-draft-hf, -hfd, -hfrd, --hf-repo-draft <user>/<model>[:quant]", NO,
         "downloading draft models from Hugging Face is not implemented (give a local GGUF "
         "with -md)", env="LLAMA_ARG_SPEC_DRAFT_HF_REPO"),
    flag("--spec-draft-threads, -td, --threads-draft N", NA, DRAFT_THREADS, check(I)),
    flag("--spec-draft-threads-batch, -tbd, --threads-batch-draft N", NA, DRAFT_THREADS,
         check(I)),
    flag("--spec-draft-cpu-mask, -Cd, --cpu-mask-draft M", NA, DRAFT_THREADS),
    flag("--spec-draft-cpu-range, -Crd, --cpu-range-draft lo-hi", NA, DRAFT_THREADS),
    flag("--spec-draft-cpu-strict, --cpu-strict-draft <0|1>", NA, DRAFT_THREADS, check(I)),
    flag("--spec-draft-prio, --prio-draft N", NA, DRAFT_THREADS, check(I)),
    flag("--spec-draft-poll, --poll-draft <0|1>", NA, DRAFT_THREADS, check(I)),
    flag("--spec-draft-cpu-mask-batch, -Cbd, --cpu-mask-batch-draft M", NA, DRAFT_THREADS),
    flag("--spec-draft-cpu-strict-batch, --cpu-strict-batch-draft <0|1>", NA, DRAFT_THREADS,
         check(I)),
    flag("--spec-draft-prio-batch, --prio-batch-draft N", NA, DRAFT_THREADS, check(I)),
    flag("--spec-draft-poll-batch, --poll-batch-draft <0|1>", NA, DRAFT_THREADS, check(I)),
    flag("--spec-draft-override-tensor, -otd, --override-tensor-draft "
         "<tensor name pattern>=<buffer type>,...", NA, DRAFT_DEVICE),
    flag("--spec-draft-cpu-moe, -cmoed, --cpu-moe-draft", NA, DRAFT_DEVICE,
         env="LLAMA_ARG_SPEC_DRAFT_CPU_MOE"),
    flag("--spec-draft-n-cpu-moe, --spec-draft-ncmoe, -ncmoed, --n-cpu-moe-draft N", NA,
         DRAFT_DEVICE, check(I), env="LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE"),
    flag("--spec-draft-n-max N", H, "draft-simple: tokens the draft model proposes per step "
         "(request: speculative.n_max)", set_("spec.n_max", _int_in(0)),
         env="LLAMA_ARG_SPEC_DRAFT_N_MAX"),
    flag("--spec-draft-n-min N", H, "draft-simple: drafts shorter than this are dropped "
         "(request: speculative.n_min)", set_("spec.n_min", _int_in(0)),
         env="LLAMA_ARG_SPEC_DRAFT_N_MIN"),
    flag("--spec-synth-len L", NO, "synthetic draft acceptance (benchmarking) is not "
         "implemented", env="LLAMA_ARG_SPEC_SYNTH_LEN"),
    flag("--spec-synth-rates P0,P1,...", NO, "synthetic draft acceptance (benchmarking) is not "
         "implemented", env="LLAMA_ARG_SPEC_SYNTH_RATES"),
    flag("--spec-draft-p-split, --draft-p-split P", NA, "drafts are one sequence (no split "
         "into a tree)", check(F), env="LLAMA_ARG_SPEC_DRAFT_P_SPLIT"),
    flag("--spec-draft-p-min, --draft-p-min P", H, "draft-simple: drafting stops at a token "
         "the draft model gives less than this probability (request: speculative.p_min)",
         set_("spec.p_min", _probability), env="LLAMA_ARG_SPEC_DRAFT_P_MIN"),
    flag("--spec-draft-backend-sampling", NA, "draft sampling runs in PyTorch",
         neg="--no-spec-draft-backend-sampling", env="LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING"),
    flag("--spec-draft-device, -devd, --device-draft <dev1,dev2,..>", NA, DRAFT_DEVICE),
    flag("--spec-draft-ngl, -ngld, --gpu-layers-draft, --n-gpu-layers-draft N", NA,
         DRAFT_DEVICE, check(parse_gpu_layers), env="LLAMA_ARG_N_GPU_LAYERS_DRAFT"),
    flag("--spec-draft-model, -md, --model-draft FNAME", H, "draft model for draft-simple: a "
         "GGUF sharing the target's vocabulary, or a name -m accepts; alone it turns "
         "draft-simple on", set_("spec.draft_model", lambda v: v or None),
         env="LLAMA_ARG_SPEC_DRAFT_MODEL"),
    flag("--spec-type none,draft-simple,draft-eagle3,draft-mtp,draft-dflash,draft-dspark,"
         "ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,ngram-cache", H,
         "comma-separated drafters to use: draft-simple (needs -md), ngram-simple, ngram-mod, "
         "or none; the other types are refused (request: speculative.type)", _spec_type,
         env="LLAMA_ARG_SPEC_TYPE"),
    flag("--spec-ngram-mod-n-min N", H, "ngram-mod: drafts shorter than this are dropped",
         set_("spec.ngram_mod_n_min", _int_in(0, 1024))),
    flag("--spec-ngram-mod-n-max N", H, "ngram-mod: most tokens drafted per step",
         set_("spec.ngram_mod_n_max", _int_in(0, 1024))),
    flag("--spec-ngram-mod-n-match N", H, "ngram-mod: length of the hashed lookup n-gram",
         set_("spec.ngram_mod_n_match", _int_in(1, 1024))),
    flag("--spec-ngram-simple-size-n N", H, "ngram-simple: length of the lookup n-gram "
         "(request: speculative.ngram_size_n)",
         set_("spec.ngram_simple_size_n", _int_in(1, 1024))),
    flag("--spec-ngram-simple-size-m N", H, "ngram-simple: length of the drafted m-gram "
         "(request: speculative.ngram_size_m)",
         set_("spec.ngram_simple_size_m", _int_in(1, 1024))),
    flag("--spec-ngram-simple-min-hits N", H, "ngram-simple: hits a lookup needs before its "
         "continuation is drafted (request: speculative.ngram_min_hits)",
         set_("spec.ngram_simple_min_hits", _int_in(1))),
    *(flag(f"--spec-ngram-{n} N", NA, f"--spec-type ngram-{n.rsplit('-', 2)[0]} is not supported "
           "(refused)", check(I)) for n in (
        "map-k-size-n", "map-k-size-m", "map-k-min-hits", "map-k4v-size-n", "map-k4v-size-m",
        "map-k4v-min-hits")),
    flag("--draft, --draft-n, --draft-max N", NO, "the argument has been removed; use "
         "--spec-draft-n-max or --spec-ngram-mod-n-max", env="LLAMA_ARG_DRAFT_MAX"),
    flag("--draft-min, --draft-n-min N", NO, "the argument has been removed; use "
         "--spec-draft-n-min or --spec-ngram-mod-n-min", env="LLAMA_ARG_DRAFT_MIN"),
    flag("--spec-ngram-size-n N", NO, "the argument has been removed; use the respective "
         "--spec-ngram-*-size-n or --spec-ngram-mod-n-match"),
    flag("--spec-ngram-size-m N", NO, "the argument has been removed; use the respective "
         "--spec-ngram-*-size-m"),
    flag("--spec-ngram-min-hits N", NO, "the argument has been removed; use the respective "
         "--spec-ngram-*-min-hits"),
    # ----- example-specific params -----
    flag("-lcs, --lookup-cache-static FNAME", NA, "lookup decoding belongs to llama.cpp's "
         "lookup example"),
    flag("-lcd, --lookup-cache-dynamic FNAME", NA, "lookup decoding belongs to llama.cpp's "
         "lookup example"),
    flag("--kv-unified-per-slot N", H, "with --kv-unified: cap of one slot's context",
         set_("kv_unified_per_slot", I), env="LLAMA_ARG_KV_UNIFIED_PER_SLOT"),
    flag("-ctxcp, --ctx-checkpoints, --swa-checkpoints N", H, "context checkpoints per slot "
         "(sliding-window models), 0 = none", set_("ctx_checkpoints", I),
         env="LLAMA_ARG_CTX_CHECKPOINTS"),
    flag("-cms, --checkpoint-min-step N", H, "tokens between two checkpoints of one prompt, "
         "0 = no minimum", set_("checkpoint_min_step", I),
         env="LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT"),
    flag("-cram, --cache-ram N", H, "host prompt cache size in MiB, -1 = no limit, 0 = off",
         set_("cache_ram_mib", I), env="LLAMA_ARG_CACHE_RAM"),
    flag("-kvu, --kv-unified", H, "all slots draw KV cells from one shared pool",
         set_("kv_unified", bool), neg="-no-kvu, --no-kv-unified", env="LLAMA_ARG_KV_UNIFIED"),
    flag("--cache-idle-slots", H, "save idle slots to the host cache when a new task starts",
         set_("cache_idle_slots", bool), neg="--no-cache-idle-slots",
         env="LLAMA_ARG_CACHE_IDLE_SLOTS"),
    flag("--context-shift", H, "generation past the slot's context shifts it (keep n_keep, "
         "drop half the rest)", set_("context_shift", bool), neg="--no-context-shift",
         env="LLAMA_ARG_CONTEXT_SHIFT"),
    flag("-r, --reverse-prompt PROMPT", H, "a default stop string of every request",
         _reverse_prompt),
    flag("-sp, --special", H, "special tokens appear in the output text", set_("special", bool)),
    flag("--warmup", NA, "no warm-up run is needed", neg="--no-warmup"),
    flag("--spm-infill", H, "/infill lays out Suffix/Prefix/Middle (instead of "
         "Prefix/Suffix/Middle) as some models prefer", set_("spm_infill", bool)),
    flag("--pooling {none,mean,cls,last,rank}", H, "pooling of the embeddings (default: the "
         "model's, else none)", set_("pooling", _pooling), env="LLAMA_ARG_POOLING"),
    flag("-np, --parallel N", H, "number of slots, -1 = auto (4 slots, unified KV)",
         set_("n_parallel", I), env="LLAMA_ARG_N_PARALLEL"),
    flag("-cb, --cont-batching", H, "continuous batching (always on; -nocb is not applicable)",
         lambda p, on: None if on else p.note(
             "-nocb: not applicable here (batching is always continuous); ignored"),
         neg="-nocb, --no-cont-batching", env="LLAMA_ARG_CONT_BATCHING"),
    flag("-mm, --mmproj FILE", NO, "multimodal projectors (image/audio input) are not "
         "implemented", env="LLAMA_ARG_MMPROJ"),
    flag("-mmu, --mmproj-url URL", NO, "multimodal projectors (image/audio input) are not "
         "implemented", env="LLAMA_ARG_MMPROJ_URL"),
    flag("--mmproj-auto", NA, NO_MULTIMODAL, neg="--no-mmproj, --no-mmproj-auto",
         env="LLAMA_ARG_MMPROJ_AUTO"),
    flag("--mmproj-offload", NA, NO_MULTIMODAL, neg="--no-mmproj-offload",
         env="LLAMA_ARG_MMPROJ_OFFLOAD"),
    flag("-mmdev, --mmproj-device DEVICE", NA, NO_MULTIMODAL, env="MTMD_BACKEND_DEVICE"),
    flag("--image-min-tokens N", NA, NO_MULTIMODAL, check(I), env="LLAMA_ARG_IMAGE_MIN_TOKENS"),
    flag("--image-max-tokens N", NA, NO_MULTIMODAL, check(I), env="LLAMA_ARG_IMAGE_MAX_TOKENS"),
    flag("--mtmd-batch-max-tokens N", NA, NO_MULTIMODAL, check(I),
         env="LLAMA_ARG_MTMD_BATCH_MAX_TOKENS"),
    flag("--video-fps N", NA, NO_MULTIMODAL, check(F), env="LLAMA_ARG_VIDEO_FPS"),
    flag("--video-timestamp-interval N", NA, NO_MULTIMODAL, check(I),
         env="LLAMA_ARG_VIDEO_TIMESTAMP_INTERVAL"),
    flag("--video-ffmpeg-dir DIR", NA, NO_MULTIMODAL, env="LLAMA_ARG_VIDEO_FFMPEG_DIR"),
    flag("-a, --alias STRING", H, "model names for the API, comma separated", _alias,
         env="LLAMA_ARG_ALIAS"),
    flag("--tags STRING", H, "model tags, comma separated (informational)",
         set_("tags", _csv), env="LLAMA_ARG_TAGS"),
    flag("--embd-normalize N", H, "normalization of pooled embeddings: -1 none, 0 max "
         "absolute (int16 range), 2 euclidean, >2 p-norm", set_("embd_normalize", I)),
    flag("--host HOST", H, "addresses to listen on, comma separated; a path ending in .sock "
         "is a UNIX socket", set_("host"), env="LLAMA_ARG_HOST"),
    flag("--port PORT", H, "port to listen on; 0: a free one, which the log names",
         set_("port", I), env="LLAMA_ARG_PORT"),
    flag("--reuse-port", H, "let several servers bind the same port (SO_REUSEPORT)",
         set_("reuse_port", bool), env="LLAMA_ARG_REUSE_PORT"),
    flag("--path PATH", H, "serve static files from this directory at / instead of the page",
         set_("static_path"),
         env="LLAMA_ARG_STATIC_PATH"),
    flag("--cors-origins ORIGINS", H, "allowed CORS origins, comma separated; 'localhost' "
         "reflects local origins only", set_("cors_origins"), env="LLAMA_ARG_CORS_ORIGINS"),
    flag("--cors-methods METHODS", H, "allowed CORS methods", set_("cors_methods"),
         env="LLAMA_ARG_CORS_METHODS"),
    flag("--cors-headers HEADERS", H, "allowed CORS headers", set_("cors_headers"),
         env="LLAMA_ARG_CORS_HEADERS"),
    flag("--cors-credentials", H, "allow credentials in CORS requests",
         set_("cors_credentials", bool), neg="--no-cors-credentials",
         env="LLAMA_ARG_CORS_CREDENTIALS"),
    flag("--api-prefix PREFIX", H, "path prefix of every route, without a trailing slash",
         set_("api_prefix", lambda v: v.rstrip("/")), env="LLAMA_ARG_API_PREFIX"),
    flag("--ui-config, --webui-config JSON", H, "JSON object of the page's default settings "
         "(/props ui_settings: systemMessage, temperature, top_k, top_p, min_p, max_tokens, "
         "seed)", _ui_config, env="LLAMA_ARG_UI_CONFIG"),
    flag("--ui-config-file, --webui-config-file PATH", H, "file holding the --ui-config JSON",
         lambda p, v: _ui_config(p, _read_text(v)), env="LLAMA_ARG_UI_CONFIG_FILE"),
    flag("--ui-mcp-proxy, --webui-mcp-proxy", NO, "the MCP CORS proxy is not implemented",
         lambda p, on: None, neg="--no-ui-mcp-proxy, --no-webui-mcp-proxy",
         env="LLAMA_ARG_UI_MCP_PROXY"),
    flag("--tools TOOL1,TOOL2,...", NO, "built-in agent tools are not implemented",
         env="LLAMA_ARG_TOOLS"),
    flag("--tools-runtime OPTION", NO, "built-in agent tools are not implemented",
         env="LLAMA_ARG_TOOLS_RUNTIME"),
    flag("--mcp-servers-config PATH", NO, "MCP servers are not implemented",
         env="LLAMA_ARG_MCP_SERVERS_CONFIG"),
    flag("--mcp-servers-json JSON", NO, "MCP servers are not implemented",
         env="LLAMA_ARG_MCP_SERVERS_JSON"),
    flag("-ag, --agent", NO, "the agent mode (CORS proxy, built-in tools) is not implemented",
         lambda p, on: None, neg="-no-ag, --no-agent", env="LLAMA_ARG_AGENT"),
    flag("--ui, --webui", H, "the page at / (chat and a live view of the cache); --no-ui: "
         "neither it nor --path is served", set_("webui", bool), neg="--no-ui, --no-webui",
         env="LLAMA_ARG_UI"),
    flag("--embedding, --embeddings", H, "serve /embedding and /v1/embeddings (completions "
         "stay served)", set_("embeddings", bool), env="LLAMA_ARG_EMBEDDINGS"),
    flag("--rerank, --reranking", NO, "reranking needs a reranking model's classification "
         "head (its GGUF's cls / cls.output tensors), which radixserve does not load for any "
         "model (llama-server, given a model without one, returns meaningless scores); "
         "/rerank answers 501", env="LLAMA_ARG_RERANKING"),
    flag("--api-key KEY", H, "API keys, comma separated", _api_key, env="LLAMA_API_KEY"),
    flag("--api-key-file FNAME", H, "file of API keys, one per line, # starts a comment",
         _api_key_file, env="LLAMA_ARG_API_KEY_FILE"),
    flag("--ssl-key-file FNAME", H, "PEM private key: serve HTTPS", set_("ssl_key_file"),
         env="LLAMA_ARG_SSL_KEY_FILE"),
    flag("--ssl-cert-file FNAME", H, "PEM certificate: serve HTTPS", set_("ssl_cert_file"),
         env="LLAMA_ARG_SSL_CERT_FILE"),
    flag("--chat-template-kwargs STRING", H, "JSON object of extra chat template variables",
         _chat_template_kwargs, env="LLAMA_ARG_CHAT_TEMPLATE_KWARGS"),
    flag("-to, --timeout N", H, "seconds a client may stay silent while sending a request",
         set_("timeout", I), env="LLAMA_ARG_TIMEOUT"),
    flag("--sse-ping-interval N", H, "seconds of stream silence before an SSE ping, -1 = off",
         set_("sse_ping_interval", I), env="LLAMA_ARG_SSE_PING_INTERVAL"),
    flag("--threads-http N", NA, "HTTP runs on one asyncio loop; tokenizing uses its thread "
         "pool", check(I), env="LLAMA_ARG_THREADS_HTTP"),
    flag("--cache-prompt", H, "requests default to cache_prompt=true", set_("cache_prompt", bool),
         neg="--no-cache-prompt", env="LLAMA_ARG_CACHE_PROMPT"),
    flag("--cache-reuse N", H, "min chunk size to reuse from the slot's KV via shifting, 0 = off",
         set_("cache_reuse", I), env="LLAMA_ARG_CACHE_REUSE"),
    flag("--metrics", H, "enable GET /metrics", set_("metrics", bool),
         env="LLAMA_ARG_ENDPOINT_METRICS"),
    flag("--props", H, "enable POST /props", set_("props_endpoint", bool),
         env="LLAMA_ARG_ENDPOINT_PROPS"),
    flag("--slots", H, "enable GET /slots", set_("slots_endpoint", bool), neg="--no-slots",
         env="LLAMA_ARG_ENDPOINT_SLOTS"),
    flag("--slot-save-path PATH", H, "directory for slot save/restore files",
         set_("slot_save_path")),
    flag("--media-path PATH", NA, NO_MULTIMODAL),
    flag("--models-dir PATH", H, "router mode (no -m): serve the GGUF files of this directory, "
         "one child server each (README, \"Router mode\")", set_("models_dir"),
         env="LLAMA_ARG_MODELS_DIR"),
    flag("--models-preset PATH", H, "router mode (no -m): an INI file of models and their "
         "flags", set_("models_preset"), env="LLAMA_ARG_MODELS_PRESET"),
    flag("--models-max N", H, "router mode: models loaded at once, the least recently used "
         "idle one unloaded beyond it (0 = no limit)", set_("models_max", _int_in(0)),
         env="LLAMA_ARG_MODELS_MAX"),
    flag("--models-autoload", H, "router mode: a request for a model not loaded loads it",
         set_("models_autoload", bool), neg="--no-models-autoload",
         env="LLAMA_ARG_MODELS_AUTOLOAD"),
    flag("--jinja", H, "chat templates are rendered with Jinja (always; --no-jinja is not "
         "applicable)", lambda p, on: None if on else p.note(
             "--no-jinja: not applicable here (templates are always rendered with Jinja); "
             "ignored"), neg="--no-jinja", env="LLAMA_ARG_JINJA"),
    flag("--reasoning-format FORMAT", H, "a leading <think>...</think> of templates that think "
         "goes to reasoning_content (auto, deepseek; deepseek-legacy: kept in the content too); "
         "none: it stays in the content", _reasoning_format, env="LLAMA_ARG_THINK"),
    flag("-rea, --reasoning [on|off|auto]", H, "off/auto (the template decides); on refused",
         _reasoning, env="LLAMA_ARG_REASONING"),
    flag("--reasoning-effort LEVEL", H, "given to the chat template as reasoning_effort",
         _reasoning_effort, env="LLAMA_ARG_REASONING_EFFORT"),
    flag("--reasoning-budget N", H, "-1 only (no budget); a budget is refused",
         _reasoning_budget, env="LLAMA_ARG_THINK_BUDGET"),
    flag("--reasoning-budget-message MESSAGE", NA, "there is no reasoning budget",
         env="LLAMA_ARG_THINK_BUDGET_MESSAGE"),
    flag("--reasoning-preserve", NA, "the template renders the history it is given",
         neg="--no-reasoning-preserve", env="LLAMA_ARG_REASONING_PRESERVE"),
    flag("--chat-template JINJA_TEMPLATE", H, "a Jinja chat template, or the name of a "
         "built-in one, instead of the model's; built-in: " + ", ".join(BUILTIN_NAMES),
         _chat_template, env="LLAMA_ARG_CHAT_TEMPLATE"),
    flag("--chat-template-file JINJA_TEMPLATE_FILE", H, "read the chat template (Jinja, or a "
         "built-in name) from a file",
         lambda p, v: _chat_template(p, _read_text(v)), env="LLAMA_ARG_CHAT_TEMPLATE_FILE"),
    flag("--skip-chat-parsing", H, "replies stay pure content: no tool calls or reasoning "
         "parsed out of them", set_("skip_chat_parsing", bool), neg="--no-skip-chat-parsing",
         env="LLAMA_ARG_SKIP_CHAT_PARSING"),
    flag("--prefill-assistant", H, "a trailing assistant message is continued (prefilled)",
         set_("prefill_assistant", bool), neg="--no-prefill-assistant",
         env="LLAMA_ARG_PREFILL_ASSISTANT"),
    flag("-sps, --slot-prompt-similarity SIMILARITY", H, "reuse an idle slot whose prompt "
         "shares more than this fraction, 0 = off", set_("slot_prompt_similarity", F)),
    flag("--lora-init-without-apply", NA, "there are no LoRA adapters"),
    flag("--sleep-idle-seconds SECONDS", H, "after this many idle seconds release the model "
         "and its device KV (the host cache tiers stay); the next request reloads it; -1 = "
         "never", set_("sleep_idle_seconds", _sleep_idle)),
    flag("--log-prompts-dir PATH", NO, "logging prompts to a directory is not implemented"),
    *(flag(f"--{name}", NO, "preset models are downloaded from the internet: not available "
           "(give a local GGUF with -m)") for name in (
        "embd-gemma-default", "fim-qwen-1.5b-default", "fim-qwen-3b-default",
        "fim-qwen-7b-default", "fim-qwen-7b-spec", "fim-qwen-14b-spec",
        "fim-qwen-30b-default", "gpt-oss-20b-default", "gpt-oss-120b-default",
        "vision-gemma-4b-default", "vision-gemma-12b-default")),
    flag("--spec-default", H, "add ngram-mod to --spec-type with its default sizes (n-match "
         "24, n-min 48, n-max 64)", _spec_default),
]

OWN_FLAGS: list[Flag] = [
    flag("--dtype TYPE", H, "compute dtype: auto (bf16 where the CPU runs it fast), f32, bf16, "
         "f16", set_("dtype")),
    flag("--weights MODE", H, "native: 4-bit blocks run packed; dequant: dense; auto: native "
         "unless --dtype f32", set_("weights")),
    flag("--deterministic auto|on|off", H, "batch-invariant compute: a token's logits depend "
         "only on the token sequence (auto: on where the bf16 kernels run)",
         set_("deterministic")),
    flag("--cache-radix-prompt on|off", H, "radix-tree backend for the host prompt cache",
         set_("cache_radix_prompt", parse_bool)),
    flag("--cache-radix-min-restore-tokens N", H, "restore from the radix cache only when at "
         "least this many tokens match", set_("cache_radix_min_restore_tokens", I)),
    flag("--cache-pin-mib N", H, "host RAM the radix cache may keep pinned for requests with "
         "prompt_cache_retention 24h (the oldest pins lapse first beyond it; 0: such requests "
         "are refused)", set_("cache_pin_mib", I)),
    flag("--cache-disk DIR", H, "disk tier under the radix cache: prompt KV blocks written to "
         "DIR survive restarts and are shared by the servers using DIR", set_("cache_disk")),
    flag("--cache-disk-mib N", H, "bound on the block files in --cache-disk (LRU; -1: none)",
         set_("cache_disk_mib", I)),
    flag("--cache-disk-block N", H, "tokens a --cache-disk block file holds",
         set_("cache_disk_block", I)),
    flag("--cache-disk-key FILE", H, "secret file keying --cache-disk's file names and "
         "checksums: only servers given the same file share (or can plant) blocks "
         "(docs/SECURITY.md)", set_("cache_disk_key", _key_file)),
    flag("--max-body-mib N", H, "largest request body in MiB (413 beyond)",
         set_("max_body_mib", I)),
]

ALL_FLAGS = SERVE_FLAGS + OWN_FLAGS


def finish(p: Parsed) -> None:
    """Rules that need every flag seen: -e applies to the -r strings."""
    if p.cfg.escape:
        p.cfg.stop = [process_escapes(s) for s in p.cfg.stop]
