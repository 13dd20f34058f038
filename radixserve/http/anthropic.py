"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) over the chat
completions machinery, as llama-server serves it (tools/server/server-chat.cpp
`server_chat_convert_anthropic_to_oai`, server-task.cpp `to_json_anthropic*`).

A body is checked and translated into a chat-completions body (`to_chat`), which `parse_chat`
turns into tasks as any chat request; answers are shaped from the same results (`message_json`,
`MessageStream`). Beyond llama-server:

- the usage reports the cache tiers: `cache_read_input_tokens` are the prompt tokens a tier
  served (`timings.cache_n`), `cache_creation_input_tokens` those computed and kept for later
  requests (`timings.prompt_n` when the prompt is cached), `input_tokens` the rest (Anthropic:
  the three add up to the prompt);
- `cache_control` blocks are breakpoints: the prompt's prefix up to the last one is pinned in
  the radix host tier for its ttl (5m, 1h; --cache-pin-mib), and every one is a context
  checkpoint position for sliding-window models (a top-level `cache_control` is one at the
  last block). A breakpoint's position is where the rendered prompt changes when what follows
  its block changes (a marker after its text; the tools or tool calls after it dropped): the
  prompt tokens that the text before it tokenizes to, as the prompt has them. Where nothing
  can be pinned (no radix host tier, --cache-pin-mib 0) breakpoints are still accepted; the
  prefix is then kept by the LRU only;
