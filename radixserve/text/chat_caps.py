"""What a chat template can render, found by rendering probes, and minja's polyfills for the rest.

llama.cpp (through minja) never trusts a template's name: it renders a few probe conversations
and looks for needles in the output. A template that does not mention the tools it is given,
or drops an assistant's tool_calls, or a tool's reply, still gets them, written as text the
model can read: tools described in the system prompt, calls as a `{"tool_calls": [...]}` JSON
content, replies as `{"tool_response": ...}` user messages. Each polyfill runs only where the
conversation needs it, so a conversation without tools renders exactly as before.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from radixserve.text.chat_template import ChatTemplate, flatten_content

log = logging.getLogger(__name__)

_USER = {"role": "user", "content": "<User Needle>"}
_PROBE_TOOL = {"name": "some_tool", "type": "function", "function": {
    "name": "some_tool", "description": "Some tool.", "parameters": {
        "type": "object", "properties": {"arg": {"type": "string",
                                                 "description": "Some argument."}},
        "required": ["arg"]}}}
_PROBE_ARGS = {"argument_needle": "print('Hello, World!')"}
_ARG_NEEDLES = ("<parameter=argument_needle>", '"argument_needle":', "'argument_needle':")


@dataclass(frozen=True, slots=True)
class TemplateCaps:
    supports_system_role: bool = True
    supports_tools: bool = False  # describes the `tools` it is given
    supports_tool_calls: bool = False  # renders an assistant message's tool_calls
    supports_tool_responses: bool = False  # renders role "tool" messages
    supports_parallel_tool_calls: bool = False
    requires_object_arguments: bool = False  # tool_calls arguments must be objects, not JSON text
    tool_call_example: str = ""  # how the template writes a call (for the tools polyfill)


def _try_render(t: ChatTemplate, messages: list[dict[str, Any]], tools: Any = None,
                add_generation_prompt: bool = False) -> str:
    try:
        return t.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    except ValueError:
        return ""


def _call_msg(*calls: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": list(calls)}


def _call(name: str, arguments: Any, call_id: str = "call_1___") -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"arguments": arguments, "name": name}}


def template_caps(t: ChatTemplate) -> TemplateCaps:
    """The template's capabilities (computed once per template text)."""
    return _caps(t.source, t.bos_token, t.eos_token)


@lru_cache(maxsize=32)
def _caps(source: str, bos: str, eos: str) -> TemplateCaps:
    """minja's chat_template probes. (Its requires_non_null_content probe has no use here:
    ChatTemplate renders a null content as "".)"""
    t = ChatTemplate(source, bos, eos)
    sys_out = _try_render(t, [{"role": "system", "content": "<System Needle>"}, _USER])
    tools = "some_tool" in _try_render(t, [_USER], tools=[_PROBE_TOOL])

    def renders_args(args: Any) -> bool:
        out = _try_render(t, [_USER, _call_msg(_call("ipython", args))])
        return any(n in out for n in _ARG_NEEDLES)

    str_args, obj_args = renders_args(json.dumps(_PROBE_ARGS)), renders_args(_PROBE_ARGS)
    calls, parallel, responses = str_args or obj_args, False, False
    if calls:
        args = _PROBE_ARGS if not str_args else json.dumps(_PROBE_ARGS)
        out = _try_render(t, [_USER, _call_msg(_call("test_tool1", args),
                                               _call("test_tool2", args))])
        parallel = "test_tool1" in out and "test_tool2" in out
        out = _try_render(t, [_USER, _call_msg(_call("test_tool1", args)), {
            "role": "tool", "name": "test_tool1", "content": "Some response!",
            "tool_call_id": "call_911_"}])
        responses = "Some response!" in out
    caps = TemplateCaps("<System Needle>" in sys_out, tools, calls, responses, parallel,
                        obj_args and not str_args)
    if not tools:
        caps = dataclasses.replace(caps, tool_call_example=_tool_call_example(t, caps))
    return caps


