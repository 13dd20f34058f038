"""A chat reply's text -> an OpenAI message: content, reasoning_content and tool calls.

One parser reads both a finished reply and one still streaming (`partial`). Streaming sends
the difference between successive parses, and nothing sent can be taken back, so a partial
parse only ever grows: text that may still turn into markup (a half-written `<tool_call`, a
call whose name is not complete yet) is held back until it is decided, and whatever a partial
parse decided, the final parse decides the same. Text that does not parse as a call stays
content. Tool-call arguments are the model's own JSON text (whitespace-trimmed), so the
arguments streamed so far are always a prefix of the final ones.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from radixserve.text.partial_json import (
    Member,
    array_items,
    object_members,
    skip_ws,
    string_prefix,
)

log = logging.getLogger(__name__)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
CHANNEL, MESSAGE, END, START = "<|channel|>", "<|message|>", "<|end|>", "<|start|>"
FORMATS = ("content", "generic", "hermes", "llama3", "harmony")
_ALNUM = string.ascii_letters + string.digits


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as the model wrote it
    id: str = ""


@dataclass(slots=True)
class ParsedMessage:
    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def random_call_id() -> str:
    """llama-server's tool call ids: 32 random alphanumerics."""
    return "".join(secrets.choice(_ALNUM) for _ in range(32))


# ------------------------------------------------------------------ one call object


@dataclass(slots=True)
class _Call:
    name: str
    arguments: str
    id: str | None = None


_ARG_KEYS = ("arguments", "parameters")


def _json_call(s: str, done: bool, want_id: bool = False) -> _Call | None:
    """The call in the JSON object `s` starts with (`{"name": ..., "arguments": ...}`), or
    None. `done`: no more text will come. While the text is still growing, a call is decided
    once its name is complete and its arguments have begun after it (or when the object is
    complete); `want_id`: the model writes an id after the arguments (the call's id, else
    ignored: a call streamed before its id would change), so wait for the whole object.
    Arguments that are not complete JSON are what text there is, trimmed."""
    i = skip_ws(s, 0)
    if i >= len(s) or s[i] != "{":
        return None
    found, end = object_members(s, i)
    name: str | None = None
    args: Member | None = None
    call_id: str | None = None
    name_first = False
    for m in found:
        if m.key == "name" and name is None:
            name = _string_value(s, m)
            name_first = name is not None and args is None
        elif m.key in _ARG_KEYS and args is None:
            args = m
        elif m.key == "id":
            call_id = _string_value(s, m)
    if name is None or args is None:
        return None
    if not done and end is None and (want_id or not name_first):
        return None
    text = s[args.start : args.end] if args.end is not None else s[args.start :].strip()
    return _Call(name, text, call_id if want_id else None)


def _string_value(s: str, m: Member) -> str | None:
    """A member's value when it is a complete JSON string."""
    if m.end is None or s[m.start] != '"':
        return None
    try:
        return str(json.loads(s[m.start : m.end], strict=False))
    except ValueError:  # a bad escape
        return None