- it is stricter where Anthropic is: `max_tokens` and a non-empty `messages` are required,
  roles are user or assistant, a tool_result answers a tool_use of the message before it
  (and comes before the user message's text),
  images (no model here has vision) and unknown block types are refused, all with Anthropic's
  error shape (errors.py `AnthropicRoute`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from radixserve.engine.task import CompletionTask, FinalResult, PartialResult, Timings
from radixserve.errors import TaskError, bad_field, invalid_request, show
from radixserve.http.errors import anthropic_error_json
from radixserve.http.parse import ParseContext, ParsedRequest, chat_tokens, parse_chat, render_chat
from radixserve.http.responses import ResponseContext, ended_by_itself, parse_reply
from radixserve.http.schemas import ChatRequest, validate_body
from radixserve.http.sse import ChatStream, sse_named
from radixserve.memory.tiers.prefix import common_prefix
from radixserve.text.chat_parse import ParsedMessage

log = logging.getLogger(__name__)

TTL_S = {"5m": 300.0, "1h": 3600.0}  # cache_control ttl -> seconds pinned
MAX_BREAKPOINTS = 4  # Anthropic's limit on cache_control blocks
MARK = "\ue000"  # put after a breakpoint's text to find where its block ends in the prompt
_DUMMY_TOOL = {"type": "function", "function": {
    "name": "radixserve_breakpoint", "description": MARK, "parameters": {"type": "object"}}}
_DUMMY_CALL = {"id": MARK, "type": "function",
               "function": {"name": "radixserve_breakpoint", "arguments": "{}"}}


@dataclass(slots=True)
class Breakpoint:
    """A `cache_control` block: where it is in the chat body and how long its prefix stays.
    `kind`: system (its text ends at `end`), text (part `part` of message `msg`), string
    (message `msg`'s string content), tool_result (the tool message `msg`), tool_use (call
    `part` of message `msg`), thinking (message `msg`'s reasoning), tool (tool `part`)."""

    kind: str
    ttl_s: float
    msg: int = -1
    part: int = -1
    end: int = 0


@dataclass(slots=True)
class Translated:
    chat: dict[str, Any]  # the chat-completions body
    model: str | None = None  # the request's model name (answers echo it)
    breakpoints: list[Breakpoint] = field(default_factory=list)


# ------------------------------------------------------------------ request -> chat body


def _ttl(block: dict[str, Any], where: str) -> float | None:
    """Seconds of a block's `cache_control` (None: it has none)."""
    cc = block.get("cache_control")
    if cc is None:
        return None
    where = f"{where}.cache_control" if where else "cache_control"
    if not isinstance(cc, dict) or cc.get("type") != "ephemeral":
        raise bad_field(where, 'must be {"type": "ephemeral"} with an optional "ttl" of "5m" or '
                        f'"1h", got {show(cc)}')
    ttl = cc.get("ttl", "5m")
    if not isinstance(ttl, str) or ttl not in TTL_S:  # a list or object is unhashable
        raise bad_field(f"{where}.ttl", f'must be "5m" or "1h", got {show(ttl)}')
    return TTL_S[ttl]


def _text(block: dict[str, Any], where: str, key: str = "text") -> str:
    text = block.get(key)
    if not isinstance(text, str):
        raise bad_field(f"{where}.{key}", f"must be a string, got {show(text)}")
    return text


def _block(block: Any, where: str) -> tuple[str, dict[str, Any]]:
    if not isinstance(block, dict):
        raise bad_field(where, f"must be a content block object, got {show(block)}")
    kind = block.get("type")
    if kind in ("image", "document"):
        raise bad_field(f"{where}.type", f"{kind} blocks are not supported: the model this server "
                        "runs reads text only")
    return kind if isinstance(kind, str) else "", block


def billing_header_normalized(text: str) -> str:
    """Claude Code's `x-anthropic-billing-header: ...; cch=xxxxx;` system line with its
    per-request stamp made constant, so it does not end the cached prefix (llama-server's
    normalize_anthropic_billing_header)."""
    head = "x-anthropic-billing-header:"
    if not text.startswith(head):
        return text
    i = text.find("cch=", len(head))
    if i < 0 or text[i + 9 : i + 10] != ";":
        return text
    return text[: i + 4] + "fffff" + text[i + 9 :]


def _system(value: Any, bps: list[Breakpoint]) -> str:
    if isinstance(value, str):
        return billing_header_normalized(value)
    if not isinstance(value, list):
        raise bad_field("system", f"must be a string or an array of text blocks, got {show(value)}")
    out = ""
    for j, b in enumerate(value):
        kind, b = _block(b, f"system[{j}]")
        if kind != "text":
            raise bad_field(f"system[{j}].type", f'must be "text", got {show(kind)}')
        out += billing_header_normalized(_text(b, f"system[{j}]"))
        ttl = _ttl(b, f"system[{j}]")
        if ttl is not None:
            bps.append(Breakpoint("system", ttl, msg=0, end=len(out)))
    return out


def _tool_result_text(value: Any, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_field(where, f"must be a string or an array of text blocks, got {show(value)}")
    parts = []
    for k, b in enumerate(value):
        kind, b = _block(b, f"{where}[{k}]")
        if kind != "text":
            raise bad_field(f"{where}[{k}].type", f'must be "text", got {show(kind)}')
        parts.append(_text(b, f"{where}[{k}]"))
    return "".join(parts)  # text only: one string (llama-server)


def _user(blocks: list[Any], where: str, allowed_ids: set[str], out: list[dict[str, Any]],
          bps: list[Breakpoint]) -> None:
    """A user turn's blocks, in order: each tool_result as a tool message, then the text as a
    user message. As Anthropic, tool_result blocks come first: one after text is a 400 (the
    text would come between the assistant's calls and their results)."""
    text: list[dict[str, Any]] | None = None
    for j, raw in enumerate(blocks):
        w = f"{where}[{j}]"
        kind, b = _block(raw, w)
        ttl = _ttl(b, w)
        if kind == "text":
            if text is None:
                text = []
                out.append({"role": "user", "content": text})
            text.append({"type": "text", "text": _text(b, w)})
            if ttl is not None:
                bps.append(Breakpoint("text", ttl, msg=len(out) - 1, part=len(text) - 1))
        elif kind == "tool_result":
            tid = b.get("tool_use_id")
            if not isinstance(tid, str) or tid not in allowed_ids:
                raise bad_field(f"{w}.tool_use_id", f"{show(tid)} answers no tool_use block of "
                                "the message before: each tool_result needs a tool_use with its id "
                                "in the previous (assistant) message")
            if text is not None:
                raise bad_field(f"{w}.type", "tool_result blocks must come first in a user "
                                "message's content, before any text: the text goes after all "
                                "the tool results")
            out.append({"role": "tool", "tool_call_id": tid,
                        "content": _tool_result_text(b.get("content"), f"{w}.content")})
            if ttl is not None:
                bps.append(Breakpoint("tool_result", ttl, msg=len(out) - 1))
        elif kind in ("tool_use", "thinking", "redacted_thinking"):
            raise bad_field(f"{w}.type", f"{kind} blocks belong in assistant messages")
        else:
            raise bad_field(f"{w}.type", f"unsupported content block type {show(kind)}")


def _assistant(blocks: list[Any], where: str, out: list[dict[str, Any]],
               bps: list[Breakpoint]) -> set[str]:
    """An assistant turn's blocks as one message (text parts, reasoning_content, tool_calls);
    the ids of its tool_use blocks."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning = ""
    mine: list[Breakpoint] = []
    for j, raw in enumerate(blocks):
        w = f"{where}[{j}]"
        kind, b = _block(raw, w)
        ttl = _ttl(b, w)
        if kind == "text":
            parts.append({"type": "text", "text": _text(b, w)})
            if ttl is not None:
                mine.append(Breakpoint("text", ttl, part=len(parts) - 1))
        elif kind == "thinking":
            thought = _text(b, w, "thinking")
            reasoning += thought
            if ttl is not None and thought:  # an empty one ends nowhere in the prompt
                mine.append(Breakpoint("thinking", ttl))
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic: nothing a local model can read
        elif kind == "tool_use":
            cid, name, args = b.get("id"), b.get("name"), b.get("input", {})
            if not isinstance(cid, str) or not cid:
                raise bad_field(f"{w}.id", f"must be a non-empty string, got {show(cid)}")
            if not isinstance(name, str) or not name:
                raise bad_field(f"{w}.name", f"must be a non-empty string, got {show(name)}")
            if not isinstance(args, dict):
                raise bad_field(f"{w}.input", f"must be an object, got {show(args)}")
            calls.append({"id": cid, "type": "function", "function": {
                "name": name,
                "arguments": json.dumps(args, ensure_ascii=False, separators=(",", ":"))}})
            if ttl is not None:
                mine.append(Breakpoint("tool_use", ttl, part=len(calls) - 1))
        elif kind == "tool_result":
            raise bad_field(f"{w}.type", "tool_result blocks belong in user messages")
        else:
            raise bad_field(f"{w}.type", f"unsupported content block type {show(kind)}")
    if not (parts or calls or reasoning):
        return set()  # nothing to show (llama-server drops it)
    msg: dict[str, Any] = {"role": "assistant", "content": parts or ""}
    if calls:
        msg["tool_calls"] = calls
    if reasoning:
        msg["reasoning_content"] = reasoning
    out.append(msg)
    for bp in mine:
        bp.msg = len(out) - 1
    bps += mine
    return {c["id"] for c in calls}


def _messages(value: Any, out: list[dict[str, Any]], bps: list[Breakpoint]) -> None:
    if value is None:
        raise invalid_request("Field 'messages' is required")
    if not isinstance(value, list):
        raise bad_field("messages", f"must be an array of messages, got {show(value)}")
    if not value:
        raise bad_field("messages", "must not be empty: at least one message is required")
    tool_ids: set[str] = set()
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_field(where, f"must be a message object, got {show(m)}")
        role = m.get("role")
        if role not in ("user", "assistant"):
            hint = " (system text goes in the top-level 'system' field)" if role == "system" \
                else " (tool results are tool_result blocks of a user message)" \
                if role == "tool" else ""
            raise bad_field(f"{where}.role", f'must be "user" or "assistant", got {show(role)}'
                            + hint)
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            tool_ids = set()
        elif isinstance(content, list):
            if role == "user":
                _user(content, f"{where}.content", tool_ids, out, bps)
                tool_ids = set()
            else:
                tool_ids = _assistant(content, f"{where}.content", out, bps)
        elif content is None:
            raise invalid_request(f"Field '{where}.content' is required")
        else:
            raise bad_field(f"{where}.content", "must be a string or an array of content blocks, "
                            f"got {show(content)}")


def _tools(value: Any, bps: list[Breakpoint]) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise bad_field("tools", f"must be an array of tools, got {show(value)}")
    out = []
    for i, t in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad_field(where, f"must be a tool object, got {show(t)}")
        if t.get("type") not in (None, "custom"):
            raise bad_field(f"{where}.type", f"{show(t.get('type'))}: Anthropic's server tools are "
                            "not available here (custom tools only: name, description, "
                            "input_schema)")
        name, desc = t.get("name"), t.get("description", "")
        schema = t.get("input_schema", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not name:
            raise bad_field(f"{where}.name", f"must be a non-empty string, got {show(name)}")
        if not isinstance(desc, str):
            raise bad_field(f"{where}.description", f"must be a string, got {show(desc)}")
        if not isinstance(schema, dict):
            raise bad_field(f"{where}.input_schema", f"must be a JSON schema object, got "
                            f"{show(schema)}")
        out.append({"type": "function",
                    "function": {"name": name, "description": desc, "parameters": schema}})
        ttl = _ttl(t, where)
        if ttl is not None:
            bps.append(Breakpoint("tool", ttl, part=i))
    return out


def _tool_choice(value: Any, chat: dict[str, Any]) -> None:
    """auto, any (-> required), tool (-> that function), none; disable_parallel_tool_use."""
    if not isinstance(value, dict):
        raise bad_field("tool_choice", f"must be an object with a type, got {show(value)}")
    kind = value.get("type")
    if kind in ("auto", "none"):
        chat["tool_choice"] = kind
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "tool":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise bad_field("tool_choice.name", f"must name a tool, got {show(name)}")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise bad_field("tool_choice.type", 'must be "auto", "any", "tool" or "none", got '
                        f"{show(kind)}")
    no_parallel = value.get("disable_parallel_tool_use")
    if no_parallel is not None:
        if not isinstance(no_parallel, bool):
            raise bad_field("tool_choice.disable_parallel_tool_use", "must be a boolean")
        chat["parallel_tool_calls"] = not no_parallel


def _thinking(value: Any, chat: dict[str, Any]) -> None:
    """enabled / disabled -> the template's `enable_thinking` (the request's own
    chat_template_kwargs win). `budget_tokens` is checked but not enforced: max_tokens caps
    the whole reply."""
    if not isinstance(value, dict) or value.get("type") not in ("enabled", "disabled"):
        raise bad_field("thinking", '"type" must be "enabled" (with budget_tokens) or "disabled", '
                        f"got {show(value)}")
    budget = value.get("budget_tokens")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                               or budget < 1):
        raise bad_field("thinking.budget_tokens", f"must be a positive integer, got {show(budget)}")
    kwargs = chat.get("chat_template_kwargs")
    kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
    kwargs.setdefault("enable_thinking", value["type"] == "enabled")
    chat["chat_template_kwargs"] = kwargs


def _last_block(messages: list[dict[str, Any]], ttl: float) -> Breakpoint:
    """The breakpoint a top-level `cache_control` puts on the last message's last block."""
    i = len(messages) - 1
    m = messages[i]
    if m["role"] == "tool":
        return Breakpoint("tool_result", ttl, msg=i)
    if m.get("tool_calls"):
        return Breakpoint("tool_use", ttl, msg=i, part=len(m["tool_calls"]) - 1)
    if isinstance(m["content"], str):
        if not m["content"] and m.get("reasoning_content"):
            return Breakpoint("thinking", ttl, msg=i)
        return Breakpoint("string", ttl, msg=i)
    return Breakpoint("text", ttl, msg=i, part=len(m["content"]) - 1)


# as llama-server; then, beyond it, the llama.cpp request fields an Anthropic body has no
# word for and a client of this server may want (its cache namespace, a fixed reply length
# for benchmarks, the seed); every other unknown field is ignored, as llama-server ignores it
PASSED = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs",
          "cache_prompt", "cache_salt", "ignore_eos", "seed", "id_slot")


def to_chat(body: Any, count: bool = False) -> Translated:
    """The chat-completions body of an Anthropic Messages body, its model name and its cache
    breakpoints; 400s naming the field. `count`: a count_tokens body (no max_tokens)."""
    if not isinstance(body, dict):
        raise invalid_request(f"request body must be a JSON object, got {show(body)}")
    bps: list[Breakpoint] = []
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _system(body["system"], bps)})
    _messages(body.get("messages"), messages, bps)
    chat: dict[str, Any] = {"messages": messages}
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"], bps)
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], chat)
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad_field("stop_sequences", f"must be an array of strings, got {show(stops)}")
        chat["stop"] = stops
    if not count:
        n = body.get("max_tokens")
        if n is None:
            raise invalid_request("Field 'max_tokens' is required")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise bad_field("max_tokens", f"must be an integer >= 1, got {show(n)}")
        chat["max_tokens"] = n
        for key in PASSED:
            if body.get(key) is not None:
                chat[key] = body[key]
    elif body.get("chat_template_kwargs") is not None:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    if body.get("thinking") is not None:
        _thinking(body["thinking"], chat)
    ttl = _ttl(body, "")
    if ttl is not None and messages:  # top-level: a breakpoint at the conversation's end
        bps.append(_last_block(messages, ttl))
    if len(bps) > MAX_BREAKPOINTS:
        raise invalid_request(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may "
                              f"be provided. Found {len(bps)}.")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_field("model", f"must be a string, got {show(model)}")
    return Translated(chat, model, bps)


