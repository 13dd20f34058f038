"""The OpenAPI document's request bodies, parameters and responses (`app.openapi()`).

Routes read their bodies by hand (`errors.read_json`, then the pydantic models of schemas.py
and the checks of parse.py), so FastAPI sees no body to describe. The pieces here describe
them: built from schemas.py's models (a field added there is documented at once), with what
the models leave loose (`Any` fields; value ranges checked in parse.py; fields refused as
not implemented, fields.py) spelled out, so that a client generator or a schema fuzzer
(tests/http/test_fuzz_schema.py) sends real field names with real shapes. Documentation only:
nothing here validates a request, and `null` is always allowed ("absent", as llama-server).
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import Path
from pydantic import BaseModel

from radixserve.http.fields import _UNIMPLEMENTED
from radixserve.http.oai_responses import ResponsesRequest
from radixserve.http.parse import INT32_MAX, MAX_CACHE_SALT, MAX_N_PROBS
from radixserve.http.schemas import (
    CHAT_ROLES,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    InfillRequest,
    TokenizeRequest,
)
from radixserve.text.chat_format import REASONING_FORMATS, TOOL_CHOICES

Schema = dict[str, Any]


def _int(lo: int | None = None, hi: int | None = None, doc: str = "") -> Schema:
    s: Schema = {"type": "integer"}
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return {**s, "description": doc} if doc else s


def _num(lo: float, hi: float) -> Schema:
    return {"type": "number", "minimum": lo, "maximum": hi}


_STRINGS: Schema = {"type": "array", "items": {"type": "string"}}
_OBJECT: Schema = {"type": "object"}
_TOKEN_IDS: Schema = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_MIXED: Schema = {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}
_PROMPT_IDS: Schema = {**_TOKEN_IDS, "minItems": 1}  # token ids below the vocabulary's size
_PROMPT_MIXED: Schema = {**_MIXED, "minItems": 1}
_PROMPT_OBJECT: Schema = {
    "type": "object", "required": ["prompt_string"],
    "properties": {"prompt_string": {"type": "string", "minLength": 1}},
}
_ONE_PROMPT: list[Schema] = [{"type": "string", "minLength": 1}, _PROMPT_IDS, _PROMPT_MIXED,
                             _PROMPT_OBJECT]
_TOOL: Schema = {
    "type": "object", "required": ["type", "function"],
    "properties": {
        "type": {"enum": ["function"]},
        "function": {
            "type": "object", "required": ["name"],
            "properties": {"name": {"type": "string", "minLength": 1},
                           "description": {"type": "string"}, "parameters": _OBJECT},
        },
    },
}

# Fields of the generation requests whose model type is loose (`Any`) or whose hard limits
# parse.py checks (400 outside them). Soft limits (clamped silently: temperature, top_p...)
# are not bounds. `id_slot` and `n`/`n_cmpl` are also below the server's slot count.
GENERATION_FIELDS: dict[str, Schema] = {
    "n_predict": _int(-1, doc="tokens to generate; -1: until EOS or the context is full "
                              "(the server's --n-predict caps it)"),
    "max_tokens": _int(-1, doc="alias of n_predict"),
    "max_completion_tokens": _int(-1, doc="alias of n_predict"),
    "id_slot": _int(-1, doc="the slot to run in (below the server's slot count); -1: any"),
    "n_cache_reuse": _int(0),
    "cache_salt": {"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT,
                   "description": "the prompt cache's namespace: different salts share no KV"},
    "prompt_cache_key": {"type": "string", "description": "OpenAI's routing hint: in "
                         "radixserve cluster, requests with the same key go to one replica"},
    "prompt_cache_retention": {"type": "string", "enum": ["in_memory", "24h"],
                               "description": "24h: the prompt stays pinned in the radix "
                               "cache (--cache-pin-mib)"},
    "repeat_last_n": _int(0),
    "repeat_penalty": {"type": "number", "exclusiveMinimum": 0},
    "dry_allowed_length": _int(0),
    "dry_penalty_last_n": _int(0),
    "min_keep": _int(0),
    "adaptive_decay": _num(0.0, 0.99),
    "seed": _int(-1, 2**64 - 1, doc="-1 (or 4294967295): random"),
    "n_probs": _int(0, MAX_N_PROBS),
    "n_keep": _int(-1),
    "n_discard": _int(0),
    "n_indent": _int(0),
    "t_max_predict_ms": _int(-1),
    "n": _int(1, doc="completions per prompt (at most the server's slot count)"),
    "n_cmpl": _int(1, doc="alias of n"),
    "sse_ping_interval": _int(-1, INT32_MAX),
    "speculative.p_min": _num(0.0, 1.0),
    "speculative.ngram_size_n": _int(1, 1024),
    "speculative.ngram_size_m": _int(1, 1024),
    "speculative.ngram_min_hits": _int(0),
    "stop": {"anyOf": [{"type": "string"}, _STRINGS]},
    "dry_sequence_breakers": {**_STRINGS, "minItems": 1},
    "logit_bias": {
        "description": "[[token id or text, bias or false], ...] or {token id or text: bias "
                       "or false}; false bans the token",
        "anyOf": [
            {"type": "array", "items": {
                "type": "array", "minItems": 2, "maxItems": 2,
                "prefixItems": [{"anyOf": [{"type": "integer"}, {"type": "string"}]},
                                {"anyOf": [{"type": "number"}, {"enum": [False]}]}]}},
            {"type": "object",
             "additionalProperties": {"anyOf": [{"type": "number"}, {"enum": [False]}]}},
        ],
    },
    "samplers": {"anyOf": [_STRINGS, {"type": "string"}],
                 "description": "sampler names, or a string of sampler chars"},
    "response_fields": _STRINGS,
    "grammar": {"type": "string", "description": "GBNF, or a %llguidance Lark grammar"},
    "json_schema": _OBJECT,
    "response_format": {
        "type": "object",
        "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "schema": _OBJECT,
            "json_schema": {"type": "object", "properties": {"name": {"type": "string"},
                                                             "schema": _OBJECT}},
        },
    },
    "tools": {"type": "array", "items": _TOOL},
    "tool_choice": {"anyOf": [
        {"enum": list(TOOL_CHOICES)},
        {"type": "object", "required": ["type", "function"],
         "properties": {"type": {"enum": ["function"]},
                        "function": {"type": "object", "required": ["name"],
                                     "properties": {"name": {"type": "string"}}}}},
    ]},
    "parallel_tool_calls": {"type": "boolean"},
    "reasoning_format": {"enum": list(REASONING_FORMATS)},
    "continue_final_message": {
        "description": "chat: continue the final assistant message (with "
                       "add_generation_prompt false); reasoning_content is refused",
        "anyOf": [{"type": "boolean"}, {"enum": ["content", "reasoning_content"]}]},
    # not implemented: only the values that ask for nothing (fields.py); others are a 400
    **{name: {"enum": list(harmless), "description": f"not implemented ({feature}): any "
              "other value is refused"} if harmless else
       {"type": "null", "description": f"not implemented ({feature})"}
       for name, (harmless, feature) in _UNIMPLEMENTED.items()},
}

COMPLETION_FIELDS: dict[str, Schema] = {
    "prompt": {
        "description": "a string, token ids, a mixed list of strings and token ids, a "
                       "{prompt_string} object, or a list of such prompts (one task each)",
        "anyOf": [*_ONE_PROMPT, {"type": "array", "minItems": 1,
                                 "items": {"anyOf": [{"type": "string", "minLength": 1},
                                                     _PROMPT_MIXED, _PROMPT_OBJECT]}}],
    },
    "logprobs": _int(0, MAX_N_PROBS, doc="OpenAI's alias of n_probs"),
}

_MESSAGE: Schema = {
    "type": "object", "required": ["role", "content"],
    "properties": {
        "role": {"enum": list(CHAT_ROLES)},
        "content": {
            "description": "a string or a list of text parts (null only in an assistant "
                           "message with tool_calls)",
            "anyOf": [{"type": "string"},
                      {"type": "array", "items": {
                          "type": "object", "required": ["type", "text"],
                          "properties": {"type": {"enum": ["text"]},
                                         "text": {"type": "string"}}}}],
        },
        "name": {"type": "string"},
        "tool_call_id": {"type": "string"},
        "tool_calls": {"type": "array", "items": _OBJECT},
    },
}

CHAT_FIELDS: dict[str, Schema] = {
    "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
    "top_logprobs": _int(0, MAX_N_PROBS, doc="needs logprobs: true"),
}

TOKENIZE_FIELDS: dict[str, Schema] = {
    "content": {"anyOf": [{"type": "string"}, _MIXED],
                "description": "text, or a mixed list of texts and token ids"},
}

DETOKENIZE_FIELDS: dict[str, Schema] = {"tokens": _TOKEN_IDS}

_EMBED_ONE: Schema = {"anyOf": [{"type": "string", "minLength": 1}, _PROMPT_IDS,
                                _PROMPT_MIXED]}
_EMBED_INPUT: Schema = {"anyOf": [_EMBED_ONE, {"type": "array", "minItems": 1,
                                               "items": {"type": "string", "minLength": 1}}],
                        "description": "a text, token ids, a mixed list, or a list of texts"}
EMBEDDING_FIELDS: dict[str, Schema] = {
    "input": _EMBED_INPUT,
    "content": {**_EMBED_INPUT, "description": "llama-server's name for `input` (its own "
                "response shape)"},
    "encoding_format": {"enum": ["float", "base64"]},
    "embd_normalize": {"type": "integer", "minimum": -1, "maximum": 8,
                       "description": "-1 none, 0 max absolute, 2 euclidean, p > 2 p-norm"},
    "dimensions": {"description": "only the model's own width (no reduced dimensions)"},
}


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    """`node` with every `#/$defs/...` reference replaced by its definition, titles dropped."""
    if isinstance(node, dict):
        ref = node.get("$ref", "")
        if ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline(v, defs) for k, v in node.items() if k not in ("title", "$defs")}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def body_schema(model: type[BaseModel], fields: dict[str, Schema],
                required: tuple[str, ...] = ()) -> Schema:
    """The JSON schema of `model`'s body: every field under its JSON name, inlined, with
    `fields` replacing the model's own type (each nullable; one holding only a description
    keeps the model's type), and `required` added."""
    raw = model.model_json_schema(by_alias=True)
    schema = _inline(raw, raw.get("$defs", {}))
    props: dict[str, Any] = schema["properties"]
    for name, s in fields.items():
        if name in props:
            s = copy.deepcopy(s)
            doc = s.pop("description", None)
            if not s:
                props[name] = {**props[name], "description": doc}
            elif name in schema.get("required", ()) or name in required:
                props[name] = s if doc is None else {**s, "description": doc}
            else:
                props[name] = {"anyOf": [s, {"type": "null"}], "default": None,
                               **({"description": doc} if doc else {})}
    req = list(dict.fromkeys([*schema.get("required", ()), *required]))
    if req:
        schema["required"] = req
    schema.pop("description", None)
    return schema


