"""Validated request models -> `CompletionTask` (prompt tokens, sampling, limits).

This is where llama-server's request semantics live: prompt forms and BOS rules, the
n_predict aliases, soft limits clamped silently and hard limits rejected, OpenAI chat
`logprobs`, and the context-size check that must fail before a slot is taken.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

from radixserve.config import RequestDefaults, SpecConfig
from radixserve.engine.task import CompletionTask, check_prompt
from radixserve.errors import invalid_request
from radixserve.http.fields import reject_unimplemented
from radixserve.http.schemas import (
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    range_error,
    validate_body,
)
from radixserve.sampling.chain import (
    SamplingParams,
    dry_breakers_for,
    parse_logit_bias,
    samplers_from_chars,
    samplers_from_names,
)
from radixserve.text import grammar as grammars
from radixserve.text.chat_caps import render
from radixserve.text.chat_format import ChatInputs, ChatPlan, plan_chat
from radixserve.text.chat_parse import OutputFormat
from radixserve.text.chat_template import ChatTemplate, flatten_content
from radixserve.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1  # n_predict is capped by the context anyway; keep it a sane int
MAX_N_PROBS = 100
MAX_CACHE_SALT = 512  # characters of a `cache_salt` (vLLM's field; a tenant's key)
LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's "random seed" value
FLT_MAX = 3.4028234663852886e38


@dataclass(slots=True)
class ParseContext:
    """What request parsing needs from the server: the model's text side, slot limits and
    the request defaults (`RequestDefaults`, from the flags)."""

    tokenizer: Tokenizer
    chat_template: ChatTemplate
    n_ctx_slot: int
    n_slots: int
    defaults: RequestDefaults = field(default_factory=RequestDefaults.from_config)

    @classmethod
    def for_model(cls, tokenizer: Tokenizer, chat_template: ChatTemplate, n_ctx_slot: int,
                  n_slots: int, defaults: RequestDefaults) -> ParseContext:
        """A context whose default grammar (compiled by the flags) is checked against the
        model's tokenizer."""
        if defaults.grammar:
            defaults = dataclasses.replace(
                defaults, grammar=grammars.check(defaults.grammar, tokenizer))
        return cls(tokenizer, chat_template, n_ctx_slot, n_slots, defaults)


@dataclass(slots=True)
class ParsedRequest:
    """A task plus how the response must be shaped (nothing here reaches the engine)."""

    task: CompletionTask  # the first of `tasks` (the one of a single-prompt, n=1 request)
    stream: bool = False
    include_usage: bool = False
    return_tokens: bool = False
    post_sampling_probs: bool = False
    # every task of the request, in llama-server's result order: per prompt, the task and then
    # its n_cmpl - 1 children (`CompletionTask.index` is the position here)
    tasks: list[CompletionTask] = field(default_factory=list)
    response_fields: list[str] = field(default_factory=list)  # /completion: fields to return
    sse_ping_interval: int | None = None  # None: the server's --sse-ping-interval
    # chat: how a reply's text becomes content, reasoning and tool calls (None: all content);
    # shared by the tasks, each formatting its result takes its own parser from it
    chat_output: OutputFormat | None = None
    # the server's speculative settings: what `params` reports for a task whose `spec` is None
    server_spec: SpecConfig = field(default_factory=SpecConfig)
    # chat: the assistant message the reply continues; as llama-server, the answer's message
    # starts with it, and a stream sends it first unless `continue_final_message` asked for
    # the continuation (`stream_prefill` false)
    prefill: str = ""
    stream_prefill: bool = False
    # `verbose` (or -v): OpenAI answers carry `__verbose`, the native result (rendered prompt,
    # raw text)
    verbose: bool = False
    # what an API other than llama-server's and OpenAI chat's keeps from its request for its
    # answers (an Anthropic message's model name, a stored response's conversation)
    origin: Any = None

    def __post_init__(self) -> None:
        if not self.tasks:
            self.tasks = [self.task]

    def per_task(self) -> list[ParsedRequest]:
        """One ParsedRequest per task (same response options), for formatting its result."""
        if len(self.tasks) == 1:
            return [self]
        return [dataclasses.replace(self, task=t, tasks=[t]) for t in self.tasks]