def _hold_prefix_of(text: str, tag: str) -> str:
    """`text` without a trailing start of `tag` (it may still become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return text[:-n]
    return text


# ------------------------------------------------------------------ formats


def _hermes(text: str, partial: bool, fmt: OutputFormat) -> tuple[list[_Call], str]:
    """`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` blocks; text around them
    is content (whitespace after a block is dropped, as llama.cpp does)."""
    calls: list[_Call] = []
    content: list[str] = []
    pos = 0
    while True:
        k = text.find(CALL_OPEN, pos)
        if k < 0:
            tail = text[pos:]
            content.append(_hold_prefix_of(tail, CALL_OPEN) if partial else tail)
            break
        content.append(text[pos:k])
        body = k + len(CALL_OPEN)
        e = text.find(CALL_CLOSE, body)
        region = text[body : e if e >= 0 else len(text)]
        open_block = e < 0 and partial
        call = _json_call(_hold_prefix_of(region, CALL_CLOSE) if open_block else region,
                          done=not open_block)
        if call is not None:
            calls.append(call)
        elif not open_block:
            content.append(text[k : e + len(CALL_CLOSE) if e >= 0 else len(text)])
        if e < 0:
            break
        pos = e + len(CALL_CLOSE)
        if call is not None:
            pos = skip_ws(text, pos)
    return calls, "".join(content)


def _llama3(text: str, partial: bool, fmt: OutputFormat) -> tuple[list[_Call], str]:
    """One `{"name": ..., "parameters": ...}` object at the start (after an optional
    `<|python_tag|>`); text after it is content. Anything else is all content."""
    i = skip_ws(text, 0)
    if partial and text[i:] and PYTHON_TAG.startswith(text[i:]):
        return [], ""
    if text.startswith(PYTHON_TAG, i):
        i = skip_ws(text, i + len(PYTHON_TAG))
    if i >= len(text):
        return [], "" if partial else text
    if text[i] != "{":
        return [], text
    _, end = object_members(text, i)
    done = end is not None or not partial
    call = _json_call(text[i : end if end is not None else len(text)], done=done)
    if call is None:
        return [], "" if not done else text
    return [call], "" if end is None else text[skip_ws(text, end) :]


def _generic(text: str, partial: bool, fmt: OutputFormat) -> tuple[list[_Call], str]:
    """llama.cpp's generic format: one JSON object, `{"tool_call": {...}}`,
    `{"tool_calls": [...]}` or `{"response": ...}` (a string is the content; any other value,
    a json_schema reply, is its JSON text). Anything else is all content."""
    i = skip_ws(text, 0)
    if i >= len(text) or text[i] != "{":
        return [], "" if partial and i >= len(text) else text
    found, _ = object_members(text, i)
    undecided: tuple[list[_Call], str] = [], ("" if partial else text)
    if not found:
        return undecided
    m = found[0]
    value = text[m.start : m.end if m.end is not None else len(text)]
    if m.key == "response":
        if value.startswith('"'):
            return [], string_prefix(value, 0, final=not partial)[0]
        return [], value if m.end is not None else value.rstrip() if partial else value.strip()
    calls: list[_Call] = []
    if m.key == "tool_call":
        call = _json_call(value, done=m.end is not None or not partial, want_id=fmt.model_ids)
        calls = [call] if call is not None else []
    elif m.key == "tool_calls" and value.startswith("["):
        elements, _ = array_items(value, 0)
        for start, end in elements:
            done = end is not None or not partial
            call = _json_call(value[start : end if end is not None else len(value)], done,
                              want_id=fmt.model_ids)
            if call is None and not done:
                break
            if call is not None:
                calls.append(call)
    return (calls, "") if calls else undecided


_PARSERS = {"hermes": _hermes, "llama3": _llama3, "generic": _generic}


# ------------------------------------------------------------------ harmony (gpt-oss)

_NEXT_MESSAGE = START + "assistant"
# what follows `<|start|>assistant` up to `<|message|>`: a recipient in the role or the
# channel header, the channel, a content type (`json`, `<|constrain|>json`); gpt-oss-20b
# sometimes opens with a stray `<|channel|>commentary` before the real channel
_HEADER = re.compile(
    r"(?: to=(?P<role_to>[^\s<]+))?"
    r"(?:<\|channel\|>commentary(?: to=assistant)?(?=<\|channel\|>))?"
    r"<\|channel\|>(?P<channel>[A-Za-z0-9_-]+)"
    r"(?: to=(?P<to>[^\s<]+))?"
    r"(?:\s*(?:<\|constrain\|>)?[A-Za-z0-9_-]+)?\s*\Z")


def _harmony(text: str, partial: bool, fmt: OutputFormat) -> tuple[list[_Call], str, str]:
    """(calls, content, reasoning) of a harmony reply: messages `HEADER<|message|>BODY<|end|>`
    joined by `<|start|>assistant` (the prompt wrote the first one's). llama.cpp's rules:
    analysis bodies are the reasoning (with reasoning_format none, the analysis messages stay
    in the content as written), commentary without a recipient (a preamble) is content and
    the reply goes on; a final message, a call to `functions.NAME` (when tools are on) or a
    call to any other recipient (dropped: a builtin tool's) ends it. A header not yet closed
    by `<|message|>` is held back (dropped when the reply ends there); text that cannot be a
    header is content as written."""
    if fmt.final_open:
        text = CHANNEL + "final" + MESSAGE + text
    calls: list[_Call] = []
    content: list[str] = []
    thought: list[str] = []
    pos = 0
    while True:
        rest = text[pos:]
        if not (rest.startswith((CHANNEL, " to=")) or CHANNEL.startswith(rest)
                or " to=".startswith(rest)):
            content.append(rest)
            break
        k = text.find(MESSAGE, pos)
        header = _HEADER.match(text, pos, k) if k >= 0 else None
        if header is None:
            if k >= 0:
                content.append(rest)
            break
        body_at = k + len(MESSAGE)
        e = text.find(END, body_at)
        body = text[body_at : e if e >= 0 else len(text)]
        if e < 0 and partial:
            body = _hold_prefix_of(body, END)
        to, channel = header["role_to"] or header["to"], header["channel"]
        if to is not None and to != "assistant":
            if fmt.tools and to.startswith("functions."):
                calls.append(_Call(to[len("functions.") :], body.strip()))
            break
        if channel == "analysis" and fmt.reasoning == "none":
            content.append(text[pos:body_at] + body + (END if e >= 0 else ""))
        elif channel == "analysis":
            thought.append(body)
        else:
            content.append(body)
            if channel != "commentary":
                break
        if e < 0:
            break
        pos = e + len(END)
        if text.startswith(_NEXT_MESSAGE, pos):
            pos += len(_NEXT_MESSAGE)
            continue
        # plain text after a message is content; another role's message is not the reply's
        if not (_NEXT_MESSAGE.startswith(text[pos:]) or text.startswith(START, pos)):
            content.append(text[pos:])
        break
    reasoning = "".join(thought)
    if not reasoning.strip(" \n\r\t"):  # llama.cpp drops a whitespace-only thought
        reasoning = ""
    return calls, "".join(content), reasoning


# ------------------------------------------------------------------ reasoning


def _split_reasoning(text: str, partial: bool, fmt: OutputFormat) -> tuple[str, str, str]:
    """(reasoning, content before the reply, the reply) of a reply that may open with
    `<think>...</think>` (or starts inside one: the prompt opened it). llama.cpp's rules: the
    thought is trimmed, whitespace after `</think>` dropped, an unclosed thought is reasoning;
    deepseek-legacy also keeps the tagged thought in the content."""
    if fmt.reasoning == "none":
        return "", "", text
    if fmt.thinking_open:
        start = 0
    elif text.startswith(THINK_OPEN):
        start = len(THINK_OPEN)
    elif partial and THINK_OPEN.startswith(text):
        return "", "", ""
    else:
        return "", "", text
    end = text.find(THINK_CLOSE, start)
    if end >= 0:
        after = skip_ws(text, end + len(THINK_CLOSE))
        thought, rest, closed = text[start:end], text[after:], True
    else:
        thought, rest, closed = text[start:], "", not partial
        if partial:
            thought = _hold_prefix_of(thought, THINK_CLOSE)
    thought = thought.strip()
    if not thought or fmt.reasoning != "deepseek-legacy":
        return thought, "", rest
    return thought, THINK_OPEN + thought + (THINK_CLOSE if closed else ""), rest


# ------------------------------------------------------------------ per request / per task


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """How a request's replies are read; shared by its tasks (each gets its own parser)."""

    kind: str = "content"  # one of FORMATS
    reasoning: str = "none"  # none | deepseek | deepseek-legacy
    thinking_open: bool = False  # the prompt ends inside `<think>`
    model_ids: bool = False  # generic with parallel calls: the model writes each call's id
    tools: bool = False  # harmony: `functions.*` calls are tool calls (else dropped)
    final_open: bool = False  # harmony: the prompt ends inside a final message (a prefill)

    def parser(self) -> MessageParser:
        return MessageParser(self)


class MessageParser:
    """Parses one task's reply, partial or final. A call without an id of the model's gets a
    random one, drawn once per call index, so every parse of the task agrees on it."""

    def __init__(self, fmt: OutputFormat) -> None:
        self.fmt = fmt
        self._ids: list[str] = []

    def parse(self, text: str, partial: bool = False) -> ParsedMessage:
        if self.fmt.kind == "harmony":
            calls, content, reasoning = _harmony(text, partial, self.fmt)
        else:
            reasoning, pre, rest = _split_reasoning(text, partial, self.fmt)
            parse = _PARSERS.get(self.fmt.kind)
            calls, content = parse(rest, partial, self.fmt) if parse else ([], rest)
            content = pre + content
        while len(self._ids) < len(calls):
            self._ids.append(random_call_id())
        return ParsedMessage(content, reasoning, [
            ToolCall(c.name, c.arguments, c.id or self._ids[i]) for i, c in enumerate(calls)])


def message_deltas(sent: ParsedMessage, new: ParsedMessage) -> list[dict[str, Any]]:
    """OpenAI `delta` objects taking the client from `sent` to `new` (llama.cpp's order:
    reasoning, content, then each call: its header with empty arguments, then the arguments
    that follow). `sent` is updated to what the client has. A field that shrank or changed
    cannot be taken back: that is a parser bug, logged, and the field is left as sent."""
    out: list[dict[str, Any]] = []
    for key in ("reasoning_content", "content"):
        old, cur = getattr(sent, key), getattr(new, key)
        if cur.startswith(old):
            if len(cur) > len(old):
                out.append({key: cur[len(old) :]})
                setattr(sent, key, cur)
        else:
            log.warning("chat parser: %s changed after it was streamed", key)
    for i, call in enumerate(new.tool_calls):
        if i >= len(sent.tool_calls):
            out.append({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}]})
            sent.tool_calls.append(ToolCall(call.name, "", call.id))
        old_call = sent.tool_calls[i]
        if (call.name, call.id) != (old_call.name, old_call.id) or \
                not call.arguments.startswith(old_call.arguments):
            log.warning("chat parser: tool call %d changed after it was streamed", i)
        elif len(call.arguments) > len(old_call.arguments):
            more = call.arguments[len(old_call.arguments) :]
            out.append({"tool_calls": [{"index": i, "function": {"arguments": more}}]})
            old_call.arguments = call.arguments
    return out


def message_json(msg: ParsedMessage) -> dict[str, Any]:
    """The OpenAI `message` of a reply (llama.cpp's to_json_oaicompat): content null when a
    call-only reply has none, reasoning_content only when there is some."""
    out: dict[str, Any] = {"role": "assistant",
                           "content": None if msg.tool_calls and not msg.content else msg.content}
    if msg.reasoning_content:
        out["reasoning_content"] = msg.reasoning_content
    if msg.tool_calls:
        out["tool_calls"] = [{"type": "function", "function": {"name": c.name,
                                                               "arguments": c.arguments},
                              "id": c.id} for c in msg.tool_calls]
    return out