def _request_body(schema: Schema, required: bool = True) -> Schema:
    return {"requestBody": {"required": required,
                            "content": {"application/json": {"schema": schema}}}}


ERROR: Schema = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["code", "message", "type"],
        "properties": {"code": {"type": "integer"}, "message": {"type": "string"},
                       "type": {"type": "string"}},
    }},
}

# every route's failures: the router adds this to each operation (errors.py shapes them all)
ERROR_RESPONSES: dict[int | str, Any] = {
    "default": {"description": "An error, in OpenAI's shape (errors.py)",
                "content": {"application/json": {"schema": ERROR}}},
}

_SSE = {"200": {"description": "One JSON body, or with `stream: true` server-sent events",
                "content": {"text/event-stream": {"schema": {"type": "string"}}}}}

COMPLETION: Schema = {**_request_body(body_schema(
    CompletionRequest, {**GENERATION_FIELDS, **COMPLETION_FIELDS}, ("prompt",))), "responses": _SSE}
CHAT: Schema = {**_request_body(body_schema(
    ChatRequest, {**GENERATION_FIELDS, **CHAT_FIELDS})), "responses": _SSE}
# /infill: a /completion body whose prompt is a string, plus the code around the hole
INFILL_FIELDS: dict[str, Schema] = {
    "prompt": {"type": "string", "description": "text after the prefix (default empty)"},
    "input_prefix": {"anyOf": [{"type": "string"}, _MIXED],
                     "description": "code before the hole: a string or strings and token ids"},
    "input_suffix": {"anyOf": [{"type": "string"}, _MIXED],
                     "description": "code after the hole: a string or strings and token ids"},
    "input_extra": {"type": "array", "description": "other files, before the FIM part",
                    "items": {"type": "object", "required": ["text"],
                              "properties": {"text": {"type": "string"},
                                             "filename": {"type": "string"}}}},
}
INFILL: Schema = {**_request_body(body_schema(
    InfillRequest, {**GENERATION_FIELDS, **COMPLETION_FIELDS, **INFILL_FIELDS},
    ("input_prefix", "input_suffix"))), "responses": _SSE}
