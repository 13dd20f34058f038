"""OpenAI's Responses API (`POST /v1/responses`) over the chat-completions machinery.

A Responses body becomes a chat-completions body, as llama-server's
`server_chat_convert_responses_to_chatcmpl` makes it (`instructions` a system message first,
input items messages, flat function tools the chat form, `max_output_tokens` the limit,
`text.format` the response format, `reasoning.effort` the template's `reasoning_effort`;
other fields pass through, so llama-server's sampling fields work here too), and
`parse_chat` turns it into the task, its grammar and its reply parser. Its answer is a
Response object, or streamed as the Responses events (`event: <type>` + `data:`), built from
the chat stream's deltas (`ResponsesStream` is a `ChatStream` that frames them its own way).

Beyond llama-server (which refuses `previous_response_id` and keeps nothing): a response is
stored unless `store` is false (response_store.py), and `previous_response_id` continues its
conversation: the stored items, then the request's. Stricter than llama-server: input items of
an unknown type, a `function_call_output` answering no earlier call, a role other than
user/system/developer/assistant and tools other than functions are 400s naming the field
(llama-server skips non-function tools with a warning).
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from radixserve.engine.task import FinalResult
from radixserve.errors import TaskError, bad_field, invalid_request
from radixserve.http.parse import ParseContext, ParsedRequest, chat_tokens, parse_chat
from radixserve.http.response_store import ResponseStore, items_chars
from radixserve.http.responses import ResponseContext, ended_by_itself, parse_reply, random_id
from radixserve.http.schemas import (
    Bool,
    ChatRequest,
    GenerationRequest,
    Int,
    Str,
    range_error,
    validate_body,
)
from radixserve.http.sse import ChatStream, sse_named
from radixserve.text.chat_parse import ParsedMessage, ToolCall

log = logging.getLogger(__name__)

PREFIX = "resp_"  # response ids: resp_ + 32 alphanumerics
INPUT_PARTS = ("input_text",)  # text parts of a user/system/developer message
OUTPUT_PARTS = ("output_text", "input_text", "refusal")  # of an assistant message
MEDIA_PARTS = ("input_image", "input_file", "input_audio")
INPUT_ROLES = ("user", "system", "developer")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
# Responses-only fields: not passed to the chat parser (everything else is, as llama-server)
RESPONSES_ONLY = frozenset((
    "input", "instructions", "tools", "tool_choice", "max_output_tokens", "text", "reasoning",
    "previous_response_id", "store", "metadata", "user", "include", "truncation", "background",
    "top_logprobs", "max_tool_calls", "conversation", "prompt", "service_tier",
    "safety_identifier", "stream_options", "messages", "logprobs", "add_generation_prompt",
    "response_format",
))
N_PREDICT_ALIASES = ("n_predict", "max_tokens", "max_completion_tokens")
TRUNCATIONS = ("disabled",)  # "auto" (drop the conversation's start to fit) is not done here
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesRequest(GenerationRequest):
    """A /v1/responses body: OpenAI's fields (types checked here, shapes in `parse_responses`)
    plus every generation field of a chat request, passed through."""

    input: Any = None
    instructions: Str | None = None
    max_output_tokens: Int | None = None
    text: Any = None
    reasoning: Any = None
    previous_response_id: Str | None = None
    store: Bool | None = None
    metadata: Any = None
    user: Str | None = None
    include: Any = None
    truncation: Str | None = None
    background: Bool | None = None
    top_logprobs: Int | None = None
    max_tool_calls: Int | None = None
    service_tier: Str | None = None
    safety_identifier: Str | None = None
    conversation: Any = None
    prompt: Any = None
    messages: Any = None
    chat_template_kwargs: dict[str, Any] | None = None


@dataclass(slots=True)
class Origin:
    """What a Responses request keeps for its answer (`ParsedRequest.origin`)."""

    salt: str  # its cache_salt namespace ("" for none): the store's namespace too
    items: list[dict[str, Any]]  # the conversation's input items: the chain's, then its own
    echo: dict[str, Any]  # the request's fields a Response object repeats
    store: ResponseStore | None = None  # where to keep the answer (None: `store` false)
    n_prior: int = 0  # `items` from the previous response's stored conversation
    prior_chars: int = 0  # that conversation's size (response_store.items_chars)
    msg_id: str = field(default_factory=lambda: random_id("msg_"))
    rs_id: str = field(default_factory=lambda: random_id("rs_"))


def not_found(rid: str) -> TaskError:
    """OpenAI's answer to an unknown response id (GET, DELETE)."""
    return TaskError(404, "invalid_request_error", f"Response with id '{rid}' not found.",
                     param="response_id")