def tokenize_mixed(
    content: Any, tok: Tokenizer, add_special: bool, parse_special: bool
) -> list[int]:
    """A string, or a list mixing strings and token ids (llama.cpp `tokenize_mixed`):
    special tokens (BOS) are added only when the first element is a string."""
    if isinstance(content, str):
        return tok.encode(content, add_special=add_special, parse_special=parse_special)
    if not isinstance(content, list):
        raise invalid_request("prompt must be a string or a list of strings and token ids")
    out: list[int] = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            out += tok.encode(part, add_special=add_special and i == 0, parse_special=parse_special)
        elif isinstance(part, int) and not isinstance(part, bool):
            out.append(part)
        else:
            raise invalid_request(f"prompt[{i}] must be a string or a token id, got {part!r:.40}")
    return out


def prompt_list(prompt: Any, tok: Tokenizer) -> list[list[int]]:
    """The prompts of a /completion `prompt` (llama-server's tokenize_input_prompts): a list
    holding no token id is a list of prompts, each a string, token ids, a mixed list or a
    `{prompt_string}`; anything else is one prompt."""
    if prompt is None:
        raise invalid_request('"prompt" is required')
    if isinstance(prompt, list) and prompt and not any(
        isinstance(p, int) and not isinstance(p, bool) for p in prompt
    ):
        return [_one_prompt(p, tok) for p in prompt]
    return [_one_prompt(prompt, tok)]


def prompt_tokens(prompt: Any, tok: Tokenizer) -> list[int]:
    """Tokens of a /completion `prompt` holding one prompt (400 for several)."""
    prompts = prompt_list(prompt, tok)
    if len(prompts) > 1:
        raise invalid_request("multiple prompts are not supported here")
    return prompts[0]


def _one_prompt(prompt: Any, tok: Tokenizer) -> list[int]:
    if isinstance(prompt, dict):
        if prompt.get("multimodal_data"):
            raise invalid_request("multimodal prompts are not supported")
        if not isinstance(prompt.get("prompt_string"), str):
            raise invalid_request("a prompt object needs a string 'prompt_string'")
        return tok.encode(prompt["prompt_string"])
    return tokenize_mixed(prompt, tok, add_special=True, parse_special=True)


def _first(req: GenerationRequest, *names: str) -> tuple[str, Any]:
    for name in names:
        value = getattr(req, name, None)
        if value is not None:
            return name, value
    return names[0], None


def _n_predict(req: GenerationRequest, ctx: ParseContext) -> int:
    name, n = _first(req, "n_predict", "max_tokens", "max_completion_tokens")
    cap = ctx.defaults.n_predict  # llama-server: the server's --n-predict caps requests
    if n is None:
        return cap
    if n < -1:
        raise range_error(name, n, -1)
    n = min(n, INT32_MAX)
    return n if cap < 0 else cap if n < 0 else min(n, cap)


