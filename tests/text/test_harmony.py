"""gpt-oss's harmony chat format (text/chat_format.py, chat_parse.py, tokenizer.py): the format
chosen from the real template, its prompt-side adjustments, its grammars, the end-of-generation
tokens of its vocabulary, and its replies parsed, final and streamed."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.text.chat_format import ChatInputs, ChatPlan, plan_chat
from radixserve.text.chat_parse import OutputFormat, ParsedMessage
from radixserve.text.chat_template import ChatTemplate
from radixserve.text.tokenizer import CONTROL, USER_DEFINED, Tokenizer
from tests.text.test_chat_format import accepts, check_stream
from tests.text.test_tokenizer import bpe_vocab

GPT_OSS = (Path(__file__).parents[1] / "fixtures" / "openai-gpt-oss-120b.jinja").read_text()
MARKUP = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>",
          "<|call|>"]

SPECIAL = {"type": "function", "function": {
    "name": "special_function", "description": "I'm special",
    "parameters": {"type": "object", "properties": {"arg1": {"type": "integer"}},
                   "required": ["arg1"]}}}
EDIT = {"type": "function", "function": {
    "name": "edit", "description": "Edit a file", "parameters": {
        "type": "object", "properties": {
            "oldString": {"type": "string"}, "newString": {"type": "string"},
            "replaceAll": {"type": "boolean"}},
        "required": ["oldString", "newString"]}}}
ASK = [{"role": "user", "content": "Hey"}]


def plan(messages: list[dict[str, Any]] = ASK, **kw: Any) -> ChatPlan:
    return plan_chat(ChatTemplate(GPT_OSS, "<|startoftext|>", "<|return|>"),
                     ChatInputs(messages, **kw))


def parsed(fmt: OutputFormat, text: str, partial: bool = False) -> tuple[str, str, list]:
    m = fmt.parser().parse(text, partial)
    return m.content, m.reasoning_content, [(c.name, c.arguments) for c in m.tool_calls]


HARMONY = OutputFormat("harmony", "deepseek")
NO_REASONING = OutputFormat("harmony", "none")
TOOLS = OutputFormat("harmony", "deepseek", tools=True)
HELLO = "Hello, world!\nWhat's up?"
THOUGHT = "<|channel|>analysis<|message|>I'm\nthinking<|end|>"
CALL = [("special_function", '{"arg1": 1}')]

# llama-server's own gpt-oss parsing examples (its chat tests; the text after the generation
# prompt `<|start|>assistant`): (format, reply, content, reasoning, calls)
LLAMA_SERVER = [
    (HARMONY, "<|channel|>final<|message|>" + HELLO, HELLO, "", []),
    (HARMONY, "<|channel|>commentary<|message|>" + HELLO, HELLO, "", []),
    (HARMONY, THOUGHT + "<|start|>assistant<|channel|>final<|message|>" + HELLO,
     HELLO, "I'm\nthinking", []),
    (NO_REASONING, THOUGHT + "<|start|>assistant<|channel|>final<|message|>" + HELLO,
     THOUGHT + HELLO, "", []),
    (TOOLS, ' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}',
     "", "", CALL),
    (TOOLS, '<|channel|>analysis to=functions.special_function<|message|>{"arg1": 1}',
     "", "", CALL),
    (TOOLS, ' to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>'
     '{"arg1": 1}', "", "", CALL),
    (TOOLS, '<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}',
     "", "", CALL),
    (TOOLS, THOUGHT + '<|start|>assistant to=functions.special_function<|channel|>analysis'
     '<|message|>{"arg1": 1}', "", "I'm\nthinking", CALL),
    (TOOLS, "<|channel|>analysis<|message|>Thinking about edit...<|end|><|start|>assistant"
     "<|channel|>commentary to=functions.edit <|constrain|>json<|message|>"
     '{"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {", '
     '"replaceAll": false}', "", "Thinking about edit...",
     [("edit", '{"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {", '
       '"replaceAll": false}')]),
    (HARMONY, "<|channel|>analysis<|message|>I need to output the invoice details in JSON"
     "<|end|><|start|>assistant<|channel|>final <|constrain|>json<|message|>"
     '{"amount": 123.45, "date": "2025-12-03"}', '{"amount": 123.45, "date": "2025-12-03"}',
     "I need to output the invoice details in JSON", []),
    # unsolicited calls (builtin tools) are consumed: no content
    (HARMONY, "<|channel|>analysis<|message|>I will execute python to say hello<|end|>"
     "<|start|>assistant to=container.exec<|channel|>commentary<|message|>"
     "python3 -c 'print(\"hello\")'", "", "I will execute python to say hello", []),
    (HARMONY, "<|channel|>analysis<|message|>I will execute python to say hello<|end|>"
     "<|start|>assistant<|channel|>commentary to=python <|constrain|>code<|message|>"
     'print("hello")', "", "I will execute python to say hello", []),
    # a stray `<|channel|>commentary to=assistant` before the analysis or the final message
    (HARMONY, "<|channel|>commentary to=assistant" + THOUGHT
     + "<|start|>assistant<|channel|>final<|message|>" + HELLO, HELLO, "I'm\nthinking", []),
    (HARMONY, THOUGHT + "<|start|>assistant<|channel|>commentary to=assistant"
     "<|channel|>final<|message|>" + HELLO, HELLO, "I'm\nthinking", []),
]


@pytest.mark.parametrize("fmt, text, content, reasoning, calls", LLAMA_SERVER)
def test_llama_server_examples(fmt: OutputFormat, text: str, content: str, reasoning: str,
                               calls: list, caplog: pytest.LogCaptureFixture) -> None:
    assert parsed(fmt, text) == (content, reasoning, calls)
    with caplog.at_level(logging.WARNING):
        check_stream(fmt, text)
    assert not caplog.records


def test_an_unfinished_analysis_is_reasoning() -> None:
    text = "<|channel|>analysis<|message|>I'm\nthinking"
    assert parsed(HARMONY, text, partial=True) == ("", "I'm\nthinking", [])
    assert parsed(HARMONY, text) == ("", "I'm\nthinking", [])


@pytest.mark.parametrize("fmt, text, partial, expected", [
    # a tag still being written is held back; the final parse gives it as written
    (HARMONY, "<|channel|>analysis<|message|>hmm<|en", True, ("", "hmm", [])),
    (HARMONY, "<|channel|>analysis<|message|>hmm<|en", False, ("", "hmm<|en", [])),
    (HARMONY, THOUGHT + "<|start|>assist", True, ("", "I'm\nthinking", [])),
    # a header the reply ends in is dropped (as llama.cpp's lenient parse)
    (HARMONY, THOUGHT + "<|start|>assistant<|channel|>fin", False, ("", "I'm\nthinking", [])),
    (HARMONY, "<|channel|>final<|message|>Hi<|end|>", False, ("Hi", "", [])),
    # several analysis messages are one reasoning; a whitespace-only one is none
    (HARMONY, THOUGHT + "<|start|>assistant<|channel|>analysis<|message|> more<|end|>"
     "<|start|>assistant<|channel|>final<|message|>ok", False, ("ok", "I'm\nthinking more", [])),
    (HARMONY, "<|channel|>analysis<|message|> \n<|end|><|start|>assistant<|channel|>final"
     "<|message|>ok", False, ("ok", "", [])),
    # a preamble, then a call
    (TOOLS, "<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant"
     '<|channel|>commentary to=functions.special_function json<|message|>{"arg1": 1}',
     False, ("Let me look.", "", CALL)),
    (TOOLS, ' to=functions.special_function<|channel|>commentary json<|message|>{"arg1": ',
     True, ("", "", [("special_function", '{"arg1":')])),
    # without tools (or with tool_choice none), calls are unsolicited: dropped
    (HARMONY, '<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}',
     False, ("", "", [])),
    # text that is no harmony markup stays content
    (HARMONY, "Hello there", True, ("Hello there", "", [])),
    (HARMONY, "<|channel|>final junk words<|message|>x", False,
     ("<|channel|>final junk words<|message|>x", "", [])),
    (HARMONY, THOUGHT + "The answer", False, ("The answer", "I'm\nthinking", [])),
    # deepseek-legacy reads as the default (llama.cpp's gpt-oss parser only tells none apart)
    (OutputFormat("harmony", "deepseek-legacy"), THOUGHT, False, ("", "I'm\nthinking", [])),
    # a prefill: the reply continues the final message
    (OutputFormat("harmony", "deepseek", final_open=True), "world!", False, ("world!", "", [])),
])
def test_replies(fmt: OutputFormat, text: str, partial: bool, expected: tuple) -> None:
    assert parsed(fmt, text, partial) == expected


def test_every_prefix_extends_the_previous_parse() -> None:
    for fmt, text, *_ in LLAMA_SERVER:
        p, prev = fmt.parser(), ParsedMessage()
        for n in range(len(text) + 1):
            cur = p.parse(text[:n], partial=True)
            assert cur.content.startswith(prev.content)
            assert cur.reasoning_content.startswith(prev.reasoning_content)
            assert len(cur.tool_calls) >= len(prev.tool_calls)
            for old, new in zip(prev.tool_calls, cur.tool_calls):
                assert (new.name, new.id) == (old.name, old.id)
                assert new.arguments.startswith(old.arguments)
            prev = cur


PIECES = [*MARKUP, "assistant", "analysis", "final", "commentary", " to=functions.f",
          " to=assistant", " to=python", " json", "json", "{", "}", '"a"', ": ", "1", " ", "\n",
          "hi", "<", "<|", "|>", "en"]


@pytest.mark.parametrize("fmt", [HARMONY, NO_REASONING, TOOLS,
                                 OutputFormat("harmony", "deepseek", final_open=True)],
                         ids=["harmony", "none", "tools", "final_open"])
@settings(max_examples=200, deadline=None)
@given(text=st.lists(st.sampled_from(PIECES), max_size=16).map("".join))
def test_streamed_deltas_add_up_to_the_final_message(fmt: OutputFormat, text: str) -> None:
    check_stream(fmt, text)


# ------------------------------------------------------------------ format and prompt


def test_the_gpt_oss_template_chooses_harmony() -> None:
    p = plan()
    assert p.prompt.endswith("<|start|>user<|message|>Hey<|end|><|start|>assistant")
    assert p.output == OutputFormat("harmony", "deepseek") and p.grammar is None
    assert plan(reasoning_format="none").output == NO_REASONING
    assert plan(tools=[SPECIAL]).output == TOOLS
    assert "type special_function = (_: {" in plan(tools=[SPECIAL]).prompt
    assert plan(tools=[SPECIAL], tool_choice="none").output == HARMONY
    assert plan(parse_output=False).output is None


def test_reasoning_is_the_template_s_thinking() -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "special_function", "arguments": '{"arg1": 1}'}}
    history = [*ASK, {"role": "assistant", "content": "unused", "reasoning_content": "Use it.",
                      "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    p = plan(history, tools=[SPECIAL])
    assert ("<|start|>assistant<|channel|>analysis<|message|>Use it.<|end|>"
            "<|start|>assistant to=functions.special_function<|channel|>commentary json"
            '<|message|>{"arg1": 1}<|call|>') in p.prompt
    assert "unused" not in p.prompt  # the content of a message with calls is dropped
    p = plan([*ASK, {"role": "assistant", "content": "Hi", "reasoning_content": "Greet."}],
             add_generation_prompt=False)
    # the final message ends with <|end|>, not <|return|>, when no generation prompt follows
    assert p.prompt.endswith("<|start|>assistant<|channel|>analysis<|message|>Greet.<|end|>"
                             "<|start|>assistant<|channel|>final<|message|>Hi<|end|>")


def test_a_prefill_continues_a_final_message() -> None:
    p = plan(ASK, prefill="Hello, ")
    assert p.prompt.endswith("<|start|>assistant<|channel|>final<|message|>Hello, ")
    assert p.output is not None and p.output.final_open and p.prefill == "Hello, "


# ------------------------------------------------------------------ grammars and vocabulary


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """A byte-level vocabulary with gpt-oss's markup tokens (all CONTROL in its GGUF)."""
    return Tokenizer(bpe_vocab(extra=[(t, CONTROL) for t in MARKUP]))




