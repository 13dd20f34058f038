"""Chat formats (text/chat_format.py, chat_caps.py, chat_parse.py): template capabilities from
probe renders, prompts with tools and polyfills, the tools' grammars, and reply parsing, final
and streamed (deltas never taken back, adding up to the final message)."""

from __future__ import annotations

import json
import logging
from typing import Any

import llguidance as llg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.text import grammar as grammars
from radixserve.text.chat_caps import template_caps
from radixserve.text.chat_format import (
    RESPOND_IN_JSON,
    ChatInputs,
    ChatPlan,
    generic_schema,
    plan_chat,
)
from radixserve.text.chat_parse import (
    OutputFormat,
    ParsedMessage,
    ToolCall,
    message_deltas,
    message_json,
)
from radixserve.text.chat_template import ChatTemplate
from radixserve.text.tokenizer import Tokenizer
from tests.text import chat_templates as T

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_abc123", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_abc123", "content": "sunny, 21 C"},
]


def tmpl(source: str) -> ChatTemplate:
    return ChatTemplate(source, "<|begin_of_text|>", "<|im_end|>")


def plan(source: str, messages: list[dict[str, Any]] = ASK, **kw: Any) -> ChatPlan:
    return plan_chat(tmpl(source), ChatInputs(messages, **kw))


@pytest.fixture(scope="module")
def tok(tok_tmpl: tuple[Tokenizer, ChatTemplate]) -> Tokenizer:
    return tok_tmpl[0]


def accepts(grammar: str, tok: Tokenizer, text: str) -> bool:
    """Whether the grammar lets the model write exactly `text`."""
    grammars.check(grammar, tok)
    m = llg.LLMatcher(grammars.ll_tokenizer(tok), grammar, log_level=0)
    for t in tok.encode(text, add_special=False, parse_special=False):
        if not m.consume_token(t):
            return False
    return m.is_accepting()


# ------------------------------------------------------------------ capabilities


@pytest.mark.parametrize("source, expected", [
    (T.SMOLLM2, dict(supports_system_role=True, supports_tools=False, supports_tool_calls=False)),
    (T.QWEN25, dict(supports_tools=True, supports_tool_calls=True, supports_tool_responses=True,
                    supports_parallel_tool_calls=True, requires_object_arguments=True)),
    (T.QWEN3, dict(supports_tools=True, supports_tool_calls=True,
                   supports_parallel_tool_calls=True, requires_object_arguments=False)),
    (T.LLAMA31, dict(supports_tools=True, supports_tool_calls=True, supports_tool_responses=True,
                     supports_parallel_tool_calls=False, requires_object_arguments=True)),
    (T.NO_SYSTEM, dict(supports_system_role=False, supports_tools=False)),
])
def test_capabilities_come_from_probe_renders(source: str, expected: dict[str, bool]) -> None:
    caps = template_caps(tmpl(source))
    assert {k: getattr(caps, k) for k in expected} == expected


def test_a_template_without_tools_gets_a_tool_call_example() -> None:
    example = template_caps(tmpl(T.SMOLLM2)).tool_call_example
    assert json.loads(example) == {"tool_calls": [{
        "name": "tool_name", "arguments": {"arg1": "some_value"}, "id": "call_1___"}]}
    assert template_caps(tmpl(T.QWEN25)).tool_call_example == ""


# ------------------------------------------------------------------ prompts


@pytest.mark.parametrize("source", [T.SMOLLM2, T.QWEN25, T.LLAMA31, T.QWEN3])
def test_without_tools_the_prompt_is_the_template_s(source: str) -> None:
    t = tmpl(source)
    for choice in (None, "none"):
        p = plan_chat(t, ChatInputs(HISTORY[:2], tools=TOOLS if choice else None,
                                    tool_choice=choice, reasoning_format="none"))
        assert p.prompt == t.render(HISTORY[:2]) and p.grammar is None and p.output is None