# ------------------------------------------------------------------ breakpoints -> tokens


def _cut_after(items: list[Any], i: int, dummy: dict[str, Any]) -> list[Any]:
    """`items` up to item i, then `dummy` where item i was the last: the list renders
    differently right after item i."""
    return items[: i + 1] if i + 1 < len(items) else [*items, dummy]


def _with_mark(chat: dict[str, Any], bp: Breakpoint) -> dict[str, Any]:
    """A copy of `chat` that renders differently right after the breakpoint's block: a marker
    after its text, or the tools (calls) after it dropped (one added when it is the last).
    Only the parts on the way to the block are copied."""
    out = dict(chat)
    if bp.kind == "tool":
        out["tools"] = _cut_after(chat["tools"], bp.part, _DUMMY_TOOL)
        return out
    msgs = out["messages"] = list(chat["messages"])
    m = msgs[bp.msg] = dict(msgs[bp.msg])
    if bp.kind == "system":
        m["content"] = m["content"][: bp.end] + MARK + m["content"][bp.end :]
    elif bp.kind == "text":
        parts = m["content"] = list(m["content"])
        parts[bp.part] = {**parts[bp.part], "text": parts[bp.part]["text"] + MARK}
    elif bp.kind in ("tool_result", "string"):
        m["content"] += MARK
    elif bp.kind == "thinking":
        m["reasoning_content"] += MARK
    else:  # tool_use
        m["tool_calls"] = _cut_after(m["tool_calls"], bp.part, _DUMMY_CALL)
    return out