# /rerank and its aliases read no body here: radixserve loads no rank head (always 501)
RERANK: Schema = {"description": "llama-server's reranking; a 501 here: radixserve loads no "
                  "classification head (the cls / cls.output tensors of a reranker GGUF)"}
# /apply-template checks a chat request's types but renders only: of the generation fields it
# reads those that shape the prompt; the others (their ranges, the unimplemented ones) are not
# looked at
_TEMPLATE_READS = ("grammar", "json_schema", "response_format", "tools", "tool_choice",
                   "parallel_tool_calls", "reasoning_format")
_IGNORED: Schema = {"description": "not used by this route (only its type is checked)"}
APPLY_TEMPLATE: Schema = _request_body(body_schema(ChatRequest, {
    **{k: _IGNORED for k in GENERATION_FIELDS if k not in _TEMPLATE_READS},
    **{k: GENERATION_FIELDS[k] for k in _TEMPLATE_READS},
    **CHAT_FIELDS,
}))
TOKENIZE: Schema = _request_body(body_schema(TokenizeRequest, TOKENIZE_FIELDS))
DETOKENIZE: Schema = _request_body(body_schema(DetokenizeRequest, DETOKENIZE_FIELDS))
EMBEDDING: Schema = _request_body(body_schema(EmbeddingRequest, EMBEDDING_FIELDS))

