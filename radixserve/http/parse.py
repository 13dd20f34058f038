"""Validated request models -> `CompletionTask` (prompt tokens, sampling, limits).

This is where llama-server's request semantics live: prompt forms and BOS rules, the
n_predict aliases, soft limits clamped silently and hard limits rejected, OpenAI chat
`logprobs`, and the context-size check that must fail before a slot is taken.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from radixserve.engine.task import CompletionTask, TaskError, invalid_request
from radixserve.http.schemas import (
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    range_error,
    validate_body,
)
from radixserve.model.chat_template import ChatTemplate, flatten_content
from radixserve.model.sampling import SamplingParams
from radixserve.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1  # n_predict is capped by the context anyway; keep it a sane int
MAX_N_PROBS = 100
LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's "random seed" value


@dataclass(slots=True)
class ParseContext:
    """What request parsing needs from the server: the model's text side and slot limits."""

    tokenizer: Tokenizer
    chat_template: ChatTemplate
    n_ctx_slot: int
    n_slots: int
    default_n_predict: int = -1  # --n-predict; also a cap on what requests may ask for
    default_cache_prompt: bool = True
    default_seed: int = -1


@dataclass(slots=True)
class ParsedRequest:
    """A task plus how the response must be shaped (nothing here reaches the engine)."""

    task: CompletionTask
    stream: bool = False
    include_usage: bool = False
    return_tokens: bool = False
    post_sampling_probs: bool = False


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


def prompt_tokens(prompt: Any, tok: Tokenizer) -> list[int]:
    """Tokens of a /completion `prompt`: a string, token ids, a mixed list, `{prompt_string}`,
    or a one-element list of those. Several prompts in one request are rejected (400)."""
    if prompt is None:
        raise invalid_request('"prompt" is required')
    if isinstance(prompt, dict):
        if prompt.get("multimodal_data"):
            raise invalid_request("multimodal prompts are not supported")
        if not isinstance(prompt.get("prompt_string"), str):
            raise invalid_request("a prompt object needs a string 'prompt_string'")
        return tok.encode(prompt["prompt_string"])
    if isinstance(prompt, list) and prompt:
        has_str = any(isinstance(p, str) for p in prompt)
        has_int = any(isinstance(p, int) and not isinstance(p, bool) for p in prompt)
        if not (has_int or (has_str and len(prompt) == 1)):  # a list of prompts
            if len(prompt) > 1:
                raise invalid_request("multiple prompts are not supported")
            return prompt_tokens(prompt[0], tok)
    return tokenize_mixed(prompt, tok, add_special=True, parse_special=True)


def check_prompt(tokens: list[int], ctx: ParseContext) -> None:
    """Reject what can never run: no tokens, unknown ids, or no room left to generate."""
    if not tokens:
        raise invalid_request('"prompt" must not be empty')
    n_vocab = ctx.tokenizer.n_vocab
    if any(not 0 <= t < n_vocab for t in tokens):
        raise invalid_request("Prompt contains invalid tokens")
    if len(tokens) >= ctx.n_ctx_slot:
        raise TaskError(
            400,
            "exceed_context_size_error",
            f"request ({len(tokens)} tokens) exceeds the available context size "
            f"({ctx.n_ctx_slot} tokens), try increasing it",
            n_prompt_tokens=len(tokens),
            n_ctx=ctx.n_ctx_slot,
        )


def _first(req: GenerationRequest, *names: str) -> tuple[str, Any]:
    for name in names:
        value = getattr(req, name, None)
        if value is not None:
            return name, value
    return names[0], None


def _n_predict(req: GenerationRequest, ctx: ParseContext) -> int:
    name, n = _first(req, "n_predict", "max_tokens", "max_completion_tokens")
    if n is None:
        return ctx.default_n_predict
    if n < -1:
        raise range_error(name, n, -1)
    n = min(n, INT32_MAX)
    cap = ctx.default_n_predict  # llama-server: the server's --n-predict caps requests
    return n if cap < 0 else cap if n < 0 else min(n, cap)


def _sampling(req: GenerationRequest, n_probs: int, ctx: ParseContext) -> SamplingParams:
    """SamplingParams with llama-server's soft limits clamped and hard limits enforced."""
    d = SamplingParams()
    seed = ctx.default_seed if req.seed is None else req.seed
    if seed == LLAMA_DEFAULT_SEED:
        seed = -1
    if seed != -1 and not 0 <= seed < 2**64:
        raise range_error("seed", seed, -1, 2**64 - 1)
    repeat_last_n = d.repeat_last_n if req.repeat_last_n is None else req.repeat_last_n
    if repeat_last_n < -1:
        raise range_error("repeat_last_n", repeat_last_n, -1)
    repeat_penalty = d.repeat_penalty if req.repeat_penalty is None else req.repeat_penalty
    if repeat_penalty <= 0:
        raise invalid_request(f"Field 'repeat_penalty': Value must be > 0, got {repeat_penalty}")

    def pick(value: float | None, default: float, lo: float, hi: float = float("inf")) -> Any:
        return default if value is None else type(default)(min(max(value, lo), hi))

    params = SamplingParams(
        temperature=pick(req.temperature, d.temperature, 0.0),
        top_k=pick(req.top_k, d.top_k, 0, INT32_MAX),
        top_p=pick(req.top_p, d.top_p, 0.0, 1.0),
        min_p=pick(req.min_p, d.min_p, 0.0, 1.0),
        repeat_penalty=repeat_penalty,
        repeat_last_n=min(repeat_last_n, INT32_MAX),  # a window longer than any context
        presence_penalty=pick(req.presence_penalty, d.presence_penalty, float("-inf")),
        frequency_penalty=pick(req.frequency_penalty, d.frequency_penalty, float("-inf")),
        seed=seed,
        n_probs=n_probs,
    )
    try:
        params.validate()
    except ValueError as e:  # a rule added to SamplingParams later: still a 400, not a 500
        raise invalid_request(str(e)) from None
    return params