def first_difference(a: str, b: str) -> int | None:
    """Length of the common prefix of `a` and `b`; None when they are equal."""
    if a == b:
        return None
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # bisect on slice equality (memcmp), not a character loop
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _render(chat: dict[str, Any], ctx: ParseContext) -> str:
    return render_chat(validate_body(ChatRequest, chat), ctx.chat_template, ctx.tokenizer, ctx)


def breakpoint_tokens(tr: Translated, tokens: list[int], ctx: ParseContext) -> list[int]:
    """Each breakpoint's position in the prompt `tokens` (the rendering of `tr.chat`): the
    tokens the prompt text before the end of its block tokenizes to, as the prompt has them.
    A breakpoint the template does not show (or cannot render so) has none."""
    real = _render(tr.chat, ctx)
    out = []
    for bp in tr.breakpoints:
        try:
            end = first_difference(real, _render(_with_mark(tr.chat, bp), ctx))
        except TaskError:  # the template refused the variant: no position, the request runs
            continue
        if end is None:
            continue
        head = ctx.tokenizer.encode(real[:end], add_special=True, parse_special=True)
        out.append(common_prefix(head, tokens))
    return out


# ------------------------------------------------------------------ parsing and counting


def parse_messages(body: Any, ctx: ParseContext) -> ParsedRequest:
    """A /v1/messages body -> its task (chat completions' parser), pinned up to its last
    breakpoint when the server can pin; `origin` is the request's model name."""
    tr = to_chat(body)
    req = parse_chat(tr.chat, ctx)
    req.prefill = ""  # Anthropic answers a prefilled turn with its continuation only
    req.origin = tr.model
    for t in req.tasks:
        t.timings_per_token = req.stream  # message_start reports the cache fields
    ends = [n for n in breakpoint_tokens(tr, req.task.prompt_tokens, ctx) if n > 0] \
        if tr.breakpoints else []
    if ends:
        pin_s = max(b.ttl_s for b in tr.breakpoints) if ctx.defaults.can_pin else 0.0
        for t in req.tasks:
            t.pin_n, t.pin_s = max(ends), pin_s
            t.user_starts = tuple(sorted({*t.user_starts, *ends}))
    return req