def test_generic_prompt_describes_the_tools_and_asks_for_json() -> None:
    p = plan(T.SMOLLM2, [{"role": "system", "content": "Be brief."}, *ASK], tools=TOOLS)
    system = p.prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n" + RESPOND_IN_JSON + "\n\n"
                             "You can call any of the following tools to satisfy the user's "
                             "requests: " + json.dumps(
                                 [{"type": "function", "function": {
                                     **WEATHER["function"]}},
                                  {"type": "function", "function": {
                                      "name": "get_time", "description": "",
                                      "parameters": TIME["function"]["parameters"]}}], indent=2))
    assert "Example tool call syntax:\n\n{" in system
    assert p.output == OutputFormat("generic")
    # no system message: one is added first (the template's default one is then not written)
    assert plan(T.SMOLLM2, tools=TOOLS).prompt.startswith("<|im_start|>system\n" + RESPOND_IN_JSON)


def test_generic_history_is_polyfilled() -> None:
    p = plan(T.SMOLLM2, HISTORY, tools=TOOLS, tool_choice="none")
    assert RESPOND_IN_JSON not in p.prompt and "get_time" not in p.prompt
    call = p.prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert call == json.dumps({"tool_calls": [{"name": "get_weather", "arguments": {
        "city": "Paris"}, "id": "call_abc123"}]}, indent=2)
    reply = p.prompt.split("<|im_start|>user\n")[2].split("<|im_end|>")[0]
    assert json.loads(reply) == {"tool_response": {"content": "sunny, 21 C",
                                                   "tool_call_id": "call_abc123"}}


def test_templates_with_tools_render_them_themselves() -> None:
    p = plan(T.QWEN25, HISTORY, tools=TOOLS)
    assert p.output == OutputFormat("hermes") and p.grammar is None  # auto: no grammar
    assert json.dumps(WEATHER) in p.prompt  # the template's own <tools> list
    # arguments given as JSON text reach the template as an object (it needs one)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in p.prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in p.prompt
    p = plan(T.LLAMA31, HISTORY, tools=TOOLS)
    assert p.output == OutputFormat("llama3")
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in p.prompt
    assert "Environment: ipython" in p.prompt and "Today Date: 26 Jul 2024" not in p.prompt


def test_a_template_without_system_role_gets_it_in_the_first_user_message() -> None:
    p = plan(T.NO_SYSTEM, tools=TOOLS)
    assert p.prompt.startswith("<start_of_turn>user\n" + RESPOND_IN_JSON)
    assert p.prompt.count("<start_of_turn>user\n") == 1 and "Weather in Paris?" in p.prompt


def test_bos_eos_and_prefill() -> None:
    t = tmpl(T.LLAMA31)
    p = plan_chat(t, ChatInputs(ASK, tools=TOOLS, bos="<|begin_of_text|>"))
    assert p.prompt.startswith("<|start_header_id|>system")
    p = plan_chat(t, ChatInputs(ASK, tools=TOOLS, prefill='{"name": "get_time"'))
    assert p.prompt.endswith('assistant<|end_header_id|>\n\n{"name": "get_time"')


# ------------------------------------------------------------------ grammars


def test_generic_schema_is_llama_cpp_s() -> None:
    one = {"type": "object", "properties": {
        "name": {"type": "string", "const": "get_weather"},
        "arguments": WEATHER["function"]["parameters"]},
        "required": ["name", "arguments"], "additionalProperties": False,
        "description": "Current weather in a city"}
    call = {"type": "object", "properties": {"tool_call": one}, "required": ["tool_call"],
            "additionalProperties": False}
    assert generic_schema([WEATHER], False, False) == call
    response = {"type": "object", "properties": {"response": {"type": "string"}},
                "required": ["response"], "additionalProperties": False}
    assert generic_schema([WEATHER], False, True) == {"anyOf": [call, response]}
    reply = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert generic_schema([WEATHER], False, True, reply)["anyOf"][1]["properties"] == {
        "response": reply}
    many = generic_schema([WEATHER, TIME], True, False)
    item = many["properties"]["tool_calls"]["items"]["anyOf"][0]
    assert many["properties"]["tool_calls"]["minItems"] == 1 and many["required"] == ["tool_calls"]
    assert item["properties"]["id"] == {"type": "string", "minLength": 4}
    assert item["required"] == ["name", "arguments", "id"]