def previous_not_found(rid: str) -> TaskError:
    """OpenAI's answer to an unknown `previous_response_id`: a 400 (its `code` is
    previous_response_not_found there; here, as every error of this server, the status)."""
    return TaskError(400, "invalid_request_error", f"Previous response with id '{rid}' not "
                     "found.", param="previous_response_id")


# ------------------------------------------------------------------ request -> chat request


def _parts_text(content: Any, allowed: tuple[str, ...], where: str) -> str:
    """A message's content (a string or a list of text parts) as one string; parts joined by
    newlines, as chat content parts are (flatten_content)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_field(f"{where}.content", "must be a string or an array of content parts")
    texts = []
    for j, part in enumerate(content):
        here = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise bad_field(here, f"'{kind}' is not supported by this server (text only)")
        if kind not in allowed:
            raise bad_field(here, f"type must be one of {', '.join(allowed)}, got {kind!r}")
        key = "refusal" if kind == "refusal" else "text"
        if not isinstance(part.get(key), str):
            raise bad_field(here, f"'{kind}' needs a string '{key}'")
        texts.append(part[key])
    return "\n".join(texts)


def _output_text(output: Any, where: str) -> str:
    """A function_call_output's `output`: a string or input_text parts."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _parts_text(output, INPUT_PARTS, where)
    raise bad_field(f"{where}.output", "must be a string or an array of input_text parts")


def _assistant(msgs: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message the next output item belongs to: the last message when it is the
    assistant's (a reply's reasoning, text and calls are one message), else a new one."""
    if msgs and msgs[-1]["role"] == "assistant":
        return msgs[-1]
    msgs.append({"role": "assistant", "content": None})
    return msgs[-1]


def to_messages(items: list[dict[str, Any]], instructions: str | None,
                n_prior: int = 0) -> list[dict[str, Any]]:
    """Chat messages of a conversation's items (the first `n_prior` from stored responses,
    already checked), after `instructions` as a system message. 400 naming the item for
    anything that is not a message, function call, its output or reasoning."""
    msgs: list[dict[str, Any]] = []
    if instructions is not None:
        msgs.append({"role": "system", "content": instructions})
    calls: set[str] = set()
    for i, item in enumerate(items):
        where = f"input[{i - n_prior}]" if i >= n_prior else f"(stored) input[{i}]"
        if not isinstance(item, dict):
            raise bad_field(where, "must be an input item object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role in INPUT_ROLES:
                msgs.append({"role": role,
                             "content": _parts_text(item.get("content"), INPUT_PARTS, where)})
            elif role == "assistant":
                text = _parts_text(item.get("content"), OUTPUT_PARTS, where)
                m = _assistant(msgs)
                m["content"] = text if not m["content"] else m["content"] + "\n" + text
            else:
                raise bad_field(f"{where}.role", "must be one of user, system, developer or "
                                f"assistant, got {role!r}")
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
                    raise bad_field(f"{where}.{key}", "a function_call needs a string "
                                    f"'{key}'" + ("" if key == "arguments" else " (not empty)"))
            m = _assistant(msgs)
            m.setdefault("tool_calls", []).append({
                "id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}})
            calls.add(item["call_id"])
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise bad_field(f"{where}.call_id",
                                "a function_call_output needs a string 'call_id'")
            if call_id not in calls:
                raise bad_field(f"{where}.call_id", "No tool call found for function call output "
                                f"with call_id {call_id}.")
            msgs.append({"role": "tool", "tool_call_id": call_id,
                         "content": _output_text(item.get("output"), where)})
        elif kind == "reasoning":
            content = item.get("content")
            if content is None:  # only a summary or encrypted content: nothing to render
                continue
            if not isinstance(content, list) or not all(
                    isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
                raise bad_field(f"{where}.content", "must be an array of reasoning_text parts")
            text = "".join(p["text"] for p in content)
            if text:
                m = _assistant(msgs)
                m["reasoning_content"] = m.get("reasoning_content", "") + text
        elif kind == "item_reference":
            raise bad_field(f"{where}.type", "item references are not supported by this server: "
                            "send the item, or continue with previous_response_id")
        else:
            raise bad_field(f"{where}.type", f"unknown or unsupported input item type {kind!r} "
                            f"(this server takes {', '.join(ITEM_TYPES)})")
    for m in msgs:  # an assistant turn of calls only: no text, as a chat reply gives it
        if m["role"] == "assistant" and m["content"] is None and not m.get("tool_calls"):
            m["content"] = ""
    return msgs


def input_items(value: Any) -> list[dict[str, Any]]:
    """`input` as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": value}]}]
    if value is None:
        raise invalid_request("Field 'input' is required")
    if not isinstance(value, list):
        raise bad_field("input", "must be a string or an array of input items")
    return value