def _sampling(req: GenerationRequest, n_probs: int, ctx: ParseContext) -> SamplingParams:
    """SamplingParams from the server's defaults (`ctx.defaults`) and the request, with
    llama-server's limits (tools/server/server-schema.cpp): soft limits clamped silently,
    hard limits rejected with a 400 naming the field."""
    d = ctx.defaults.sampling
    tok = ctx.tokenizer
    default_seed = ctx.defaults.seed if ctx.defaults.seed != -1 else d.seed
    seed = default_seed if req.seed is None else req.seed
    if seed == LLAMA_DEFAULT_SEED:
        seed = -1
    if seed != -1 and not 0 <= seed < 2**64:
        raise range_error("seed", seed, -1, 2**64 - 1)
    repeat_last_n = d.repeat_last_n if req.repeat_last_n is None else req.repeat_last_n
    if repeat_last_n < 0:  # llama-server's hard limits [0, INT32_MAX]; -1 is a CLI-only value
        raise range_error("repeat_last_n", repeat_last_n, 0, INT32_MAX)
    repeat_penalty = d.repeat_penalty if req.repeat_penalty is None else req.repeat_penalty
    if repeat_penalty <= 0:
        raise invalid_request(f"Field 'repeat_penalty': Value must be > 0, got {repeat_penalty}")

    def pick(value: float | None, default: float, lo: float = float("-inf"),
             hi: float = float("inf")) -> Any:
        return default if value is None else type(default)(min(max(value, lo), hi))

    def hard(name: str, value: float | None, default: float, lo: float, hi: float) -> Any:
        if value is None:
            return default
        if not lo <= value <= hi:
            raise range_error(name, value, lo, hi)
        return type(default)(value)

    dry_base = d.dry_base if req.dry_base is None or req.dry_base < 1.0 else req.dry_base
    samplers = list(d.samplers)
    if isinstance(req.samplers, list):
        if not all(isinstance(x, str) for x in req.samplers):
            raise invalid_request("Field 'samplers': must be an array of sampler names or a "
                                  "string of sampler chars")
        samplers = samplers_from_names(req.samplers, strict=False)  # unknown: skipped
    elif isinstance(req.samplers, str):
        samplers = samplers_from_chars(req.samplers, strict=False)
    breakers = list(d.dry_sequence_breakers)
    if req.dry_sequence_breakers is not None:
        b = req.dry_sequence_breakers
        if not (isinstance(b, list) and b and all(isinstance(x, str) for x in b)):
            raise invalid_request("Field 'dry_sequence_breakers': Error: dry_sequence_breakers "
                                  "must be a non-empty array of strings")
        breakers = list(b)
    if req.logit_bias is None:
        logit_bias = list(d.logit_bias)
    else:
        try:
            logit_bias = parse_logit_bias(
                req.logit_bias, tok.n_vocab,
                lambda text: tok.encode(text, add_special=False, parse_special=False))
        except ValueError as e:  # a key of digits past int()'s 4300-digit limit
            raise invalid_request(f"Field 'logit_bias': {e}") from None

    params = SamplingParams(
        temperature=pick(req.temperature, d.temperature, 0.0),
        top_k=pick(req.top_k, d.top_k, 0, INT32_MAX),
        top_p=pick(req.top_p, d.top_p, 0.0, 1.0),
        min_p=pick(req.min_p, d.min_p, 0.0, 1.0),
        typical_p=pick(req.typical_p, d.typical_p),
        top_n_sigma=pick(req.top_n_sigma, d.top_n_sigma),
        xtc_probability=pick(req.xtc_probability, d.xtc_probability, 0.0, 1.0),
        xtc_threshold=pick(req.xtc_threshold, d.xtc_threshold, 0.0, 1.0),
        dynatemp_range=pick(req.dynatemp_range, d.dynatemp_range),
        dynatemp_exponent=pick(req.dynatemp_exponent, d.dynatemp_exponent),
        repeat_penalty=repeat_penalty,
        repeat_last_n=min(repeat_last_n, INT32_MAX),  # a window longer than any context
        presence_penalty=pick(req.presence_penalty, d.presence_penalty),
        frequency_penalty=pick(req.frequency_penalty, d.frequency_penalty),
        dry_multiplier=pick(req.dry_multiplier, d.dry_multiplier),
        dry_base=float(dry_base),
        dry_allowed_length=hard("dry_allowed_length", req.dry_allowed_length,
                                d.dry_allowed_length, 0, INT32_MAX),
        dry_penalty_last_n=hard("dry_penalty_last_n", req.dry_penalty_last_n,
                                d.dry_penalty_last_n, 0, INT32_MAX),
        dry_sequence_breakers=breakers,
        mirostat=pick(req.mirostat, d.mirostat, 0, 2),
        mirostat_tau=pick(req.mirostat_tau, d.mirostat_tau),
        mirostat_eta=pick(req.mirostat_eta, d.mirostat_eta),
        adaptive_target=pick(req.adaptive_target, d.adaptive_target, -FLT_MAX, 1.0),
        adaptive_decay=hard("adaptive_decay", req.adaptive_decay, d.adaptive_decay, 0.0, 0.99),
        logit_bias=logit_bias,
        min_keep=hard("min_keep", req.min_keep, d.min_keep, 0, INT32_MAX),
        seed=seed,
        n_probs=n_probs,
        post_sampling_probs=bool(req.post_sampling_probs),
        samplers=samplers,
    )
    try:
        params.validate()
    except ValueError as e:  # a rule of SamplingParams: still a 400, not a 500
        raise invalid_request(str(e)) from None
    if (params.mirostat == 0 and "dry" in params.samplers and params.dry_multiplier != 0.0
            and params.dry_base >= 1.0 and params.dry_penalty_last_n != 0):
        params.dry_breaker_tokens = dry_breakers_for(tok, params.dry_sequence_breakers)
    return params