SLOTS: Schema = {"parameters": [{
    "name": "fail_on_no_slot", "in": "query", "required": False,
    "schema": {"type": "string"},
    "description": "any value but '', '0' or 'false': 503 when no slot is idle",
}]}

SLOT_ACTION: Schema = {
    "parameters": [{"name": "action", "in": "query", "required": True,
                    "schema": {"enum": ["save", "restore", "erase"]}}],
    **_request_body({
        "type": "object",
        "properties": {"filename": {"type": "string", "minLength": 1, "maxLength": 255,
                                    "description": "a file in --slot-save-path (save, "
                                                   "restore; erase reads no body)"}},
    }, required=False),
}
# the path's slot id: read as a string by the route (400 "Invalid slot ID" when not an integer,
# as llama-server), documented as what it must be
SLOT_ID = Path(json_schema_extra={"type": "integer", "minimum": 0})

# ---- Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens: anthropic.py) ----
_CACHE_CONTROL: Schema = {
    "type": "object", "required": ["type"],
    "description": "a cache breakpoint: the prompt up to this block is pinned for the ttl",
    "properties": {"type": {"enum": ["ephemeral"]}, "ttl": {"enum": ["5m", "1h"]}},
}
_A_TEXT: Schema = {
    "type": "object", "required": ["type", "text"],
    "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"},
                   "cache_control": _CACHE_CONTROL},
}
_A_BLOCKS: Schema = {"type": "array", "items": {"anyOf": [
    _A_TEXT,
    {"type": "object", "required": ["type", "id", "name", "input"],
     "description": "assistant messages only",
     "properties": {"type": {"enum": ["tool_use"]}, "id": {"type": "string", "minLength": 1},
                    "name": {"type": "string", "minLength": 1}, "input": _OBJECT,
                    "cache_control": _CACHE_CONTROL}},
    {"type": "object", "required": ["type", "tool_use_id"],
     "description": "user messages only; answers a tool_use of the message before",
     "properties": {"type": {"enum": ["tool_result"]}, "tool_use_id": {"type": "string"},
                    "content": {"anyOf": [{"type": "string"},
                                          {"type": "array", "items": _A_TEXT}]},
                    "is_error": {"type": "boolean"}, "cache_control": _CACHE_CONTROL}},
    {"type": "object", "required": ["type", "thinking"],
     "description": "assistant messages only",
     "properties": {"type": {"enum": ["thinking"]}, "thinking": {"type": "string"},
                    "signature": {"type": "string"}}},
]}}
_A_TOOL: Schema = {
    "type": "object", "required": ["name", "input_schema"],
    "properties": {"name": {"type": "string", "minLength": 1},
                   "description": {"type": "string"}, "input_schema": _OBJECT,
                   "cache_control": _CACHE_CONTROL},
}
_A_PROMPT: dict[str, Schema] = {
    "model": {"type": "string", "description": "echoed in the answer (one model per server)"},
    "messages": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["role", "content"],
        "properties": {"role": {"enum": ["user", "assistant"]},
                       "content": {"anyOf": [{"type": "string"}, _A_BLOCKS]}}}},
    "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": _A_TEXT}]},
    "tools": {"type": "array", "items": _A_TOOL},
    "tool_choice": {
        "type": "object", "required": ["type"],
        "description": "auto, any (a call is required), tool (that one: name), none",
        "properties": {"type": {"enum": ["auto", "any", "tool", "none"]},
                       "name": {"type": "string"},
                       "disable_parallel_tool_use": {"type": "boolean"}}},
    "thinking": {
        "type": "object", "required": ["type"],
        "description": "the template's enable_thinking; budget_tokens is not enforced",
        "properties": {"type": {"enum": ["enabled", "disabled"]},
                       "budget_tokens": _int(1)}},
    "chat_template_kwargs": _OBJECT,
}
_A_MESSAGES: Schema = {
    "type": "object", "required": ["max_tokens", "messages"],
    "properties": {
        **_A_PROMPT,
        "max_tokens": _int(1, doc="tokens to generate at most (the server's --n-predict "
                                  "caps it)"),
        "stop_sequences": _STRINGS,
        "stream": {"type": "boolean"},
        "temperature": {"type": "number", "minimum": 0},
        "top_p": _num(0.0, 1.0),
        "top_k": _int(0),
        "metadata": {"type": "object", "description": "accepted, not used"},
    },
}
MESSAGES: Schema = {**_request_body(_A_MESSAGES), "responses": {"200": {
    "description": "A message, or with `stream: true` Anthropic's named server-sent events",
    "content": {"application/json": {"schema": _OBJECT},
                "text/event-stream": {"schema": {"type": "string"}}}}}}