def chat_tools(tools: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the chat form of Responses function tools, the tools as a Response echoes them)."""
    if tools is None:
        return [], []
    if not isinstance(tools, list):
        raise bad_field("tools", "must be an array of tools")
    chat, echo = [], []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise bad_field(f"tools[{i}].type", f"{kind!r} tools are not supported by this server "
                            "(only 'function' tools)")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad_field(f"tools[{i}].name", "must be a non-empty string")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        chat.append({"type": "function", "function": fn})
        echo.append({"type": "function", "name": t.get("name"),
                     "description": t.get("description"), "parameters": t.get("parameters"),
                     "strict": t.get("strict")})
    return chat, echo


def chat_tool_choice(value: Any) -> Any:
    """The chat form of a Responses `tool_choice`: a mode string, or a function by name."""
    if value is None or isinstance(value, str):
        return value
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "function":
        if not isinstance(value.get("name"), str):
            raise bad_field("tool_choice.name", "must be a string")
        return {"type": "function", "function": {"name": value["name"]}}
    raise bad_field("tool_choice", 'must be "none", "auto", "required" or {"type": "function", '
                    f'"name": ...}}, got type {kind!r} (not supported by this server)')


def text_format(text: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(the chat `response_format` of `text.format`, the `text` a Response echoes)."""
    if text is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise bad_field("text", "must be an object")
    fmt = text.get("format")
    echo = {**text, "format": fmt or {"type": "text"}}
    if fmt is None:
        return None, echo
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None, echo
    if kind == "json_object":
        return {"type": "json_object"}, echo
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise bad_field("text.format.schema", "must be a JSON schema object")
        wrapper = {"name": fmt.get("name", "response"), "schema": schema}
        if fmt.get("strict") is not None:
            wrapper["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": wrapper}, {
            **echo, "format": {**fmt, "name": wrapper["name"]}}
    raise bad_field("text.format.type", 'must be one of "text", "json_object" or "json_schema", '
                    f"got {kind!r}")


def _reasoning(value: Any, kwargs: dict[str, Any] | None) -> tuple[dict[str, Any] | None,
                                                                   dict[str, Any]]:
    """(the chat template kwargs with `reasoning.effort`, the `reasoning` echoed). As
    llama-server: an effort goes to the template as `reasoning_effort`; "none" turns
    thinking off (`enable_thinking` false). The request's own kwargs win."""
    if value is None:
        return kwargs, {"effort": None, "summary": None}
    if not isinstance(value, dict):
        raise bad_field("reasoning", "must be an object")
    effort = value.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise bad_field("reasoning.effort", "must be a string")
    echo = {"effort": effort, "summary": value.get("summary")}
    if not effort:
        return kwargs, echo
    extra = {"enable_thinking": False} if effort == "none" else {"reasoning_effort": effort}
    return {**extra, **(kwargs or {})}, echo