def test_generic_grammar(tok: Tokenizer) -> None:
    call = '{"tool_call": {"name": "get_time", "arguments": {"city": "Rome"}}}'
    answer = '{"response": "It is sunny."}'
    g = plan(T.SMOLLM2, tools=TOOLS).grammar
    assert g and accepts(g, tok, call) and accepts(g, tok, answer)
    g = plan(T.SMOLLM2, tools=TOOLS, tool_choice="required").grammar
    assert g and accepts(g, tok, call) and not accepts(g, tok, answer)
    g = plan(T.SMOLLM2, tools=TOOLS, tool_choice={"type": "function",
                                                  "function": {"name": "get_weather"}}).grammar
    assert g and not accepts(g, tok, call)
    assert accepts(g, tok, call.replace("get_time", "get_weather"))
    g = plan(T.SMOLLM2, tools=TOOLS, parallel_tool_calls=True).grammar
    assert g and accepts(g, tok, '{"tool_calls": [{"name": "get_time", "arguments": {"city": '
                                 '"Rome"}, "id": "c1234"}]}')
    g = plan(T.SMOLLM2, tools=TOOLS, json_schema={"type": "object", "properties": {
        "n": {"type": "integer"}}, "required": ["n"]}).grammar
    assert g and accepts(g, tok, '{"response": {"n": 3}}') and not accepts(g, tok, answer)


def test_hermes_and_llama3_grammars_force_a_call(tok: Tokenizer) -> None:
    block = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>'
    g = plan(T.QWEN25, tools=TOOLS, tool_choice="required").grammar
    assert g and accepts(g, tok, block) and not accepts(g, tok, "Hello")
    assert not accepts(g, tok, block + "\n" + block)
    g = plan(T.QWEN25, tools=TOOLS, tool_choice="required", parallel_tool_calls=True).grammar
    assert g and accepts(g, tok, block + "\n" + block)
    named = {"type": "function", "function": {"name": "get_weather"}}
    g = plan(T.QWEN25, tools=TOOLS, tool_choice=named, parallel_tool_calls=True).grammar
    assert g and not accepts(g, tok, block)
    g = plan(T.LLAMA31, tools=TOOLS, tool_choice="required").grammar
    assert g and accepts(g, tok, '{"name": "get_time", "parameters": {"city": "Rome"}}')
    assert plan(T.LLAMA31, tools=TOOLS).grammar is None


def test_a_thought_left_open_is_closed_before_a_forced_call(tok: Tokenizer) -> None:
    source = T.QWEN25.replace("'<|im_start|>assistant\\n' }}\n{%- endif %}",
                              "'<|im_start|>assistant\\n<think>\\n' }}\n{%- endif %}")
    p = plan(source, tools=TOOLS, tool_choice="required")
    assert p.prompt.endswith("<think>\n") and p.output is not None and p.output.thinking_open
    block = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert p.grammar and accepts(p.grammar, tok, "</think>\n\n" + block)
    assert not accepts(p.grammar, tok, block)


# ------------------------------------------------------------------ request errors