def count_tokens(body: Any, ctx: ParseContext) -> dict[str, int]:
    """`{"input_tokens": N}`: the prompt tokens the same request's completion would have
    (its usage's input + cache read + cache creation), without running it."""
    tr = to_chat(body, count=True)
    return {"input_tokens": len(chat_tokens(validate_body(ChatRequest, tr.chat), ctx)[1])}


# ------------------------------------------------------------------ answers


def usage_json(timings: Timings | None, task: CompletionTask, n_prompt: int, n_output: int
               ) -> dict[str, int]:
    """Anthropic's usage from the run's timings: read = tokens a cache served; creation =
    tokens computed before the last `cache_control` breakpoint (`task.pin_n`: the prefix kept
    for reuse, pinned where the server can pin; Anthropic writes a cache only at
    breakpoints); input = the rest computed (no breakpoint: llama-server's n_prompt -
    cache_n, so a prompt always counts input tokens)."""
    read = timings.cache_n if timings else 0
    created = (max(min(task.pin_n, n_prompt) - read, 0)
               if timings and task.cache_prompt and task.pin_n > 0 else 0)
    return {"input_tokens": max(n_prompt - read - created, 0),
            "cache_creation_input_tokens": created, "cache_read_input_tokens": read,
            "output_tokens": n_output}


