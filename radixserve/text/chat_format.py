"""OpenAI tools and reasoning for a chat request: its prompt, its grammar and how to read the reply.

llama-server's chat formats (llama.cpp common/chat.cpp, 2025), chosen from the template text:

- **hermes** (the template writes `<tool_call>`: Hermes 2/3, Qwen 2.5/3): calls are
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks;
- **llama3** (`<|start_header_id|>` and `ipython`: Llama 3.1-3.3): one
  `{"name": ..., "parameters": {...}}` object;
- **generic**, for templates without native tools (and any request mixing tools with a JSON
  schema): the model answers one JSON object, `{"tool_call": ...}` (`{"tool_calls": [...]}`
  with parallel calls) or `{"response": ...}`, which a grammar always enforces; the system
  prompt says so, and minja's polyfills describe the tools (chat_caps.py);
- **content**: no tools (or tool_choice "none"): the reply is content, with a leading
  `<think>...</think>` split off as reasoning when the template thinks (`<think>` in it).
- **harmony** (the template writes `<|channel|>`: gpt-oss), with or without tools: OpenAI's
  harmony messages, `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final
  <|message|>...`; calls are commentary messages to `functions.NAME` (chat_parse.py).

hermes, llama3 and harmony get a grammar only when a call is required (tool_choice "required"
or a named function), harmony also for a JSON schema (after its analysis messages, a final
message whose body is the JSON). With "auto" llama.cpp uses a lazy grammar that starts
constraining once the model opens a call; there is no lazy grammar here, so the reply is free
and parsed as it comes (a malformed call stays content).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from radixserve.text import grammar as grammars
from radixserve.text.chat_caps import TemplateCaps, add_system, render, template_caps
from radixserve.text.chat_parse import (
    CHANNEL,
    END,
    MESSAGE,
    START,
    THINK_CLOSE,
    THINK_OPEN,
    OutputFormat,
)
from radixserve.text.chat_template import ChatTemplate

REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")
TOOL_CHOICES = ("auto", "none", "required")
RESPOND_IN_JSON = ("Respond in JSON format, either with `tool_call` (a request to call tools) or "
                   "with `response` reply to the user's request")
NO_PARAMETERS = {"type": "object", "properties": {}}
_RETURN = "<|return|>"


@dataclass(slots=True)
class ChatInputs:
    """A chat request as the template side needs it (request fields as the client sent them)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    variables: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    json_schema: Any = None  # the reply's schema (json_schema / response_format), or None
    reasoning_format: Any = "auto"
    custom_grammar: bool = False  # the request has its own `grammar`
    parse_output: bool = True  # False: --skip-chat-parsing, the reply stays plain content
    prefill: str = ""  # a trailing assistant message the reply continues
    bos: str = ""  # dropped from the start of the text (the tokenizer adds BOS itself)
    eos: str = ""  # dropped from the end (likewise)


@dataclass(slots=True)
class ChatPlan:
    prompt: str
    grammar: str | None = None  # llguidance grammar text, not yet checked against a vocabulary
    output: OutputFormat | None = None  # None: the reply is plain content
    prefill: str = ""  # the text of the assistant message the reply continues


def parse_tools(value: Any) -> list[dict[str, Any]]:
    """The request's `tools`, checked and in llama.cpp's normal form (type, name, description,
    parameters: the template sees that, nothing else)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError("Field 'tools': must be an array of tools")
    out = []
    for i, tool in enumerate(value):
        where = f"Field 'tools[{i}]'"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f'{where}: must be an object of type "function"')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}: 'function' must be an object")
        name, desc = fn.get("name"), fn.get("description", "")
        params = fn.get("parameters", NO_PARAMETERS)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: 'function.name' must be a non-empty string")
        if not isinstance(desc, str):
            raise ValueError(f"{where}: 'function.description' must be a string")
        if not isinstance(params, dict):
            raise ValueError(f"{where}: 'function.parameters' must be a JSON schema object")
        out.append({"type": "function",
                    "function": {"name": name, "description": desc, "parameters": params}})
    return out


def parse_tool_choice(value: Any, names: list[str]) -> tuple[str, str | None]:
    """(auto | none | required, the function a named choice forces, else None)."""
    if value is None:
        return "auto", None
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise ValueError(f"Field 'tool_choice': Invalid tool_choice: {value}")
        return value, None
    fn = value.get("function") if isinstance(value, dict) else None
    if not (isinstance(fn, dict) and value.get("type") == "function"
            and isinstance(fn.get("name"), str)):
        raise ValueError('Field \'tool_choice\': must be "auto", "none", "required" or '
                         '{"type": "function", "function": {"name": ...}}')
    if fn["name"] not in names:
        raise ValueError(f"Field 'tool_choice': no function named {fn['name']!r} in 'tools'")
    return "required", fn["name"]


def check_reasoning_format(value: Any) -> str:
    if value not in REASONING_FORMATS:
        raise ValueError(f"Field 'reasoning_format': Unknown reasoning format: {value} "
                         f"(expected one of {', '.join(REASONING_FORMATS)})")
    return str(value)


def _kind(source: str, use_tools: bool, schema: Any) -> str:
    """llama.cpp's choice of format, in its order (only the formats implemented here)."""
    if CHANNEL in source:
        return "harmony"
    if not use_tools:
        return "content"
    if schema is None and "<tool_call>" in source:
        return "hermes"
    if schema is None and "<|start_header_id|>" in source and "ipython" in source:
        return "llama3"
    return "generic"