@pytest.mark.parametrize("fields, message", [
    ({"tools": {"a": 1}}, "Field 'tools': must be an array"),
    ({"tools": [{"type": "retrieval"}]}, "Field 'tools[0]': must be an object of type"),
    ({"tools": [WEATHER, {"type": "function"}]}, "Field 'tools[1]': 'function' must be"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "'function.name' must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "'function.parameters' must be a JSON schema object"),
    ({"tools": TOOLS, "tool_choice": "always"}, "Field 'tool_choice': Invalid tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "Field 'tool_choice': must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "no function named 'nope'"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "'parallel_tool_calls': must be a bool"),
    ({"reasoning_format": "r1"}, "Field 'reasoning_format': Unknown reasoning format: r1"),
    ({"tools": TOOLS, "custom_grammar": True}, "Cannot use custom grammar constraints with"),
])
def test_bad_fields_are_value_errors_naming_them(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        plan(T.SMOLLM2, **fields)


def test_a_custom_grammar_is_fine_without_tools_or_with_tool_choice_none() -> None:
    assert plan(T.SMOLLM2, custom_grammar=True).grammar is None
    assert plan(T.SMOLLM2, tools=TOOLS, tool_choice="none", custom_grammar=True).output is None


# ------------------------------------------------------------------ parsing replies


def parsed(fmt: OutputFormat, text: str, partial: bool = False) -> tuple[str, str, list]:
    m = fmt.parser().parse(text, partial)
    return m.content, m.reasoning_content, [(c.name, c.arguments) for c in m.tool_calls]


HERMES, LLAMA3, GENERIC = OutputFormat("hermes"), OutputFormat("llama3"), OutputFormat("generic")
BLOCK = '<tool_call>\n{"name": "f", "arguments": {"a": [1, "x</b>"]}}\n</tool_call>'


@pytest.mark.parametrize("fmt, text, partial, expected", [
    (HERMES, "Sure. " + BLOCK + "\n" + BLOCK + "\nDone", False,
     ("Sure. Done", "", [("f", '{"a": [1, "x</b>"]}')] * 2)),
    (HERMES, 'Hi <tool_call>{"arguments": {}, "name": "g"}</tool_call>', False,
     ("Hi ", "", [("g", "{}")])),
    (HERMES, "a <tool_call>not json</tool_call> b", False,
     ("a <tool_call>not json</tool_call> b", "", [])),
    (HERMES, "Hi <tool_ca", True, ("Hi ", "", [])),
    (HERMES, "Hi <tool_ca", False, ("Hi <tool_ca", "", [])),
    (HERMES, 'Hi <tool_call>\n{"name": "f", "arguments": {"a": 1', True,
     ("Hi ", "", [("f", '{"a": 1')])),
    (HERMES, 'Hi <tool_call>\n{"arguments": {"a": 1}, "na', True, ("Hi ", "", [])),
    (LLAMA3, '{"name": "f", "parameters": {"x": 1}}', False, ("", "", [("f", '{"x": 1}')])),
    (LLAMA3, '<|python_tag|>{"type": "function", "name": "f", "parameters": {}} ok', False,
     ("ok", "", [("f", "{}")])),
    (LLAMA3, '{"answer": 42}', False, ('{"answer": 42}', "", [])),
    (LLAMA3, '{"answer": 4', True, ("", "", [])),
    (LLAMA3, "The answer is 42.", True, ("The answer is 42.", "", [])),
    (GENERIC, '{"response": "Hi \\"there\\" \\ud83d\\ude00"}', False, ('Hi "there" 😀', "", [])),
    (GENERIC, '{"response": "Hi \\ud83d', True, ("Hi ", "", [])),
    (GENERIC, '{"response": {"n": 3}}', False, ('{"n": 3}', "", [])),
    (GENERIC, '{"tool_call": {"name": "f", "arguments": {"city": "Rome"}}}', False,
     ("", "", [("f", '{"city": "Rome"}')])),
    (GENERIC, '{"tool_call": {"name": "f", "arguments": {"city": "Ro', True,
     ("", "", [("f", '{"city": "Ro')])),
    (GENERIC, '{"tool_calls": [{"name": "f", "arguments": {}}, {"name": "g", "arguments": [1]}]}',
     False, ("", "", [("f", "{}"), ("g", "[1]")])),
    (GENERIC, "plain text", False, ("plain text", "", [])),
    (GENERIC, '{"tool_c', True, ("", "", [])),
    (GENERIC, '{"tool_c', False, ('{"tool_c', "", [])),
])
def test_replies(fmt: OutputFormat, text: str, partial: bool, expected: tuple) -> None:
    assert parsed(fmt, text, partial) == expected


THINKS = OutputFormat("content", "deepseek")


@pytest.mark.parametrize("fmt, text, partial, expected", [
    (THINKS, "<think>\nLet me see.\n</think>\n\nParis.", False, ("Paris.", "Let me see.", [])),
    (THINKS, "<think>\nLet me see", True, ("", "Let me see", [])),
    (THINKS, "<think>\nLet me see.</thi", True, ("", "Let me see.", [])),
    (THINKS, "<think>\nLet me see", False, ("", "Let me see", [])),
    (THINKS, "<thi", True, ("", "", [])),
    (THINKS, "Paris. <think>no</think>", False, ("Paris. <think>no</think>", "", [])),
    (THINKS, "<think>\n\n</think>\n\nParis.", False, ("Paris.", "", [])),
    (OutputFormat("content", "deepseek", thinking_open=True), "Hmm.\n</think>\nParis.", False,
     ("Paris.", "Hmm.", [])),
    (OutputFormat("content", "deepseek-legacy"), "<think> Hmm. </think>\nParis.", False,
     ("<think>Hmm.</think>Paris.", "Hmm.", [])),
    (OutputFormat("hermes", "deepseek"), "<think>call f</think>\n" + BLOCK, False,
     ("", "call f", [("f", '{"a": [1, "x</b>"]}')])),
])
def test_reasoning(fmt: OutputFormat, text: str, partial: bool, expected: tuple) -> None:
    assert parsed(fmt, text, partial) == expected


def test_reasoning_formats_of_a_thinking_template() -> None:
    assert plan(T.QWEN3).output == OutputFormat("content", "deepseek")
    assert plan(T.QWEN3, reasoning_format="deepseek-legacy").output == OutputFormat(
        "content", "deepseek-legacy")
    assert plan(T.QWEN3, reasoning_format="none").output is None
    assert plan(T.QWEN3, parse_output=False).output is None
    assert plan(T.SMOLLM2).output is None  # the template never thinks
    assert plan(T.QWEN3, tools=TOOLS).output == OutputFormat("hermes", "deepseek")
    p = plan(T.THINK_OPEN)
    assert p.prompt.endswith("<think>\n") and p.output == OutputFormat("content", "deepseek", True)
    p = plan(T.THINK_OPEN, variables={"enable_thinking": False})
    assert p.prompt.endswith("<think>\n</think>") and not p.output.thinking_open  # type: ignore


def test_call_ids_are_drawn_once_per_call_and_parser() -> None:
    p = HERMES.parser()
    first = p.parse("x " + BLOCK, partial=True).tool_calls
    final = p.parse("x " + BLOCK + BLOCK).tool_calls
    assert final[0].id == first[0].id and final[1].id != final[0].id
    assert len(final[0].id) >= 9 and final[0].id.isalnum()
    assert HERMES.parser().parse(BLOCK).tool_calls[0].id != final[0].id
    text = '{"tool_calls": [{"name": "f", "arguments": {}, "id": "call_7"}, {"name": "g", "argu'
    ids = OutputFormat("generic", model_ids=True).parser()
    assert [c.id for c in ids.parse(text, partial=True).tool_calls] == ["call_7"]


def test_message_json() -> None:
    call = ToolCall("f", '{"a": 1}', "id123456789")
    assert message_json(ParsedMessage("", "", [call])) == {
        "role": "assistant", "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'},
                        "id": "id123456789"}]}
    assert message_json(ParsedMessage("Hi", "Hmm")) == {
        "role": "assistant", "content": "Hi", "reasoning_content": "Hmm"}