def _refuse_unsupported(req: ResponsesRequest) -> None:
    """400 for what this server does not do, rather than an answer that ignores it."""
    if req.messages is not None:
        raise bad_field("messages", "the Responses API takes 'input' (see /v1/chat/completions)")
    if req.background:
        raise bad_field("background", "background responses are not supported by this server")
    if req.conversation is not None:
        raise bad_field("conversation", "conversations are not supported by this server: continue "
                        "with previous_response_id")
    if req.prompt is not None:
        raise bad_field("prompt", "prompt templates are not supported by this server")
    if req.truncation is not None and req.truncation not in TRUNCATIONS:
        raise bad_field("truncation", f"only 'disabled' is supported, got {req.truncation!r}")
    if req.top_logprobs:
        raise bad_field("top_logprobs", "logprobs are not supported on /v1/responses")
    if req.include is not None:
        if not isinstance(req.include, list) or not all(isinstance(v, str)
                                                        for v in req.include):
            raise bad_field("include", "must be an array of strings")
        if LOGPROBS_INCLUDE in req.include:
            raise bad_field("include", "logprobs are not supported on /v1/responses")
    if req.metadata is not None and not (isinstance(req.metadata, dict) and all(
            isinstance(v, str) for v in req.metadata.values())):
        raise bad_field("metadata", "must be an object of string values")
    if req.max_output_tokens is not None and req.max_output_tokens < -1:
        raise range_error("max_output_tokens", req.max_output_tokens, -1)


def to_chat(body: Any, store: ResponseStore) -> tuple[dict[str, Any], Origin]:
    """A /v1/responses body -> its chat-completions body and the `Origin` its answer needs
    (the echo's sampling fields are the task's: `parse_responses` sets them). The previous
    response's conversation comes from `store`, in the request's salt namespace."""
    req = validate_body(ResponsesRequest, body)
    _refuse_unsupported(req)
    salt = req.cache_salt or ""
    prior: list[dict[str, Any]] = []
    prior_chars = 0
    if req.previous_response_id:  # "" is none, as llama-server reads it
        stored = store.get(salt, req.previous_response_id)
        if stored is None:
            raise previous_not_found(req.previous_response_id)
        prior, prior_chars = stored.conversation, stored.conversation_chars
    own = input_items(req.input)
    items = [*prior, *own]
    messages = to_messages(items, req.instructions, len(prior))
    if not messages:
        raise bad_field("input", "must not be empty")
    tools, tools_echo = chat_tools(req.tools)
    response_format, text_echo = text_format(req.text)
    kwargs, reasoning_echo = _reasoning(req.reasoning, req.chat_template_kwargs)

    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in RESPONSES_ONLY}
    chat["messages"] = messages
    if tools:
        chat["tools"] = tools
        if req.tool_choice is not None:
            chat["tool_choice"] = chat_tool_choice(req.tool_choice)
    elif req.tool_choice not in (None, "none", "auto"):
        raise bad_field("tool_choice", "names a tool, but 'tools' has none")
    if req.max_output_tokens is not None:  # wins over llama-server's names of the limit
        for name in N_PREDICT_ALIASES:
            chat.pop(name, None)
        chat["n_predict"] = req.max_output_tokens
    if response_format is not None:
        chat["response_format"] = response_format
    elif req.text is None and body.get("response_format") is not None:
        chat["response_format"] = body["response_format"]  # llama-server's field, passed on
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs
    store_it = req.store is not False
    return chat, Origin(salt, items, {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "parallel_tool_calls": bool(req.parallel_tool_calls),
        "previous_response_id": req.previous_response_id or None,
        "prompt_cache_key": req.prompt_cache_key,
        "prompt_cache_retention": req.prompt_cache_retention,
        "reasoning": reasoning_echo,
        "safety_identifier": req.safety_identifier,
        "service_tier": req.service_tier or "default",
        "store": store_it,
        "temperature": None,  # the task's (parse_responses)
        "text": text_echo,
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": tools_echo,
        "top_logprobs": 0,
        "top_p": None,
        "truncation": req.truncation or "disabled",
        "user": req.user,
        "metadata": req.metadata or {},
    }, store if store_it else None, len(prior), prior_chars)