def plan_chat(t: ChatTemplate, inp: ChatInputs) -> ChatPlan:
    """The prompt, grammar and reply format of a chat request; ValueError (a 400) for bad
    tools, tool_choice, reasoning_format or template errors."""
    tools = parse_tools(inp.tools)
    choice, forced = parse_tool_choice(inp.tool_choice, [f["function"]["name"] for f in tools])
    if inp.parallel_tool_calls is not None and not isinstance(inp.parallel_tool_calls, bool):
        raise ValueError("Field 'parallel_tool_calls': must be a boolean")
    reasoning = check_reasoning_format(inp.reasoning_format)
    use_tools = bool(tools) and choice != "none"
    if use_tools and inp.custom_grammar:
        raise ValueError("Cannot use custom grammar constraints with tools.")
    caps = template_caps(t)
    kind = _kind(t.source, use_tools, inp.json_schema)
    if kind == "harmony" and inp.json_schema is not None and inp.custom_grammar:
        raise ValueError("Cannot use both json_schema and grammar")
    text = _prompt(t, caps, inp, kind, tools if use_tools else None)

    # generic replies are JSON only; harmony always may think (its analysis channel)
    thinks = kind == "harmony" or (THINK_OPEN in t.source and kind != "generic")
    thinking_open = thinks and text.endswith((THINK_OPEN, THINK_OPEN + "\n"))
    if thinking_open and inp.variables.get("enable_thinking", True) is False:
        text, thinking_open = text + THINK_CLOSE, False  # as llama.cpp: close the thought
    # a template that cannot write parallel calls gets them from the polyfill (a JSON list)
    parallel = bool(inp.parallel_tool_calls) and forced is None and (
        caps.supports_parallel_tool_calls or not caps.supports_tool_calls)
    if forced is not None:
        tools = [f for f in tools if f["function"]["name"] == forced]
    grammar = None
    if kind == "generic":
        grammar = grammars.from_json_schema(generic_schema(
            tools, parallel, choice != "required", inp.json_schema))
    elif kind == "harmony" and (inp.json_schema is not None or use_tools and choice == "required"):
        grammar = grammars.from_lark(_harmony_lark(tools, inp.json_schema))
    elif kind in ("hermes", "llama3") and choice == "required":
        grammar = grammars.from_lark(_call_lark(kind, tools, parallel, thinking_open))
    mode = ("deepseek" if reasoning == "auto" else reasoning) if thinks else "none"
    output = None
    if inp.parse_output and (use_tools or mode != "none" or kind == "harmony"):
        harmony = kind == "harmony"  # a JSON schema's reply is a final message: no calls
        output = OutputFormat(kind, mode, thinking_open, kind == "generic" and parallel,
                              tools=harmony and use_tools and inp.json_schema is None,
                              final_open=harmony and bool(inp.prefill))
    return ChatPlan(text, grammar, output, inp.prefill)


def _prompt(t: ChatTemplate, caps: TemplateCaps, inp: ChatInputs, kind: str,
            tools: list[dict[str, Any]] | None) -> str:
    """The rendered prompt: the format's system text and variables, the template's BOS/EOS
    dropped where the tokenizer adds them, the prefill appended."""
    messages, variables = inp.messages, dict(inp.variables)
    if kind == "generic":
        messages = add_system(messages, RESPOND_IN_JSON)
    if kind == "harmony":
        messages = [_harmony_message(m) for m in messages]
    if kind == "llama3":
        variables |= {"date_string": time.strftime("%d %b %Y"), "tools_in_user_message": False,
                      "builtin_tools": None}
    text = render(t, caps, messages, tools, inp.add_generation_prompt,
                  merge_system=tools is not None, **variables)
    if inp.bos and text.startswith(inp.bos):
        text = text[len(inp.bos) :]
    if inp.eos and text.endswith(inp.eos) and not inp.prefill:
        text = text[: -len(inp.eos)]
    if kind == "harmony" and not inp.add_generation_prompt:
        # the template ends a final assistant message with `<|return|>`, which only ever ends
        # a reply: a conversation that goes on needs `<|end|>` there
        at = text.rfind(_RETURN)
        if at >= 0:
            text = text[:at] + END + text[at + len(_RETURN) :]
    if kind == "harmony" and inp.prefill:  # the reply continues a final message
        return text + CHANNEL + "final" + MESSAGE + inp.prefill
    return text + inp.prefill