def test_end_is_no_end_of_generation_when_return_and_call_are(tok: Tokenizer) -> None:
    ids = {t: tok.encode(t, add_special=False)[0] for t in MARKUP}
    assert tok.eog_ids == {ids["<|return|>"], ids["<|call|>"]}
    for t in ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>"):
        assert tok.token_type(ids[t]) == USER_DEFINED  # always rendered and parsed
        assert tok.token_to_piece(ids[t], special=False) == t.encode()
    assert tok.token_to_piece(ids["<|return|>"], special=False) == b""
    # without <|return|> and <|call|>, <|end|> ends generation as before
    other = Tokenizer(bpe_vocab(extra=[("<|channel|>", CONTROL), ("<|end|>", CONTROL)]))
    channel, end = other.n_vocab - 2, other.n_vocab - 1
    assert other.is_eog(end) and other.token_type(end) == CONTROL
    assert other.token_type(channel) == USER_DEFINED


def test_a_required_call_is_forced_in_either_placement(tok: Tokenizer) -> None:
    g = plan(tools=[SPECIAL, EDIT], tool_choice="required").grammar
    for text in (' to=functions.special_function<|channel|>commentary json<|message|>'
                 '{"arg1": 1}',
                 '<|channel|>commentary to=functions.special_function <|constrain|>json'
                 '<|message|>{"arg1": 1}',
                 THOUGHT + '<|start|>assistant<|channel|>commentary<|message|>On it.<|end|>'
                 '<|start|>assistant to=functions.special_function<|channel|>analysis'
                 '<|message|>{"arg1": 1}'):
        assert accepts(g, tok, text), text
    assert not accepts(g, tok, "<|channel|>final<|message|>Hi")
    assert not accepts(g, tok, ' to=functions.special_function<|channel|>commentary'
                               '<|message|>{"arg1": "x"}')  # the schema holds
    named = plan(tools=[SPECIAL, EDIT],
                 tool_choice={"type": "function", "function": {"name": "edit"}}).grammar
    assert not accepts(named, tok, ' to=functions.special_function<|channel|>commentary'
                                   '<|message|>{"arg1": 1}')
    assert accepts(named, tok, ' to=functions.edit<|channel|>commentary<|message|>'
                               '{"oldString": "a", "newString": "b"}')
    assert plan(tools=[SPECIAL]).grammar is None  # auto: free, parsed as it comes


def test_a_json_schema_is_the_final_message(tok: Tokenizer) -> None:
    schema = {"type": "object", "properties": {"amount": {"type": "number"}},
              "required": ["amount"]}
    p = plan(json_schema=schema, tools=[SPECIAL])
    assert p.output == HARMONY  # the schema wins over the tools, as in llama.cpp
    assert accepts(p.grammar, tok, "<|channel|>analysis<|message|>I need JSON<|end|>"
                                   "<|start|>assistant<|channel|>final <|constrain|>json"
                                   '<|message|>{"amount": 123.45}')
    assert accepts(p.grammar, tok, '<|channel|>final<|message|>{"amount": 1}')
    assert not accepts(p.grammar, tok, '{"amount": 1}')
    assert not accepts(p.grammar, tok, '<|channel|>final<|message|>{"total": 1}')
    with pytest.raises(ValueError, match="Cannot use both json_schema and grammar"):
        plan(json_schema=schema, custom_grammar=True)