# ------------------------------------------------------------------ streaming


def reassemble(deltas: list[dict[str, Any]]) -> ParsedMessage:
    """What an OpenAI client builds from the deltas."""
    msg = ParsedMessage()
    for d in deltas:
        msg.content += d.get("content", "")
        msg.reasoning_content += d.get("reasoning_content", "")
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(msg.tool_calls):
                msg.tool_calls.append(ToolCall(tc["function"]["name"], "", tc["id"]))
            msg.tool_calls[tc["index"]].arguments += tc["function"]["arguments"]
    return msg


def check_stream(fmt: OutputFormat, text: str) -> ParsedMessage:
    """Every prefix parsed as a stream: the deltas add up to the final message."""
    p, sent, deltas = fmt.parser(), ParsedMessage(), []
    for n in range(len(text) + 1):
        deltas += message_deltas(sent, p.parse(text[:n], partial=True))
    final = p.parse(text)
    deltas += message_deltas(sent, final)
    assert sent == final
    assert reassemble(deltas) == final
    return final


FORMATS = [HERMES, LLAMA3, GENERIC, OutputFormat("generic", model_ids=True), THINKS,
           OutputFormat("hermes", "deepseek-legacy"), OutputFormat("content", "deepseek", True)]
PIECES = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<|python_tag|>", "\n", " ",
          "{", "}", "[", "]", ":", ",", '"name"', '"f"', '"arguments"', '"parameters"', '"id"',
          '"abcd"', '"response"', '"tool_call"', '"tool_calls"', '{"a": 1}', "12", "true",
          '"x\\"y"', '"b\\qd"', "\\u00e9", "\\ud83d", "\\ude00", "\\", "hi", "<", "</"]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.kind}-{f.reasoning}")
