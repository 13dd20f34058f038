"""Request bodies as pydantic models: JSON types checked, errors named after the field.

llama-server reads loosely typed JSON; we check types up front so a client bug ("n_predict":
"64") is a clear 400 naming the field instead of a silently ignored setting. As in
llama-server, `null` means "absent" and unknown keys are ignored. Value ranges and the
prompt itself are checked in `parse.py`, which turns these models into a `CompletionTask`.
"""

from __future__ import annotations

import logging
import math
from typing import Annotated, Any, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from radixserve.errors import TaskError, invalid_request, show
from radixserve.text.chat_template import flatten_content

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def _int(v: Any) -> int:
    """JSON integers (and integral floats such as 64.0); never bools or numeric strings.

    Validators raise ValueError, not TypeError: only ValueError becomes a pydantic error."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"Value must be an integer, but got {show(v)}")
    return v


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"Value must be a finite number, but got {show(v)}")
    return float(v)


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"Value must be a boolean, but got {show(v)}")
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"Value must be a string, but got {show(v)}")
    return v


def _stop(v: Any) -> list[str]:
    """`stop`: a string or a list of strings; empty strings dropped (they would match at once)."""
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ValueError(f"Value must be a string or a list of strings, but got {show(v)}")
    return [s for s in items if s]


Int = Annotated[int, BeforeValidator(_int)]
Float = Annotated[float, BeforeValidator(_float)]
Bool = Annotated[bool, BeforeValidator(_bool)]
Str = Annotated[str, BeforeValidator(_str)]
Stop = Annotated[list[str], BeforeValidator(_stop)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: Bool | None = None


class GenerationRequest(_Body):
    """Fields every completion endpoint accepts (llama-server's `params_from_json_cmpl`).

    Chat requests accept them too: llama-server passes unknown chat keys to this parser, so
    `id_slot`, `cache_prompt`, `top_k`... work on /v1/chat/completions.
    """

    n_predict: Int | None = None
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    stream: Bool | None = None
    stream_options: StreamOptions | None = None
    cache_prompt: Bool | None = None
    return_tokens: Bool | None = None
    id_slot: Int | None = None
    n_cache_reuse: Int | None = None
    # vLLM's cache namespace (a non-empty string of at most 512 characters, checked in
    # parse.py): requests of different salts never share cached prompt KV
    cache_salt: Str | None = None
    # OpenAI's prompt-cache fields: a routing hint (radixserve cluster) and how long the
    # prompt should stay cached (in_memory | 24h), checked in parse.py
    prompt_cache_key: Str | None = None
    prompt_cache_retention: Str | None = None
    model: Str | None = None  # accepted and ignored: one model per server
    # -- sampling (sampling/chain.py; llama.cpp's common_params_sampling) --
    temperature: Float | None = None
    top_k: Int | None = None
    top_p: Float | None = None
    min_p: Float | None = None
    top_n_sigma: Float | None = None
    xtc_probability: Float | None = None
    xtc_threshold: Float | None = None
    typical_p: Float | None = None
    dynatemp_range: Float | None = None
    dynatemp_exponent: Float | None = None
    repeat_penalty: Float | None = None
    repeat_last_n: Int | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    dry_multiplier: Float | None = None
    dry_base: Float | None = None
    dry_allowed_length: Int | None = None
    dry_penalty_last_n: Int | None = None
    dry_sequence_breakers: Any = None
    mirostat: Int | None = None
    mirostat_tau: Float | None = None
    mirostat_eta: Float | None = None
    adaptive_target: Float | None = None
    adaptive_decay: Float | None = None
    seed: Int | None = None
    min_keep: Int | None = None
    logit_bias: Any = None
    samplers: Any = None
    ignore_eos: Bool | None = None
    n_probs: Int | None = None
    post_sampling_probs: Bool | None = None
    stop: Stop | None = None
    # -- generation limits and context (engine) --
    n_keep: Int | None = None
    n_discard: Int | None = None
    n_indent: Int | None = None
    t_max_predict_ms: Int | None = None
    response_fields: Any = None
    n: Int | None = None
    n_cmpl: Int | None = None
    # -- accepted: only shape llama-server's output in ways that do not apply here --
    timings_per_token: Bool | None = None
    return_progress: Bool | None = None
    verbose: Bool | None = None
    backend_sampling: Bool | None = None
    sse_ping_interval: Int | None = None
    # -- speculative decoding: llama-server's flat dotted keys ("speculative.n_max": 8),
    # applied to a copy of the server's --spec-* settings in parse.py --
    speculative_n_max: Int | None = Field(None, alias="speculative.n_max")
    speculative_n_min: Int | None = Field(None, alias="speculative.n_min")
    speculative_p_min: Float | None = Field(None, alias="speculative.p_min")
    speculative_type: Str | None = Field(None, alias="speculative.type")
    speculative_ngram_size_n: Int | None = Field(None, alias="speculative.ngram_size_n")
    speculative_ngram_size_m: Int | None = Field(None, alias="speculative.ngram_size_m")
    speculative_ngram_min_hits: Int | None = Field(None, alias="speculative.ngram_min_hits")
    # -- constraints and tools: checked in parse.py / text/chat_format.py --
    grammar: Any = None
    json_schema: Any = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    reasoning_format: Any = None
    parse_tool_calls: Any = None
    # Fields llama-server honors that this server does not implement: a value other than
    # null is refused with a 400 naming the field (fields.py), never silently ignored.
    grammar_lazy: Any = None
    grammar_triggers: Any = None
    preserved_tokens: Any = None
    lora: Any = None
    chat_format: Any = None
    generation_prompt: Any = None
    chat_parser: Any = None
    continue_final_message: Any = None
    echo: Any = None
    reasoning_control: Any = None
    reasoning_budget_tokens: Any = None
    reasoning_budget_start_tag: Any = None
    reasoning_budget_end_tags: Any = None
    reasoning_budget_end_tag: Any = None
    reasoning_budget_message: Any = None
    image_data: Any = None
    multimodal_data: Any = None


class CompletionRequest(GenerationRequest):
    """/completion, /completions, /v1/completions. `prompt` is checked in parse.py (4 forms).

    `logprobs` is the OpenAI /v1/completions integer (an alias of `n_probs`).
    """

    prompt: Any = None
    logprobs: Int | None = None


class InfillRequest(CompletionRequest):
    """/infill: a /completion body (its `prompt` a string: text after the prefix) plus the
    code around the hole; checked in routes_infill.py with llama-server's messages."""

    input_prefix: Any = None
    input_suffix: Any = None
    input_extra: Any = None


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id reach the template

    role: Str
    content: Any = None
    tool_calls: Any = None  # checked here only as far as the template polyfills read it

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in CHAT_ROLES:
            raise ValueError(f"unknown role {role!r} (expected one of {', '.join(CHAT_ROLES)})")
        return role

    @field_validator("content")
    @classmethod
    def _content_shape(cls, content: Any) -> Any:
        flatten_content(content)  # ValueError for anything but a string or a list of text parts
        return content

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls_shape(cls, calls: Any) -> Any:
        """An array of objects whose `function`, where given, is an object (text/chat_caps.py
        reads them so when the template cannot show tool calls itself)."""
        if calls is None:
            return calls
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise ValueError(f"Value must be an array of tool call objects, but got "
                             f"{show(calls)}")
        for c in calls:
            if c.get("function") is not None and not isinstance(c["function"], dict):
                raise ValueError(f"a tool call's 'function' must be an object, but got "
                                 f"{show(c['function'])}")
        return calls

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template sees it, extra keys included, nulls dropped."""
        return {k: v for k, v in self.model_dump().items() if v is not None or k == "content"}


class ChatRequest(GenerationRequest):
    """/v1/chat/completions and /apply-template."""

    messages: list[ChatMessage]
    logprobs: Bool | None = None
    top_logprobs: Int | None = None
    add_generation_prompt: Bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Body):
    content: Any = None  # a string or a mixed list of strings and token ids
    add_special: Bool | None = None
    parse_special: Bool | None = None
    with_pieces: Bool | None = None


class DetokenizeRequest(_Body):
    tokens: list[Int] | None = None


class EmbeddingRequest(_Body):
    """/embedding, /embeddings, /v1/embeddings (llama-server's handle_embeddings_impl)."""

    input: Any = None  # a text, token ids, a mixed list, or a list of those
    content: Any = None  # llama-server's own name for `input` (answered in its own shape)
    encoding_format: Str | None = None  # float | base64
    embd_normalize: Int | None = None
    dimensions: Int | None = None
    model: Str | None = None


M = TypeVar("M", bound=BaseModel)


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validation_message(e: ValidationError) -> str:
    """llama-server style: `Field 'n_predict': Value must be an integer, but got "64"`."""
    err = e.errors(include_url=False)[0]
    field = _loc(tuple(err["loc"]))
    if err["type"] == "missing":
        return f"Field '{field}' is required"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] in ("model_type", "model_attributes_type", "dict_type", "list_type"):
        msg = f"{msg}, but got {show(err.get('input'))}"
    return f"Field '{field}': {msg}" if field else msg


def validate_body(model: type[M], body: Any) -> M:
    """`body` (decoded JSON) as `model`, or TaskError 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise invalid_request(f"request body must be a JSON object, got {show(body)}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise invalid_request(validation_message(e)) from None


def range_error(field: str, value: Any, lo: float, hi: float | None = None) -> TaskError:
    bounds = f"between {lo} <= value <= {hi}" if hi is not None else f">= {lo}"
    return invalid_request(f"Field '{field}': Value must be {bounds}, but got {value}")