def _tool_call_example(t: ChatTemplate, caps: TemplateCaps) -> str:
    """How this template writes an assistant's call (polyfilled where it cannot): the text a
    call adds after the generation prompt (minja's tool_call_example_)."""
    user = {"role": "user", "content": "Hey"}
    args = {"arg1": "some_value"}
    call = _call_msg(_call("tool_name", args if caps.requires_object_arguments
                           else json.dumps(args, separators=(",", ":"))))
    try:
        prefix = render(t, caps, [user], add_generation_prompt=True)
        full = render(t, caps, [user, call], add_generation_prompt=False)
    except ValueError:
        return ""
    eos = t.eos_token
    last = full.rfind(eos) if eos else -1
    if eos and last >= 0 and (last == len(prefix) - len(eos) or (
            full.endswith("\n") and last == len(full) - len(eos) - 1)):
        full = full[:last]
    common = 0
    for i in range(min(len(prefix), len(full))):
        if prefix[i] != full[i]:
            break
        if prefix[i] != "<":  # DeepSeek R1 diverges at "<think>" vs its tool tags
            common = i + 1
    example = full[common:]
    if "tool_name" not in example and "some_value" not in example:
        log.warning("could not infer how the chat template writes a tool call")
        return ""
    return example


def add_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """`text` appended to the first message when it is a system one (after a blank line),
    else a new system message first (minja's add_system)."""
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        return [{"role": "system", "content": flatten_content(first.get("content")) + "\n\n"
                 + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _object_arguments(calls: list[Any]) -> list[Any]:
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                c = {**c, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
            except json.JSONDecodeError:
                log.warning("tool call arguments are not JSON: %.80s", fn["arguments"])
        out.append(c)
    return out


def _calls_as_content(m: dict[str, Any]) -> dict[str, Any]:
    calls = []
    for c in _object_arguments(m["tool_calls"]):
        if not isinstance(c, dict) or c.get("type", "function") != "function":
            continue
        fn = c.get("function") or {}
        tc = {"name": fn.get("name"), "arguments": fn.get("arguments")}
        if "id" in c:
            tc["id"] = c["id"]
        calls.append(tc)
    obj: dict[str, Any] = {"tool_calls": calls}
    content = flatten_content(m.get("content"))
    if content:
        obj["content"] = content
    out = {k: v for k, v in m.items() if k != "tool_calls"}
    return out | {"content": json.dumps(obj, indent=2, ensure_ascii=False)}


def _response_as_user(m: dict[str, Any]) -> dict[str, Any]:
    reply: dict[str, Any] = {}
    if "name" in m:
        reply["tool"] = m["name"]
    reply["content"] = flatten_content(m.get("content"))
    if "tool_call_id" in m:
        reply["tool_call_id"] = m["tool_call_id"]
    out = {k: v for k, v in m.items() if k not in ("name", "role")}
    return {"role": "user", **out,
            "content": json.dumps({"tool_response": reply}, indent=2, ensure_ascii=False)}


def _merge_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """System messages folded into the next user message (minja's system-role polyfill)."""
    out: list[dict[str, Any]] = []
    pending = ""
    for m in messages:
        content = flatten_content(m.get("content"))
        if m["role"] == "system":
            pending += ("\n" if pending else "") + content
            continue
        if pending and m["role"] == "user":
            m = {**m, "content": pending + ("\n" + content if content else "")}
        elif pending:
            out.append({"role": "user", "content": pending})
        pending = ""
        out.append(m)
    if pending:
        out.append({"role": "user", "content": pending})
    return out


def polyfill(caps: TemplateCaps, messages: list[dict[str, Any]], tools: list[Any] | None,
             merge_system: bool = False) -> list[dict[str, Any]]:
    """The messages as the template can render them (minja's chat_template::apply)."""
    msgs = list(messages)
    if tools and not caps.supports_tools:
        text = ("You can call any of the following tools to satisfy the user's requests: "
                + json.dumps(tools, indent=2, ensure_ascii=False))
        if caps.tool_call_example:
            text += "\n\nExample tool call syntax:\n\n" + caps.tool_call_example + "\n\n"
        msgs = add_system(msgs, text)
    out = []
    for m in msgs:
        if m.get("tool_calls"):
            if not caps.supports_tool_calls:
                m = _calls_as_content(m)
            elif caps.requires_object_arguments:
                m = {**m, "tool_calls": _object_arguments(m["tool_calls"])}
        if m["role"] == "tool" and not caps.supports_tool_responses:
            m = _response_as_user(m)
        out.append(m)
    if merge_system and not caps.supports_system_role:
        out = _merge_system(out)
    return out


def render(t: ChatTemplate, caps: TemplateCaps, messages: list[dict[str, Any]],
           tools: list[Any] | None = None, add_generation_prompt: bool = True,
           merge_system: bool = False, **extra: Any) -> str:
    """The template's text for `messages`, polyfilled (ValueError as ChatTemplate.render)."""
    msgs = polyfill(caps, messages, tools, merge_system)
    variables = {**extra, "tools": tools} if tools else extra
    return t.render(msgs, add_generation_prompt=add_generation_prompt, **variables)