def parse_responses(body: Any, ctx: ParseContext, store: ResponseStore) -> ParsedRequest:
    """A /v1/responses body -> the chat task(s), with the `Origin` its answer needs."""
    chat, origin = to_chat(body, store)
    parsed = parse_chat(chat, ctx)
    parsed.prefill = ""  # a response's output is what the model wrote, not the input's text
    if len(parsed.tasks) > 1:
        raise bad_field("n", "a response has one output: n must be 1")
    params = parsed.task.params
    origin.echo["temperature"], origin.echo["top_p"] = params.temperature, params.top_p
    parsed.origin = origin
    return parsed


def count_input_tokens(body: Any, ctx: ParseContext, store: ResponseStore) -> dict[str, Any]:
    """/v1/responses/input_tokens: the prompt's length in tokens, as `parse_responses` would
    tokenize it (llama-server's `{"object": "response.input_tokens", "input_tokens"}`), without
    the rest of the chat parse (grammars, limits) nor running anything."""
    chat, _ = to_chat(body, store)
    tokens = chat_tokens(validate_body(ChatRequest, chat), ctx)[1]
    return {"object": "response.input_tokens", "input_tokens": len(tokens)}


# ------------------------------------------------------------------ answers


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(mid: str, text: str, status: str) -> dict[str, Any]:
    return {"id": mid, "type": "message", "status": status, "role": "assistant",
            "content": [output_text_part(text)]}


def reasoning_item(rid: str, text: str, status: str) -> dict[str, Any]:
    return {"id": rid, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None,
            "status": status}


def call_ids(call: ToolCall) -> tuple[str, str]:
    """(item id, call_id) of a tool call: fc_<id> and call_<id>, as llama-server."""
    return "fc_" + call.id, call.id if call.id.startswith("call_") else "call_" + call.id


def call_item(call: ToolCall, status: str) -> dict[str, Any]:
    item_id, call_id = call_ids(call)
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id,
            "name": call.name, "arguments": call.arguments}


def output_items(msg: ParsedMessage, status: str, origin: Origin) -> list[tuple[str, dict]]:
    """(key, item) of a reply's output, in llama-server's order: reasoning, text, calls. A
    message item unless the reply is only calls or only reasoning (an empty reply is an empty
    message)."""
    out: list[tuple[str, dict[str, Any]]] = []
    if msg.reasoning_content:
        out.append(("reasoning", reasoning_item(origin.rs_id, msg.reasoning_content, status)))
    if msg.content or not (msg.tool_calls or msg.reasoning_content):
        out.append(("message", message_item(origin.msg_id, msg.content, status)))
    out += [(f"call:{i}", call_item(c, status)) for i, c in enumerate(msg.tool_calls)]
    return out


def usage_json(final: FinalResult, msg: ParsedMessage, req: ParsedRequest,
               ctx: ResponseContext) -> dict[str, Any]:
    """Token counts; `cached_tokens` is the prompt's prefix served from a cache
    (timings.cache_n), `cache_write_tokens` the prompt tokens computed and kept for the next
    prompts (timings.prompt_n; none with cache_prompt false), `reasoning_tokens` the
    reasoning text's length in tokens."""
    n_out = len(final.tokens)
    t = final.timings
    n_reasoning = len(ctx.tokenizer.encode(msg.reasoning_content, add_special=False,
                                           parse_special=False)) if msg.reasoning_content else 0
    return {
        "input_tokens": final.n_prompt_tokens,
        "input_tokens_details": {"cached_tokens": t.cache_n, "cache_write_tokens":
                                 t.prompt_n if req.task.cache_prompt else 0},
        "output_tokens": n_out,
        "output_tokens_details": {"reasoning_tokens": min(n_reasoning, n_out)},
        "total_tokens": final.n_prompt_tokens + n_out,
    }