COUNT_TOKENS: Schema = {
    **_request_body({"type": "object", "required": ["messages"], "properties": _A_PROMPT}),
    "responses": {"200": {"description": "The prompt's tokens", "content": {
        "application/json": {"schema": {"type": "object", "required": ["input_tokens"],
                                        "properties": {"input_tokens": {"type": "integer"}}}}}}},
}
ANTHROPIC_ERROR: Schema = {
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"enum": ["error"]}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
}
ANTHROPIC_ERROR_RESPONSES: dict[int | str, Any] = {
    "default": {"description": "An error, in Anthropic's shape (errors.py AnthropicRoute)",
                "content": {"application/json": {"schema": ANTHROPIC_ERROR}}},
}

# /v1/responses: OpenAI's Responses body (oai_responses.py), plus the generation fields of a
# chat request, passed through as llama-server passes them
_RESP_TEXT_PART: Schema = {"type": "object", "required": ["type", "text"],
                           "properties": {"type": {"enum": ["input_text"]},
                                          "text": {"type": "string"}}}
_RESP_OUT_PART: Schema = {"type": "object", "required": ["type", "text"],
                          "properties": {"type": {"enum": ["output_text", "input_text"]},
                                         "text": {"type": "string"}}}
_RESP_ITEM: Schema = {"anyOf": [
    {"type": "object", "required": ["role", "content"], "description": "a message",
     "properties": {"type": {"enum": ["message"]},
                    "role": {"enum": ["user", "system", "developer"]},
                    "content": {"anyOf": [{"type": "string"},
                                          {"type": "array", "items": _RESP_TEXT_PART}]}}},
    {"type": "object", "required": ["role", "content"], "description": "an earlier reply",
     "properties": {"type": {"enum": ["message"]}, "role": {"enum": ["assistant"]},
                    "content": {"anyOf": [{"type": "string"},
                                          {"type": "array", "items": _RESP_OUT_PART}]}}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"],
     "description": "a function call of an earlier reply",
     "properties": {"type": {"enum": ["function_call"]},
                    "call_id": {"type": "string", "minLength": 1},
                    "name": {"type": "string", "minLength": 1},
                    "arguments": {"type": "string"}}},
    {"type": "object", "required": ["type", "call_id", "output"],
     "description": "a call's result: its call_id names a function_call before it",
     "properties": {"type": {"enum": ["function_call_output"]}, "call_id": {"type": "string"},
                    "output": {"anyOf": [{"type": "string"},
                                         {"type": "array", "items": _RESP_TEXT_PART}]}}},
    {"type": "object", "required": ["type", "summary"], "description": "an earlier reasoning",
     "properties": {"type": {"enum": ["reasoning"]}, "summary": {"type": "array"},
                    "content": {"type": "array", "items": {
                        "type": "object", "required": ["type", "text"],
                        "properties": {"type": {"enum": ["reasoning_text"]},
                                       "text": {"type": "string"}}}}}},
]}
_RESP_TOOL: Schema = {
    "type": "object", "required": ["type", "name"],
    "properties": {"type": {"enum": ["function"]}, "name": {"type": "string", "minLength": 1},
                   "description": {"type": "string"}, "parameters": _OBJECT,
                   "strict": {"type": "boolean"}},
}
RESPONSES_FIELDS: dict[str, Schema] = {
    "input": {"description": "a user message's text, or the conversation's items",
              "anyOf": [{"type": "string"}, {"type": "array", "items": _RESP_ITEM}]},
    "instructions": {"type": "string", "description": "a system message before the input "
                     "(not carried over by previous_response_id)"},
    "tools": {"type": "array", "items": _RESP_TOOL},
    "tool_choice": {"anyOf": [
        {"enum": list(TOOL_CHOICES)},
        {"type": "object", "required": ["type", "name"],
         "properties": {"type": {"enum": ["function"]}, "name": {"type": "string"}}}]},
    "max_output_tokens": _int(-1, doc="tokens to generate (the server's --n-predict caps it)"),
    "text": {"type": "object", "properties": {"format": {"anyOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text"]}}},
        {"type": "object", "required": ["type"],
         "properties": {"type": {"enum": ["json_object"]}}},
        {"type": "object", "required": ["type", "schema"],
         "properties": {"type": {"enum": ["json_schema"]}, "name": {"type": "string"},
                        "schema": _OBJECT, "strict": {"type": "boolean"}}}]}}},
    "reasoning": {"type": "object", "properties": {
        "effort": {"type": "string", "description": "the template's reasoning_effort; none: "
                   "thinking off"},
        "summary": {"type": "string"}}},
    "previous_response_id": {"type": "string", "description": "a stored response (in this "
                             "request's cache_salt namespace) whose conversation this one "
                             "continues"},
    "store": {"type": "boolean", "description": "keep the response (default true): in memory, "
              "bounded, least recently used first out"},
    "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
    "include": {"type": "array", "items": {"type": "string", "not": {
        "enum": ["message.output_text.logprobs"]}}},
    "truncation": {"enum": ["disabled"]},
    "background": {"enum": [False], "description": "not supported: only false"},
    "top_logprobs": {"enum": [0], "description": "logprobs are not supported here"},
    "conversation": {"type": "null", "description": "not supported"},
    "prompt": {"type": "null", "description": "not supported"},
    "messages": {"type": "null", "description": "chat's field: use input"},
}
_RESP_BODY = body_schema(ResponsesRequest, {**GENERATION_FIELDS, **RESPONSES_FIELDS}, ("input",))
RESPONSES: Schema = {**_request_body(_RESP_BODY), "responses": _SSE}
RESPONSES_INPUT_TOKENS: Schema = _request_body(_RESP_BODY)