def response_schema(req: GenerationRequest) -> Any:
    """The JSON schema a request asks for: `json_schema`, or `response_format` as OpenAI
    shapes it (`json_object`, optionally with `schema`; `json_schema` with
    `json_schema.schema`), as llama-server reads them; None for none (or `text`)."""
    schema = req.json_schema
    rf = req.response_format
    if rf is None:
        return schema
    if not isinstance(rf, dict):
        raise invalid_request("Field 'response_format': must be an object")
    kind = rf.get("type", "")
    if kind == "json_object":
        if "schema" in rf or schema is None:
            schema = rf.get("schema") or {}
    elif kind == "json_schema":
        wrapper = rf.get("json_schema")
        if not isinstance(wrapper, dict) or not isinstance(wrapper.get("schema", {}), dict):
            raise invalid_request("Field 'response_format': 'json_schema' must be an object "
                                  "with an object 'schema'")
        schema = wrapper.get("schema", {})
    elif kind not in ("", "text"):
        raise invalid_request('response_format type must be one of "text", "json_object" or '
                              f'"json_schema", but got: {kind}')
    return schema


def request_grammar(req: GenerationRequest, ctx: ParseContext, chat: bool = False) -> str | None:
    """The compiled grammar constraining a request's output: its `grammar` (GBNF, or a
    `%llguidance` Lark grammar), else its JSON schema, else the server's default. As
    llama-server: the grammar wins over a schema (chat: both is an error). Errors are 400s
    naming the field, raised before any slot is touched."""
    schema = response_schema(req)
    text = req.grammar
    if text is not None and not isinstance(text, str):
        raise invalid_request("Field 'grammar': must be a string")
    if chat and schema is not None and text:
        raise invalid_request("Cannot use both json_schema and grammar")
    try:
        if text:
            return grammars.check(grammars.from_gbnf(text), ctx.tokenizer)
        if schema is not None:
            return grammars.check(grammars.from_json_schema(schema), ctx.tokenizer,
                                  "JSON schema")
    except ValueError as e:
        raise invalid_request(f"Field '{'grammar' if text else 'json_schema'}': {e}") from None
    return ctx.defaults.grammar


def _limit(req: GenerationRequest, name: str, default: int, lo: int, hi: int) -> int:
    """An integer field with llama-server's hard limits (400 outside [lo, hi])."""
    value = getattr(req, name)
    if value is None:
        return default
    if not lo <= value <= hi:
        raise range_error(name, value, lo, hi)
    return int(value)