@settings(max_examples=150, deadline=None)
@given(text=st.lists(st.sampled_from(PIECES), max_size=16).map("".join))
def test_streamed_deltas_add_up_to_the_final_message(fmt: OutputFormat, text: str) -> None:
    check_stream(fmt, text)


@pytest.mark.parametrize("fmt, text", [
    (HERMES, "Sure. " + BLOCK + "\n" + BLOCK + "\nDone"),
    (HERMES, 'x <tool_call>\n{"name": "f", "arguments": {"a": "b"}, junk}\n</tool_call>'),
    (LLAMA3, '<|python_tag|>{"name": "f", "parameters": {"x": [1, 2.5e3, null]}} ok'),
    (GENERIC, '{"response": "Hi \\"there\\" \\ud83d\\ude00 \\u00e9"}'),
    (GENERIC, '{"tool_calls": [{"name": "f", "arguments": {"a": 1}, "id": "call_1"}]}'),
    (OutputFormat("generic", model_ids=True),
     '{"tool_calls": [{"name": "f", "arguments": {"a": 1}, "id": "call_1"}, {"name": "g", '
     '"arguments": {}, "id": "call_2"}]}'),
    (OutputFormat("hermes", "deepseek"), "<think>\nhmm </thi\n</think>\n\nok " + BLOCK),
])
def test_streamed_replies(fmt: OutputFormat, text: str, caplog: pytest.LogCaptureFixture
                          ) -> None:
    with caplog.at_level(logging.WARNING):
        check_stream(fmt, text)
    assert not caplog.records


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-999, 999) | st.floats(allow_nan=False,
                                                                  allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=6)


@st.composite
def replies(draw: st.DrawFn) -> tuple[OutputFormat, str, str, str]:
    """(format, reply, the call's name, its arguments' text) for a reply with one call."""
    args = json.dumps(draw(st.dictionaries(st.text(max_size=4), _json_values, max_size=3)),
                      indent=draw(st.sampled_from([None, 2])),
                      ensure_ascii=draw(st.booleans()))
    name = draw(st.sampled_from(["get_weather", "f"]))
    before, after = draw(st.text(max_size=8)), draw(st.text(max_size=8))
    kind = draw(st.sampled_from(["hermes", "llama3", "generic"]))
    if kind == "hermes":
        text = (f'{before}<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n'
                f"</tool_call>{after}")
    elif kind == "llama3":
        text = f'<|python_tag|>{{"name": "{name}", "parameters": {args}}} {after}'
    else:
        text = f'{{"tool_call": {{"name": "{name}", "arguments": {args}}}}}'
    return OutputFormat(kind), text, name, args


@settings(max_examples=300, deadline=None)
@given(reply=replies(), cut=st.floats(0, 1))
def test_streamed_calls_add_up_to_the_final_call(reply: tuple, cut: float) -> None:
    fmt, text, name, args = reply
    final = check_stream(fmt, text)
    assert [(c.name, c.arguments) for c in final.tool_calls] == [(name, args)]
    check_stream(fmt, text[: int(len(text) * cut)])  # cut short (max_tokens)


@settings(max_examples=400, deadline=None)
@given(body=st.lists(st.sampled_from(["a", "é", "\\", "\\\\", '\\"', "\\n", "\\u", "\\ud83d",
                                      "\\ude00", "\\u00e9", "\\uD8", "0", "f", "\\x", '"']),
                     max_size=12).map("".join))
def test_the_fast_string_decode_is_the_reference_s(body: str) -> None:
    from radixserve.text.partial_json import decode_string, string_prefix
    text = '"' + body
    for n in range(1, len(text) + 1):
        for final in (False, True):
            assert string_prefix(text[:n], 0, final) == decode_string(text[:n], 0, final)