def stop_reason(final: FinalResult, msg: ParsedMessage | None) -> str:
    if not ended_by_itself(final):
        return "max_tokens"
    if msg is not None and msg.tool_calls:
        return "tool_use"
    return "stop_sequence" if final.stop_type == "word" else "end_turn"


def _deltas(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The message deltas of chat chunks (a closing chunk's delta is empty)."""
    return [c["choices"][0]["delta"] for c in chunks if c.get("choices")]


def _tool_input(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_json(final: FinalResult, req: ParsedRequest, ctx: ResponseContext
                 ) -> dict[str, Any]:
    """The non-streamed answer: thinking, text, then tool_use blocks (llama-server's order)."""
    msg = parse_reply(final, req)
    blocks: list[dict[str, Any]] = []
    if msg.reasoning_content:
        blocks.append({"type": "thinking", "thinking": msg.reasoning_content, "signature": ""})
    if msg.content:
        blocks.append({"type": "text", "text": msg.content})
    blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": _tool_input(c.arguments)}
               for c in msg.tool_calls]
    reason = stop_reason(final, msg)
    return {
        "id": ctx.id, "type": "message", "role": "assistant",
        "model": req.origin or ctx.model, "content": blocks, "stop_reason": reason,
        "stop_sequence": final.stopping_word if reason == "stop_sequence" else None,
        "usage": usage_json(final.timings, req.task, final.n_prompt_tokens, len(final.tokens)),
    }


class MessageStream(ChatStream):
    """Anthropic's named events: message_start (at the first result: its usage has the cache
    fields), each content block's start, deltas and stop in turn, message_delta (stop reason,
    usage), message_stop. The reply is parsed and diffed as chat completions stream it (this
    is a ChatStream); each chat delta goes to its block, and a delta of another kind than the
    open block's closes it and opens the next."""

    done = None  # message_stop ends it, no [DONE]

    def __init__(self, req: ParsedRequest, ctx: ResponseContext) -> None:
        super().__init__(req, ctx)
        self.started = False
        self.blocks: dict[Any, int] = {}  # ("text"|"thinking", n) or ("tool", i) -> index
        self.open: Any = None  # the key of the open block
        self.n_text = 0  # text/thinking blocks opened (a new one after another kind's)

    def frame(self, chunk: dict[str, Any]) -> bytes:
        return sse_named(chunk["type"], chunk)

    def error(self, err: TaskError) -> bytes:
        return self.frame(anthropic_error_json(err))

    def start(self) -> list[dict[str, Any]]:
        return []  # message_start waits for the first result's timings

    def _plain(self) -> bool:
        return False  # never chat's pre-cut text chunk

    def _begin(self, timings: Timings | None) -> list[dict[str, Any]]:
        if self.started:
            return []
        self.started = True
        task = self.req.task
        message = {"id": self.ctx.id, "type": "message", "role": "assistant",
                   "model": self.req.origin or self.ctx.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": usage_json(timings, task, len(task.prompt_tokens), 0)}
        return [{"type": "message_start", "message": message}]

    def partial(self, p: PartialResult) -> list[dict[str, Any]]:
        return self._begin(p.timings) + self._blocks(_deltas(super().partial(p)))

    def final(self, f: FinalResult) -> list[dict[str, Any]]:
        out = self._begin(f.timings) + self._blocks(_deltas(super().final(f))) + self._end_block()
        reason = stop_reason(f, self.msg or parse_reply(f, self.req))
        usage = usage_json(f.timings, self.req.task, f.n_prompt_tokens, len(f.tokens))
        return out + [
            {"type": "message_delta",
             "delta": {"stop_reason": reason,
                       "stop_sequence": f.stopping_word if reason == "stop_sequence" else None},
             "usage": usage},
            {"type": "message_stop"},
        ]

    def _end_block(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        key, self.open = self.open, None
        index = self.blocks[key]
        out: list[dict[str, Any]] = []
        if key[0] == "thinking":  # Anthropic sends the block's signature last (none here)
            out.append({"type": "content_block_delta", "index": index,
                        "delta": {"type": "signature_delta", "signature": ""}})
        return out + [{"type": "content_block_stop", "index": index}]

    def _open(self, key: Any, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._end_block()
        self.blocks[key] = len(self.blocks)
        self.open = key
        return out + [{"type": "content_block_start", "index": self.blocks[key],
                       "content_block": block}]

    def _blocks(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Events for OpenAI-style deltas (message_deltas' order)."""
        out: list[dict[str, Any]] = []
        for d in deltas:
            for kind, key, dtype in (("thinking", "reasoning_content", "thinking_delta"),
                                     ("text", "content", "text_delta")):
                if key not in d:
                    continue
                if self.open is None or self.open[0] != kind:
                    self.n_text += 1
                    out += self._open((kind, self.n_text), {"type": kind, kind: ""})
                out.append({"type": "content_block_delta", "index": self.blocks[self.open],
                            "delta": {"type": dtype, kind: d[key]}})
            for call in d.get("tool_calls", ()):
                key = ("tool", call["index"])
                if key not in self.blocks:
                    fn = call["function"]
                    out += self._open(key, {"type": "tool_use", "id": call.get("id", ""),
                                            "name": fn["name"], "input": {}})
                args = call["function"].get("arguments", "")
                if args:
                    out.append({"type": "content_block_delta", "index": self.blocks[key],
                                "delta": {"type": "input_json_delta", "partial_json": args}})
        return out