def _spec_types(value: str, served: list[str]) -> list[str]:
    """`speculative.type`: "none", or one or more (comma-separated) of the drafters the
    server runs (its --spec-type); anything else is a 400 naming what it runs."""
    names = list(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
    if not names:
        raise invalid_request("Field 'speculative.type': must name a speculative type or none")
    if "none" in names:  # llama.cpp: "none" anywhere in the list turns speculation off
        return []
    for n in names:
        if n not in served:
            runs = (f"it runs {', '.join(served)} (or none)" if served
                    else "speculative decoding is off on this server (start it with --spec-type)")
            raise invalid_request(f"Field 'speculative.type': {n!r} is not available; {runs}")
    return names


def request_spec(req: GenerationRequest, server: SpecConfig) -> SpecConfig | None:
    """The task's speculative settings: a copy of the server's (`server`) with the request's
    `speculative.*` fields applied, or None when it sets none of them. As llama-server did
    (before it disabled these fields): n_min = min(n_max, n_min), both at least 0; p_min is
    a probability (400 outside [0, 1]); ngram-simple's sizes are hard limits (400)."""
    n_max, n_min, p_min = req.speculative_n_max, req.speculative_n_min, req.speculative_p_min
    size_n, size_m = req.speculative_ngram_size_n, req.speculative_ngram_size_m
    min_hits, kind = req.speculative_ngram_min_hits, req.speculative_type
    if all(v is None for v in (n_max, n_min, p_min, size_n, size_m, min_hits, kind)):
        return None
    spec = dataclasses.replace(server, types=list(server.types))
    if kind is not None:
        spec.types = _spec_types(kind, server.types)
    spec.n_max = min(spec.n_max if n_max is None else n_max, INT32_MAX)
    spec.n_min = max(min(spec.n_max, spec.n_min if n_min is None else n_min), 0)
    spec.n_max = max(spec.n_max, 0)
    if p_min is not None:
        if not 0.0 <= p_min <= 1.0:
            raise range_error("speculative.p_min", p_min, 0.0, 1.0)
        spec.p_min = p_min
    for name, value, lo, hi, attr in (
        ("speculative.ngram_size_n", size_n, 1, 1024, "ngram_simple_size_n"),
        ("speculative.ngram_size_m", size_m, 1, 1024, "ngram_simple_size_m"),
        ("speculative.ngram_min_hits", min_hits, 0, INT32_MAX, "ngram_simple_min_hits"),
    ):
        if value is not None:
            if not lo <= value <= hi:
                raise range_error(name, value, lo, hi)
            setattr(spec, attr, value)
    return spec


def _response_fields(value: Any) -> list[str]:
    """llama-server reads a list of strings; any other value is ignored (json_value)."""
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    return []


def _cache_salt(req: GenerationRequest) -> str:
    """The request's cache namespace ("" when absent). As vLLM, a given salt must be a
    non-empty string: an empty one would silently join the shared namespace a client that
    sends a salt means to leave; the length cap bounds what each slot and cache entry keeps."""
    salt = req.cache_salt
    if salt is None:
        return ""
    if not salt:
        raise invalid_request("Field 'cache_salt': Value must be a non-empty string")
    if len(salt) > MAX_CACHE_SALT:
        raise invalid_request(f"Field 'cache_salt': Value must be at most {MAX_CACHE_SALT} "
                              f"characters long, but got {len(salt)}")
    try:
        salt.encode()  # JSON lets a lone surrogate through: it names no namespace on disk
    except UnicodeEncodeError:
        raise invalid_request("Field 'cache_salt': Value must be valid UTF-8 text") from None
    return salt


RETENTION_S = {"in_memory": 0.0, "24h": 24 * 3600.0}  # prompt_cache_retention -> pin seconds


def _retention(req: GenerationRequest, can_pin: bool) -> float:
    """OpenAI's `prompt_cache_retention`: in_memory (the default: LRU) or 24h (pinned in the
    radix tree, --cache-pin-mib); anything else, or 24h where nothing can be pinned, is a 400
    rather than a promise silently not kept."""
    value = req.prompt_cache_retention
    if value is None:
        return 0.0
    if value not in RETENTION_S:
        raise invalid_request("Field 'prompt_cache_retention': Value must be one of "
                              f"{', '.join(RETENTION_S)}, got {value!r}")
    if RETENTION_S[value] and not can_pin:
        raise invalid_request("Field 'prompt_cache_retention': 24h needs the radix host cache "
                              "(--cache-radix-prompt on, --cache-ram other than 0) and "
                              "--cache-pin-mib above 0")
    return RETENTION_S[value]


def _child_seed(seed: int, j: int) -> int:
    """Seed of the j-th extra completion (llama-server's add_child: seed + j, as uint32)."""
    if seed == -1:
        return -1
    return (seed + j) % 2**32 if seed < 2**32 else seed + j


def build_task(
    req: GenerationRequest, tokens: list[int], n_probs: tuple[str, int], ctx: ParseContext,
    prompts: list[list[int]] | None = None, grammar: str | None = None,
) -> ParsedRequest:
    """The tasks for validated fields `req`, a tokenized prompt (or several: `prompts`),
    (field name, n_probs) and the compiled grammar constraining the output (`grammar`):
    per prompt one task and n_cmpl - 1 children."""
    reject_unimplemented(req)
    prompts = [tokens] if prompts is None else prompts
    for p in prompts:
        check_prompt(p, ctx.n_ctx_slot, ctx.tokenizer.n_vocab)
    n_name, n_cmpl = _first(req, "n_cmpl", "n")
    n_cmpl = 1 if n_cmpl is None else n_cmpl
    if not 1 <= n_cmpl <= ctx.n_slots:
        raise range_error(n_name, n_cmpl, 1, ctx.n_slots)
    d = ctx.defaults
    n_keep = _limit(req, "n_keep", d.n_keep, -1, INT32_MAX)
    n_discard = _limit(req, "n_discard", 0, 0, INT32_MAX)
    n_indent = _limit(req, "n_indent", 0, 0, INT32_MAX)
    t_max_predict_ms = _limit(req, "t_max_predict_ms", -1, -1, 2**63 - 1)
    probs_field, n_probs_value = n_probs
    if not 0 <= n_probs_value <= MAX_N_PROBS:
        raise range_error(probs_field, n_probs_value, 0, MAX_N_PROBS)
    id_slot = -1 if req.id_slot is None else req.id_slot
    if not -1 <= id_slot < ctx.n_slots:
        raise range_error("id_slot", id_slot, -1, ctx.n_slots - 1)
    if req.n_cache_reuse is not None and req.n_cache_reuse < 0:
        raise range_error("n_cache_reuse", req.n_cache_reuse, 0)
    spec = request_spec(req, d.spec)
    task = CompletionTask(
        prompt_tokens=prompts[0],
        params=_sampling(req, n_probs_value, ctx),
        n_predict=_n_predict(req, ctx),
        stop=req.stop or list(d.stop),  # none given: the server's -r strings
        id_slot=id_slot,
        cache_prompt=d.cache_prompt if req.cache_prompt is None else req.cache_prompt,
        n_cache_reuse=req.n_cache_reuse,
        cache_salt=_cache_salt(req),  # prompt arrays and n_cmpl children copy it (replace)
        pin_s=_retention(req, d.can_pin),
        ignore_eos=d.ignore_eos if req.ignore_eos is None else req.ignore_eos,
        special=d.special,
        timings_per_token=bool(req.timings_per_token),
        return_progress=bool(req.return_progress) and bool(req.stream),
        n_probs=n_probs_value,
        stream=bool(req.stream),
        n_keep=n_keep,
        n_discard=n_discard,
        n_indent=n_indent,
        t_max_predict_ms=t_max_predict_ms,
        n_cmpl=n_cmpl,
        grammar=grammar,
        spec=spec,
    )
    tasks: list[CompletionTask] = []
    for p in prompts:
        first = dataclasses.replace(task, prompt_tokens=p, index=len(tasks))
        tasks.append(first)
        for j in range(1, n_cmpl):  # children: no id_slot, their own seed (add_child)
            params = dataclasses.replace(task.params, seed=_child_seed(task.params.seed, j))
            tasks.append(dataclasses.replace(first, params=params, id_slot=-1, parent=first,
                                             index=len(tasks)))
    opts = req.stream_options
    return ParsedRequest(
        task=tasks[0],
        tasks=tasks,
        response_fields=_response_fields(req.response_fields),
        stream=bool(req.stream),
        include_usage=bool(opts and opts.include_usage),
        return_tokens=bool(req.return_tokens),
        post_sampling_probs=bool(req.post_sampling_probs),
        sse_ping_interval=None if req.sse_ping_interval is None
        else _limit(req, "sse_ping_interval", -1, -1, INT32_MAX),
        server_spec=d.spec,
        verbose=d.verbose if req.verbose is None else bool(req.verbose),
    )


def parse_completion(body: Any, ctx: ParseContext) -> ParsedRequest:
    """/completion, /completions and /v1/completions bodies."""
    req = validate_body(CompletionRequest, body)
    prompts = prompt_list(req.prompt, ctx.tokenizer)
    return build_task(req, prompts[0], completion_n_probs(req), ctx, prompts,
                      grammar=request_grammar(req, ctx))


def completion_n_probs(req: CompletionRequest) -> tuple[str, int]:
    """(field, value) of a /completion body's `n_probs`, or OpenAI's `logprobs` (0: none)."""
    field, n_probs = _first(req, "n_probs", "logprobs")
    return field, n_probs or 0


RESERVED_TEMPLATE_VARS = ("messages", "add_generation_prompt", "tools")
# the chat renderer's own keyword parameters (text/chat_caps.render, ChatTemplate.render): a
# template variable of one of these names would collide with them (a TypeError, a 500)
RENDER_PARAMS = frozenset(
    name for fn in (render, ChatTemplate.render)
    for name, p in inspect.signature(fn).parameters.items()
    if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
) - set(RESERVED_TEMPLATE_VARS)


def chat_plan(req: ChatRequest, template: ChatTemplate, tok: Tokenizer,
              ctx: ParseContext | None = None) -> ChatPlan:
    """The prompt text for a chat request, as llama-server builds it, with its tools' grammar
    and reply format (text/chat_format.py).

    A trailing assistant message is a prefill: the reply continues its text. The template's
    leading BOS text is dropped when the tokenizer adds BOS itself (no double BOS).
    """
    if not req.messages:
        raise invalid_request("Field 'messages' must not be empty")
    msgs = [m.to_template() for m in req.messages]
    for i, m in enumerate(msgs):
        if m.get("content") is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise invalid_request(f"Field 'messages[{i}].content' is required")
    add_gen = True if req.add_generation_prompt is None else req.add_generation_prompt
    d = ctx.defaults if ctx is not None else None
    prefill = ""
    if _continues(req, msgs, add_gen, d is None or d.prefill_assistant):
        prefill, add_gen = flatten_content(msgs.pop()["content"]), True
    extra = {**(d.chat_template_kwargs if d else {}), **(req.chat_template_kwargs or {})}
    for name in RESERVED_TEMPLATE_VARS:
        if name in extra:
            raise invalid_request(f"Field 'chat_template_kwargs': '{name}' is set by the "
                                  "request itself and cannot be overridden")
    clash = sorted(RENDER_PARAMS & set(extra))
    if clash:
        raise invalid_request(f"Field 'chat_template_kwargs': '{clash[0]}' is a reserved name")
    inputs = ChatInputs(
        msgs, add_gen, extra, tools=req.tools, tool_choice=req.tool_choice,
        parallel_tool_calls=req.parallel_tool_calls, json_schema=response_schema(req),
        reasoning_format=req.reasoning_format if req.reasoning_format is not None
        else d.reasoning_format if d else "auto",
        custom_grammar=req.grammar is not None, parse_output=not (d and d.skip_chat_parsing),
        prefill=prefill, bos=template.bos_token if tok.add_bos else "",
        eos=template.eos_token if tok.add_eos else "")
    try:
        return plan_chat(template, inputs)
    except ValueError as e:
        raise invalid_request(str(e)) from None


def _continues(req: ChatRequest, msgs: list[dict[str, Any]], add_gen: bool,
               prefill_assistant: bool) -> bool:
    """Whether the reply continues the final assistant message (llama-server's rules): asked
    by `continue_final_message` (vLLM's field: true or "content"; with
    `add_generation_prompt: false`), or implied by a final assistant message (assistant
    prefill, unless --no-prefill-assistant). Contradictions are 400s with its messages."""
    value, last = req.continue_final_message, msgs[-1]
    if value is True or value == "content":
        asked = True
    elif value == "reasoning_content":
        raise invalid_request("Field 'continue_final_message': continuing the reasoning is not "
                              'supported by this server (true or "content" continue the content)')
    else:  # llama.cpp: any other value asks for nothing
        asked = False
    if not asked and prefill_assistant and last["role"] == "assistant":
        if len(msgs) >= 2 and msgs[-2]["role"] == "assistant":
            raise invalid_request("Cannot have 2 or more assistant messages at the end of the "
                                  "list.")
        asked, add_gen = True, False
    if not asked:
        return False
    if add_gen:
        raise invalid_request("Cannot set both add_generation_prompt and "
                              "continue_final_message to true.")
    if last["role"] != "assistant":
        raise invalid_request("Field 'continue_final_message': the last message must be the "
                              "assistant's to continue")
    if last.get("tool_calls"):
        raise invalid_request("Cannot continue an assistant message that contains tool calls.")
    return True


def render_chat(req: ChatRequest, template: ChatTemplate, tok: Tokenizer,
                ctx: ParseContext | None = None) -> str:
    """The prompt text of a chat request (/apply-template shows it)."""
    return chat_plan(req, template, tok, ctx).prompt


def chat_n_probs(req: ChatRequest) -> tuple[str, int]:
    """OpenAI `logprobs: true` + `top_logprobs` (default 20) -> n_probs, else native n_probs."""
    if req.logprobs:
        return "top_logprobs", 20 if req.top_logprobs is None else req.top_logprobs
    if req.top_logprobs is not None:
        raise invalid_request("Field 'top_logprobs' requires 'logprobs' to be true")
    return "n_probs", req.n_probs or 0


def chat_tokens(req: ChatRequest, ctx: ParseContext) -> tuple[ChatPlan, list[int]]:
    """A chat request's plan and its prompt's tokens."""
    plan = chat_plan(req, ctx.chat_template, ctx.tokenizer, ctx)
    return plan, ctx.tokenizer.encode(plan.prompt, add_special=True, parse_special=True)


def parse_chat(body: Any, ctx: ParseContext) -> ParsedRequest:
    """/chat/completions and /v1/chat/completions bodies."""
    req = validate_body(ChatRequest, body)
    n_probs = chat_n_probs(req)
    plan, tokens = chat_tokens(req, ctx)
    if plan.grammar is None:
        grammar = request_grammar(req, ctx, chat=True)
    else:  # the tools' grammar (a request's own grammar or schema is part of it, or refused)
        try:
            grammar = grammars.check(plan.grammar, ctx.tokenizer)
        except ValueError as e:  # harmony builds one for a JSON schema too
            raise invalid_request(f"Field '{'tools' if req.tools else 'json_schema'}': {e}"
                                  ) from None
    parsed = build_task(req, tokens, n_probs, ctx, grammar=grammar)
    parsed.chat_output = plan.output
    parsed.prefill = plan.prefill
    parsed.stream_prefill = not (req.continue_final_message is True
                                 or req.continue_final_message == "content")
    starts = user_starts(tokens, ctx.chat_template, ctx.tokenizer)
    for t in parsed.tasks:
        t.user_starts = starts
    return parsed


def user_starts(tokens: list[int], template: ChatTemplate, tok: Tokenizer) -> tuple[int, ...]:
    """Where the template's user-message opening occurs in the prompt's tokens (llama-server's
    `find_message_spans`: the delimiter tokenized alone, searched for)."""
    delim = tok.encode(template.user_start, add_special=False, parse_special=True)
    if not delim:
        return ()
    n, first = len(delim), delim[0]
    return tuple(i for i, t in enumerate(tokens)
                 if t == first and tokens[i : i + n] == delim)