def _reject_unsupported(req: GenerationRequest) -> None:
    for name in ("grammar", "json_schema", "logit_bias", "tools"):
        if getattr(req, name):
            raise invalid_request(f"Field '{name}' is not supported by this server")
    rf = req.response_format
    if rf is not None and not (isinstance(rf, dict) and rf.get("type", "text") == "text"):
        raise invalid_request('Field \'response_format\': only {"type": "text"} is supported')
    name, n = _first(req, "n_cmpl", "n")
    if n is not None and n != 1:
        raise invalid_request(f"Field '{name}': only 1 completion per request is supported")


def build_task(
    req: GenerationRequest, tokens: list[int], n_probs: tuple[str, int], ctx: ParseContext
) -> ParsedRequest:
    """The task for validated fields `req`, a tokenized prompt and (field name, n_probs)."""
    _reject_unsupported(req)
    check_prompt(tokens, ctx)
    probs_field, n_probs_value = n_probs
    if not 0 <= n_probs_value <= MAX_N_PROBS:
        raise range_error(probs_field, n_probs_value, 0, MAX_N_PROBS)
    id_slot = -1 if req.id_slot is None else req.id_slot
    if not -1 <= id_slot < ctx.n_slots:
        raise range_error("id_slot", id_slot, -1, ctx.n_slots - 1)
    if req.n_cache_reuse is not None and req.n_cache_reuse < 0:
        raise range_error("n_cache_reuse", req.n_cache_reuse, 0)
    task = CompletionTask(
        prompt_tokens=tokens,
        params=_sampling(req, n_probs_value, ctx),
        n_predict=_n_predict(req, ctx),
        stop=req.stop or [],
        id_slot=id_slot,
        cache_prompt=ctx.default_cache_prompt if req.cache_prompt is None else req.cache_prompt,
        n_cache_reuse=req.n_cache_reuse,
        ignore_eos=bool(req.ignore_eos),
        n_probs=n_probs_value,
        stream=bool(req.stream),
    )
    opts = req.stream_options
    return ParsedRequest(
        task=task,
        stream=bool(req.stream),
        include_usage=bool(opts and opts.include_usage),
        return_tokens=bool(req.return_tokens),
        post_sampling_probs=bool(req.post_sampling_probs),
    )


def parse_completion(body: Any, ctx: ParseContext) -> ParsedRequest:
    """/completion, /completions and /v1/completions bodies."""
    req = validate_body(CompletionRequest, body)
    field, n_probs = _first(req, "n_probs", "logprobs")
    tokens = prompt_tokens(req.prompt, ctx.tokenizer)
    return build_task(req, tokens, (field, n_probs or 0), ctx)


def render_chat(req: ChatRequest, template: ChatTemplate, tok: Tokenizer) -> str:
    """The prompt text for a chat request, as llama-server builds it.

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
    prefill = ""
    if add_gen and msgs[-1]["role"] == "assistant":
        prefill = flatten_content(msgs.pop()["content"])
    try:
        extra = req.chat_template_kwargs or {}
        text = template.render(msgs, add_generation_prompt=add_gen, **extra)
    except ValueError as e:
        raise invalid_request(str(e)) from None
    if tok.add_bos and template.bos_token and text.startswith(template.bos_token):
        text = text[len(template.bos_token) :]
    if tok.add_eos and template.eos_token and text.endswith(template.eos_token) and not prefill:
        text = text[: -len(template.eos_token)]
    return text + prefill


def chat_n_probs(req: ChatRequest) -> tuple[str, int]:
    """OpenAI `logprobs: true` + `top_logprobs` (default 20) -> n_probs, else native n_probs."""
    if req.logprobs:
        return "top_logprobs", 20 if req.top_logprobs is None else req.top_logprobs
    if req.top_logprobs is not None:
        raise invalid_request("Field 'top_logprobs' requires 'logprobs' to be true")
    return "n_probs", req.n_probs or 0


def parse_chat(body: Any, ctx: ParseContext) -> ParsedRequest:
    """/chat/completions and /v1/chat/completions bodies."""
    req = validate_body(ChatRequest, body)
    n_probs = chat_n_probs(req)
    text = render_chat(req, ctx.chat_template, ctx.tokenizer)
    tokens = ctx.tokenizer.encode(text, add_special=True, parse_special=True)
    return build_task(req, tokens, n_probs, ctx)