def _harmony_message(m: dict[str, Any]) -> dict[str, Any]:
    """An assistant message as the gpt-oss template reads it: its reasoning as `thinking`, and
    with tool calls, no content (the template writes one or the other as the analysis)."""
    if not isinstance(m.get("reasoning_content"), str):
        return m
    m = {**m, "thinking": m["reasoning_content"]}
    if m.get("tool_calls"):
        m.pop("content", None)
    return m


def _call_schema(tool: dict[str, Any], args_key: str = "arguments") -> dict[str, Any]:
    fn = tool["function"]
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"name": {"type": "string", "const": fn["name"]},
                       args_key: fn["parameters"]},
        "required": ["name", args_key],
        "additionalProperties": False,
    }
    if fn.get("description"):
        schema["description"] = fn["description"]
    return schema


def _one_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def generic_schema(tools: list[dict[str, Any]], parallel: bool, allow_response: bool,
                   response: Any = None) -> dict[str, Any]:
    """llama.cpp's common_chat_params_init_generic schema; objects it builds itself take no
    other keys (llama.cpp's schema converter allows none where the schema names none)."""
    calls = []
    for tool in tools:
        s = _call_schema(tool)
        if parallel:
            s["properties"]["id"] = {"type": "string", "minLength": 4}
            s["required"].append("id")
        calls.append(s)
    if parallel:
        call = {"type": "object", "properties": {"tool_calls": {
            "type": "array", "items": _one_of(calls), "minItems": 1}},
            "required": ["tool_calls"], "additionalProperties": False}
    else:
        call = {"type": "object", "properties": {"tool_call": _one_of(calls)},
                "required": ["tool_call"], "additionalProperties": False}
    if not allow_response:
        return call
    reply = {"type": "string"} if response is None else response
    return {"anyOf": [call, {"type": "object", "properties": {"response": reply},
                             "required": ["response"], "additionalProperties": False}]}


def _call_lark(kind: str, tools: list[dict[str, Any]], parallel: bool, thinking_open: bool
               ) -> str:
    """A grammar forcing the call(s) in the format's own syntax (the prompt left a thought
    open: it must be closed first, or the call would be read as reasoning)."""
    start = '"</think>" ("\\n" | "\\n\\n")? ' if thinking_open else ""
    args_key = "parameters" if kind == "llama3" else "arguments"
    body = json.dumps({**_one_of([_call_schema(t, args_key) for t in tools]),
                       "x-guidance": grammars.JSON_OPTIONS})
    if kind == "llama3":  # one call: Llama 3.1's template cannot write more
        return f"start: {start}body\nbody: %json {body}\n"
    calls = 'call ("\\n" call)*' if parallel else "call"
    return (f"start: {start}{calls}\n"
            'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
            f"body: %json {body}\n")


def _harmony_lark(tools: list[dict[str, Any]], schema: Any) -> str:
    """llama.cpp's gpt-oss grammar: analysis messages (and, before a call, preambles), then
    a final message whose body is the JSON `schema`, else a call to one of `tools` (recipient
    in the role or the channel header) with its arguments. Markup tokens are written as
    special tokens: the model must write them as such."""
    head = (f"start: (pre {END} {START} \"assistant\")* tail\n"
            f"analysis: ({CHANNEL} \"commentary\" \" to=assistant\"?)? {CHANNEL} "
            f"\"analysis\" {MESSAGE} TEXT\n"
            "TEXT: /(.|\\n)*/\n"
            "ctype: \" \" <|constrain|>? CTYPE | <|constrain|> CTYPE\n"
            "CTYPE: /[A-Za-z0-9_-]+/\n")
    if schema is not None:
        return (head + "pre: analysis\n"
                f"tail: {CHANNEL} \"final\" ctype? {MESSAGE} body\n"
                f"body: %json {_guided(schema)}\n")
    lines = [head, f"pre: analysis | {CHANNEL} \"commentary\" {MESSAGE} TEXT\n",
             f"channel: {CHANNEL} (\"commentary\" | \"analysis\")\n",
             "tail: " + " | ".join(f"call{i}" for i in range(len(tools))) + "\n"]
    for i, tool in enumerate(tools):
        fn = tool["function"]
        to = json.dumps(" to=functions." + fn["name"])
        lines.append(f"call{i}: ({to} channel | channel {to}) ctype? {MESSAGE} args{i}\n"
                     f"args{i}: %json {_guided(fn['parameters'])}\n")
    return "".join(lines)


def _guided(schema: Any) -> str:
    return json.dumps({**schema, "x-guidance": grammars.JSON_OPTIONS})