def response_json(req: ParsedRequest, ctx: ResponseContext, status: str,
                  output: list[dict[str, Any]], final: FinalResult | None = None,
                  msg: ParsedMessage | None = None,
                  error: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Response object: OpenAI's fields in its order, then (for a finished one) this
    server's `timings` and `reuse` beside them, as its chat completions carry them."""
    e = req.origin.echo
    out: dict[str, Any] = {
        "id": ctx.id,
        "object": "response",
        "created_at": ctx.created,
        "status": status,
        "background": False,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "instructions": e["instructions"],
        "max_output_tokens": e["max_output_tokens"],
        "max_tool_calls": e["max_tool_calls"],
        "model": ctx.model,
        "output": output,
        **{k: e[k] for k in ("parallel_tool_calls", "previous_response_id", "prompt_cache_key",
                             "prompt_cache_retention", "reasoning", "safety_identifier",
                             "service_tier", "store", "temperature", "text", "tool_choice",
                             "tools", "top_logprobs", "top_p", "truncation")},
        "usage": None if final is None or msg is None else usage_json(final, msg, req, ctx),
        "user": e["user"],
        "metadata": e["metadata"],
    }
    if final is not None:
        out |= final.timings.fields()
    return out


def keep(req: ParsedRequest, ctx: ResponseContext, response: dict[str, Any]) -> None:
    """Store a finished response and its conversation, unless its request said `store`
    false. The conversation's size is the previous one's plus the new items' (this request's
    input and output): the chain is not serialized again."""
    o: Origin = req.origin
    if o.store is not None:
        new = [*o.items[o.n_prior :], *response["output"]]
        o.store.put(o.salt, ctx.id, response, [*o.items, *response["output"]],
                    o.prior_chars + items_chars(new))


def response_body(final: FinalResult, req: ParsedRequest, ctx: ResponseContext
                  ) -> dict[str, Any]:
    """The non-streamed answer (`ApiShape.build`); stored unless `store` is false."""
    msg = parse_reply(final, req)
    status = "completed" if ended_by_itself(final) else "incomplete"
    output = [item for _, item in output_items(msg, status, req.origin)]
    out = response_json(req, ctx, status, output, final, msg)
    keep(req, ctx, out)
    return out


# ------------------------------------------------------------------ streaming


class ResponsesStream(ChatStream):
    """The Responses events of one reply. The chat stream's logic makes the deltas (text,
    reasoning and tool calls parsed as they come, held back while undecided); `frame` turns
    each chat chunk into Responses events: response.created and .in_progress first, an output
    item added when its first delta comes (with its content part for text), its deltas,
    its done events (reasoning when anything follows it, a call when the next call starts,
    the rest at the end), then response.completed (or .incomplete at a limit) with the whole
    Response, which is stored. Every event carries its `sequence_number`; no [DONE]."""

    done = None

    def __init__(self, req: ParsedRequest, ctx: ResponseContext) -> None:
        super().__init__(req, ctx)
        self.origin: Origin = req.origin
        self.seq = 0
        self.keys: list[str] = []  # output items announced, by output_index
        self.items: dict[str, dict[str, Any]] = {}  # key -> the item as streamed so far
        self.closed: set[str] = set()

    # the chat stream's chunks, reduced to what `frame` reads
    def _plain(self) -> bool:
        return False

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"choices": choices}

    def start(self) -> list[dict[str, Any]]:
        return [{"_start": True}]

    def progress(self, pr: Any) -> dict[str, Any]:
        return {"_progress": pr.to_json()}

    def _close(self, f: FinalResult) -> list[dict[str, Any]]:
        return [{"_final": f}]

    # framing
    def frame(self, chunk: dict[str, Any]) -> bytes:
        if "_start" in chunk:
            snapshot = response_json(self.req, self.ctx, "in_progress", [])
            events = [{"type": "response.created", "response": snapshot},
                      {"type": "response.in_progress", "response": snapshot}]
        elif "_progress" in chunk:
            events = [{"type": "response.in_progress", "prompt_progress": chunk["_progress"],
                       "response": response_json(self.req, self.ctx, "in_progress", [])}]
        elif "_final" in chunk:
            events = self._finish(chunk["_final"])
        else:
            events = []
            for choice in chunk.get("choices", ()):
                events += self._delta_events(choice.get("delta") or {})
            if events and "timings" in chunk:  # timings_per_token: on the last event, as
                events[-1]["timings"] = chunk["timings"]  # llama-server
        return b"".join(self._sse(e) for e in events)

    def _sse(self, event: dict[str, Any]) -> bytes:
        event["sequence_number"] = self.seq
        self.seq += 1
        return sse_named(event["type"], event)  # the Responses framing (llama-server's)

    def error(self, err: TaskError) -> bytes:
        """OpenAI's `error` event, then response.failed (nothing is stored)."""
        failed = response_json(self.req, self.ctx, "failed", [self.items[k] for k in self.keys],
                               error={"code": err.type, "message": err.message})
        return self._sse({"type": "error", "code": err.type, "message": err.message,
                          "param": None}) + \
            self._sse({"type": "response.failed", "response": failed})

    # items
    def _index(self, key: str) -> int:
        return self.keys.index(key)

    def _open(self, key: str, item: dict[str, Any]) -> list[dict[str, Any]]:
        """Announce an output item; the reasoning before it and an earlier call are done."""
        events: list[dict[str, Any]] = []
        for k in self.keys:
            if k not in self.closed and (k == "reasoning" or k.startswith("call:")):
                events += self._done(k, self.items[k])
        self.keys.append(key)
        self.items[key] = item
        # as it is now (the item grows later; events are framed when the chunk is done)
        added = {**item, "content": []} if item["type"] == "message" else copy.deepcopy(item)
        events.append({"type": "response.output_item.added", "output_index": len(self.keys) - 1,
                       "item": added})
        if item["type"] == "message":
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": len(self.keys) - 1, "content_index": 0,
                           "part": output_text_part("")})
        return events

    def _done(self, key: str, item: dict[str, Any]) -> list[dict[str, Any]]:
        """An item's done events, with its final text (`item`)."""
        self.closed.add(key)
        idx, iid = self._index(key), item["id"]
        events: list[dict[str, Any]] = []
        if item["type"] == "message":
            part = copy.deepcopy(item["content"][0])
            events += [{"type": "response.output_text.done", "item_id": iid, "output_index": idx,
                        "content_index": 0, "text": part["text"], "logprobs": []},
                       {"type": "response.content_part.done", "item_id": iid,
                        "output_index": idx, "content_index": 0, "part": part}]
        elif item["type"] == "reasoning":
            events.append({"type": "response.reasoning_text.done", "item_id": iid,
                           "output_index": idx, "content_index": 0,
                           "text": item["content"][0]["text"]})
        elif item["type"] == "function_call":
            events.append({"type": "response.function_call_arguments.done", "item_id": iid,
                           "output_index": idx, "name": item["name"],
                           "arguments": item["arguments"]})
        done = {**copy.deepcopy(item), "status": "completed" if item["status"] == "in_progress"
                else item["status"]}
        self.items[key] = done
        return events + [{"type": "response.output_item.done", "output_index": idx,
                          "item": done}]

    def _done_all(self, final: dict[str, dict[str, Any]], status: str
                  ) -> list[dict[str, Any]]:
        """The done events of every open item, with its final form (`final`, by key)."""
        events: list[dict[str, Any]] = []
        for key in self.keys:
            if key not in self.closed:
                events += self._done(key, {**final.get(key, self.items[key]), "status": status})
        return events

    def _announce(self, key: str, item: dict[str, Any]) -> list[dict[str, Any]]:
        """An item of the final parse that no delta announced, as the stream adds one: empty,
        then its text or arguments (`item`'s) as one delta."""
        if item["type"] == "function_call":
            events = self._open(key, {**item, "status": "in_progress", "arguments": ""})
            if item["arguments"]:
                self.items[key]["arguments"] = item["arguments"]
                events.append({"type": "response.function_call_arguments.delta",
                               "item_id": item["id"], "output_index": self._index(key),
                               "delta": item["arguments"]})
            return events
        empty = [output_text_part("")] if item["type"] == "message" else []
        events = self._open(key, {**item, "status": "in_progress", "content": empty})
        text = item["content"][0]["text"]
        return events + (self._text(key, text) if text else [])

    def _delta_events(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat delta (reasoning, content or a tool call's piece)."""
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for tc in delta.get("tool_calls") or ():
            key, fn = f"call:{tc['index']}", tc.get("function") or {}
            if key not in self.items:
                call = ToolCall(fn.get("name", ""), "", tc.get("id", ""))
                events += self._open(key, call_item(call, "in_progress"))
            args = fn.get("arguments") or ""
            if args and key not in self.closed:
                item = self.items[key]
                item["arguments"] += args
                events.append({"type": "response.function_call_arguments.delta",
                               "item_id": item["id"], "output_index": self._index(key),
                               "delta": args})
        return events

    def _text(self, key: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if key not in self.items:
            o = self.origin
            events += self._open(key, message_item(o.msg_id, "", "in_progress") if key ==
                                 "message" else {**reasoning_item(o.rs_id, "", "in_progress"),
                                                 "content": []})
        if key in self.closed:  # the parser added to a finished item: a parser bug
            log.warning("responses stream: more %s after its item was done", key)
            return events
        item, idx = self.items[key], self._index(key)
        if key == "message":
            item["content"][0]["text"] += text
            events.append({"type": "response.output_text.delta", "item_id": item["id"],
                           "output_index": idx, "content_index": 0, "delta": text,
                           "logprobs": []})
        else:
            if not item["content"]:
                item["content"] = [{"type": "reasoning_text", "text": ""}]
            item["content"][0]["text"] += text
            events.append({"type": "response.reasoning_text.delta", "item_id": item["id"],
                           "output_index": idx, "content_index": 0, "delta": text})
        return events

    def _finish(self, f: FinalResult) -> list[dict[str, Any]]:
        """The items no delta announced (an empty reply's message), in order: the items before
        each done, then it added, its whole text (arguments) as one delta; every item still
        open done with the final parse; then response.completed or .incomplete; the response
        stored."""
        msg = self.msg if self.msg is not None else ParsedMessage(f.content)
        status = "completed" if ended_by_itself(f) else "incomplete"
        final = dict(output_items(msg, status, self.origin))
        events: list[dict[str, Any]] = []
        for key, item in final.items():
            if key not in self.items:
                events += self._done_all(final, status) + self._announce(key, item)
        events += self._done_all(final, status)
        output = [self.items[k] for k in self.keys]
        response = response_json(self.req, self.ctx, status, output, f, msg)
        keep(self.req, self.ctx, response)
        return events + [{"type": f"response.{status}", "response": response,
                          **f.timings.fields()}]


def responses_shape(store: ResponseStore) -> Any:
    """The `ApiShape` of /v1/responses over `store`."""
    from radixserve.http.routes_completions import ApiShape  # routes import this module

    def parse(body: Any, ctx: ParseContext) -> ParsedRequest:
        return parse_responses(body, ctx, store)

    return ApiShape(parse, response_body, ResponsesStream, PREFIX)
