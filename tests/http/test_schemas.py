"""Request validation and parsing into CompletionTask (schemas.py + parse.py), no engine.

Uses the real tokenizer and chat template of the tiny GGUF (copied from the default model).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.errors import TaskError
from radixserve.http.parse import (
    INT32_MAX,
    ParseContext,
    ParsedRequest,
    parse_chat,
    parse_completion,
)
from radixserve.text.chat_template import ChatTemplate
from radixserve.text.tokenizer import Tokenizer

N_CTX = 64


@pytest.fixture
def tok(tok_tmpl: tuple[Tokenizer, ChatTemplate]) -> Tokenizer:
    return tok_tmpl[0]


@pytest.fixture
def ctx(tok_tmpl: tuple[Tokenizer, ChatTemplate]) -> ParseContext:
    return ParseContext(tok_tmpl[0], tok_tmpl[1], n_ctx_slot=N_CTX, n_slots=2)


@pytest.fixture
def bos_tok(tok: Tokenizer) -> Tokenizer:
    """The same vocabulary with add_bos on (SmolLM2 does not add BOS; Llama models do)."""
    t = copy.copy(tok)
    t.add_bos = True
    return t


def cmpl(ctx: ParseContext, **body: Any) -> ParsedRequest:
    body.setdefault("prompt", "Hello")
    return parse_completion(body, ctx)


def chat(ctx: ParseContext, **body: Any) -> ParsedRequest:
    body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    return parse_chat(body, ctx)


def error_of(fn: Any, *args: Any, **kw: Any) -> TaskError:
    with pytest.raises(TaskError) as ei:
        fn(*args, **kw)
    return ei.value


def bad_request(fn: Any, *args: Any, **kw: Any) -> str:
    e = error_of(fn, *args, **kw)
    assert (e.status, e.type) == (400, "invalid_request_error")
    return e.message


# ---- prompt forms ---------------------------------------------------------------------------


def test_string_prompt_is_tokenized_with_specials(ctx: ParseContext, tok: Tokenizer) -> None:
    text = "Hello <|im_start|>world"
    assert cmpl(ctx, prompt=text).task.prompt_tokens == tok.encode(text)
    assert 1 in cmpl(ctx, prompt=text).task.prompt_tokens  # <|im_start|> parsed as special


def test_token_array_prompt_is_used_as_is(ctx: ParseContext) -> None:
    assert cmpl(ctx, prompt=[5, 6, 7]).task.prompt_tokens == [5, 6, 7]


def test_mixed_prompt(ctx: ParseContext, tok: Tokenizer) -> None:
    got = cmpl(ctx, prompt=["Hello", 5, " world"]).task.prompt_tokens
    assert got == tok.encode("Hello") + [5] + tok.encode(" world", add_special=False)


def test_one_element_lists_and_prompt_object(ctx: ParseContext, tok: Tokenizer) -> None:
    assert cmpl(ctx, prompt=["Hello"]).task.prompt_tokens == tok.encode("Hello")
    assert cmpl(ctx, prompt=[[5, 6]]).task.prompt_tokens == [5, 6]
    assert cmpl(ctx, prompt={"prompt_string": "Hello"}).task.prompt_tokens == tok.encode("Hello")


@pytest.mark.parametrize("prompt", [["a", "b"], [[1, 2], [3]], [{"prompt_string": "a"}] * 2])
def test_multiple_prompts_are_one_task_each(ctx: ParseContext, prompt: Any,
                                            tok: Tokenizer) -> None:
    r = cmpl(ctx, prompt=prompt)
    assert [t.index for t in r.tasks] == [0, 1] and r.task is r.tasks[0]
    want = [cmpl(ctx, prompt=p).task.prompt_tokens for p in prompt]
    assert [t.prompt_tokens for t in r.tasks] == want
    assert all(t.parent is None and t.n_cmpl == 1 for t in r.tasks)


def test_n_cmpl_children_follow_their_prompt_with_llama_server_seeds(ctx: ParseContext) -> None:
    r = cmpl(ctx, prompt=[[1, 2], [3, 4]], n=2, seed=7, id_slot=1)
    assert [t.index for t in r.tasks] == [0, 1, 2, 3]
    p0, c0, p1, c1 = r.tasks
    assert c0.parent is p0 and c1.parent is p1 and p0.parent is None and p1.parent is None
    assert [t.prompt_tokens for t in r.tasks] == [[1, 2], [1, 2], [3, 4], [3, 4]]
    assert [t.params.seed for t in r.tasks] == [7, 8, 7, 8]  # server-task.h add_child
    assert [t.id_slot for t in r.tasks] == [1, -1, 1, -1]  # children cannot pick a slot
    assert all(t.n_cmpl == 2 for t in r.tasks)
    assert cmpl(ctx, prompt="a", n_cmpl=2, n=1, seed=0xFFFFFFFE).tasks[1].params.seed == 0xFFFFFFFF
    assert [t.params.seed for t in cmpl(ctx, prompt="a", n=2).tasks] == [-1, -1]


def test_context_and_limit_fields(ctx: ParseContext) -> None:
    t = cmpl(ctx, prompt="a", n_keep=-1, n_discard=5, n_indent=2, t_max_predict_ms=30).task
    assert (t.n_keep, t.n_discard, t.n_indent, t.t_max_predict_ms) == (-1, 5, 2, 30)
    t = cmpl(ctx, prompt="a").task
    assert (t.n_keep, t.n_discard, t.n_indent, t.t_max_predict_ms) == (0, 0, 0, -1)
    ctx.defaults = dataclasses.replace(ctx.defaults, n_keep=9)
    assert cmpl(ctx, prompt="a").task.n_keep == 9
    assert cmpl(ctx, prompt="a", response_fields=["content", "a/b"]).response_fields == [
        "content", "a/b"]
    assert cmpl(ctx, prompt="a", response_fields="content").response_fields == []


def test_bos_rules_when_the_vocab_adds_bos(ctx: ParseContext, bos_tok: Tokenizer) -> None:
    ctx.tokenizer = bos_tok
    bos = bos_tok.bos_id
    assert cmpl(ctx, prompt="Hi").task.prompt_tokens[0] == bos
    assert cmpl(ctx, prompt="").task.prompt_tokens == [bos]  # "" -> [BOS], processed normally
    assert cmpl(ctx, prompt=[5, 6]).task.prompt_tokens == [5, 6]
    assert cmpl(ctx, prompt=[5, "Hi"]).task.prompt_tokens[0] == 5  # first element not a string
    assert cmpl(ctx, prompt=["Hi", 5]).task.prompt_tokens[0] == bos


@pytest.mark.parametrize("prompt", ["", [], [[]]])
def test_empty_prompt_is_400(ctx: ParseContext, prompt: Any) -> None:
    assert bad_request(cmpl, ctx, prompt=prompt) == '"prompt" must not be empty'


def test_missing_or_null_prompt_is_400(ctx: ParseContext) -> None:
    assert bad_request(parse_completion, {}, ctx) == '"prompt" is required'
    assert bad_request(parse_completion, {"prompt": None}, ctx) == '"prompt" is required'


@pytest.mark.parametrize("prompt", [5, 1.5, True, [1, 2.5], [1, None], ["a", {"x": 1}]])
def test_malformed_prompt_types_are_400(ctx: ParseContext, prompt: Any) -> None:
    assert "prompt" in bad_request(cmpl, ctx, prompt=prompt)


@pytest.mark.parametrize("bad", [-1, 10**9])
def test_out_of_vocab_tokens_are_400(ctx: ParseContext, bad: int) -> None:
    assert bad_request(cmpl, ctx, prompt=[1, bad]) == "Prompt contains invalid tokens"
    assert (
        bad_request(cmpl, ctx, prompt=[ctx.tokenizer.n_vocab]) == "Prompt contains invalid tokens"
    )


def test_prompt_longer_than_slot_context(ctx: ParseContext) -> None:
    assert len(cmpl(ctx, prompt=[5] * (N_CTX - 1)).task.prompt_tokens) == N_CTX - 1
    e = error_of(cmpl, ctx, prompt=[5] * 100)
    assert (e.status, e.type) == (400, "exceed_context_size_error")
    assert e.message == (
        "request (100 tokens) exceeds the available context size (64 tokens), try increasing it"
    )
    assert e.to_json()["error"]["n_prompt_tokens"] == 100
    assert e.to_json()["error"]["n_ctx"] == N_CTX
    assert error_of(cmpl, ctx, prompt=[5] * N_CTX).extra == {"n_prompt_tokens": 64, "n_ctx": 64}


# ---- n_predict and friends ------------------------------------------------------------------


def test_n_predict_aliases_and_precedence(ctx: ParseContext) -> None:
    assert cmpl(ctx).task.n_predict == -1
    assert cmpl(ctx, n_predict=7).task.n_predict == 7
    assert cmpl(ctx, max_tokens=8).task.n_predict == 8
    assert cmpl(ctx, max_completion_tokens=9).task.n_predict == 9
    assert cmpl(ctx, n_predict=7, max_tokens=8).task.n_predict == 7
    assert cmpl(ctx, n_predict=None, max_tokens=8).task.n_predict == 8  # null == absent
    assert cmpl(ctx, n_predict=5.0).task.n_predict == 5
    assert chat(ctx, max_completion_tokens=3).task.n_predict == 3


def test_huge_n_predict_is_accepted_and_capped_to_int32(ctx: ParseContext) -> None:
    assert cmpl(ctx, max_tokens=10**12).task.n_predict == INT32_MAX
    assert cmpl(ctx, n_predict=2**31 - 1).task.n_predict == INT32_MAX


@pytest.mark.parametrize("field", ["n_predict", "max_tokens", "max_completion_tokens"])
def test_negative_n_predict_other_than_minus_one_is_400(ctx: ParseContext, field: str) -> None:
    assert cmpl(ctx, **{field: -1}).task.n_predict == -1
    msg = bad_request(cmpl, ctx, **{field: -2})
    assert msg == f"Field '{field}': Value must be >= -1, but got -2"


@pytest.mark.parametrize("value", ["64", 6.5, True, [1], {"a": 1}])
def test_n_predict_must_be_an_integer(ctx: ParseContext, value: Any) -> None:
    assert bad_request(cmpl, ctx, max_tokens=value).startswith(
        "Field 'max_tokens': Value must be an integer"
    )


def test_server_n_predict_caps_requests(ctx: ParseContext) -> None:
    ctx.defaults = dataclasses.replace(ctx.defaults, n_predict=16)
    assert cmpl(ctx).task.n_predict == 16
    assert cmpl(ctx, n_predict=-1).task.n_predict == 16
    assert cmpl(ctx, n_predict=100).task.n_predict == 16
    assert cmpl(ctx, n_predict=4).task.n_predict == 4


# ---- other fields ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("temperature", "hot", "Field 'temperature': Value must be a finite number"),
        ("temperature", float("nan"), "Field 'temperature': Value must be a finite number"),
        ("top_k", 1.5, "Field 'top_k': Value must be an integer"),
        ("id_slot", "1", "Field 'id_slot': Value must be an integer"),
        ("id_slot", 5, "Field 'id_slot': Value must be between -1 <= value <= 1, but got 5"),
        ("id_slot", -2, "Field 'id_slot': Value must be between -1 <= value <= 1"),
        ("cache_prompt", "yes", "Field 'cache_prompt': Value must be a boolean"),
        ("stream", 1, "Field 'stream': Value must be a boolean"),
        ("stop", 5, "Field 'stop': Value must be a string or a list of strings"),
        ("stop", ["a", 1], "Field 'stop': Value must be a string or a list of strings"),
        (
            "stream_options",
            {"include_usage": "x"},
            "Field 'stream_options.include_usage': Value must be a boolean",
        ),
        ("stream_options", 3, "Field 'stream_options': Input should be a valid dictionary"),
        ("n_cache_reuse", -1, "Field 'n_cache_reuse': Value must be >= 0, but got -1"),
        ("n_probs", 101, "Field 'n_probs': Value must be between 0 <= value <= 100"),
        ("logprobs", -1, "Field 'logprobs': Value must be between 0 <= value <= 100"),
        ("seed", -5, "Field 'seed': Value must be between -1 <= value"),
        ("repeat_last_n", -1, "Field 'repeat_last_n': Value must be between 0 <= value"),
        ("repeat_penalty", 0, "Field 'repeat_penalty': Value must be > 0"),
        ("n", 3, "Field 'n': Value must be between 1 <= value <= 2, but got 3"),
        ("n_cmpl", 0, "Field 'n_cmpl': Value must be between 1 <= value <= 2, but got 0"),
        ("n_keep", -2, "Field 'n_keep': Value must be between -1 <= value"),
        ("n_discard", -1, "Field 'n_discard': Value must be between 0 <= value"),
        ("n_indent", -1, "Field 'n_indent': Value must be between 0 <= value"),
        ("t_max_predict_ms", -2, "Field 't_max_predict_ms': Value must be between -1 <= value"),
        ("grammar", "root ::= x", "Field 'grammar': invalid grammar"),
        ("json_schema", {"type": "objekt"}, "Field 'json_schema': invalid JSON schema"),
        ("response_format", {"type": "xml"}, "response_format type must be one of"),
    ],
)
def test_field_errors_name_the_field(
    ctx: ParseContext, field: str, value: Any, expected: str
) -> None:
    assert bad_request(cmpl, ctx, **{field: value}).startswith(expected)


def test_body_must_be_an_object(ctx: ParseContext) -> None:
    assert bad_request(parse_completion, [1, 2], ctx).startswith(
        "request body must be a JSON object"
    )
    assert bad_request(parse_chat, "hi", ctx).startswith("request body must be a JSON object")


def test_fields_reach_the_task(ctx: ParseContext) -> None:
    r = cmpl(
        ctx,
        temperature=0,
        top_k=5,
        top_p=0.5,
        min_p=0.1,
        repeat_penalty=1.1,
        repeat_last_n=32,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        seed=42,
        n_probs=3,
        stop="\n",
        id_slot=1,
        cache_prompt=False,
        n_cache_reuse=256,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
        return_tokens=True,
        post_sampling_probs=True,
        n=1,
        logit_bias={},
        response_format={"type": "text"},
        unknown_field="ignored",
    )
    t, p = r.task, r.task.params
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.0, 5, 0.5, 0.1)
    assert (p.repeat_penalty, p.repeat_last_n, p.seed, p.n_probs) == (1.1, 32, 42, 3)
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, 0.25)
    assert (t.stop, t.id_slot, t.cache_prompt, t.n_cache_reuse) == (["\n"], 1, False, 256)
    assert (t.ignore_eos, t.n_probs) == (True, 3)
    assert (r.stream, r.include_usage, r.return_tokens, r.post_sampling_probs) == (
        True,
        True,
        True,
        True,
    )


def test_defaults(ctx: ParseContext) -> None:
    r = cmpl(ctx)
    t = r.task
    assert (t.id_slot, t.cache_prompt, t.n_cache_reuse, t.ignore_eos, t.n_probs) == (
        -1,
        True,
        None,
        False,
        0,
    )
    assert t.params.seed == -1 and t.params.temperature == 0.8 and t.stop == []
    assert (r.stream, r.include_usage, r.return_tokens) == (False, False, False)
    ctx.defaults = dataclasses.replace(ctx.defaults, cache_prompt=False, seed=7)
    assert cmpl(ctx).task.cache_prompt is False and cmpl(ctx).task.params.seed == 7


def test_soft_limits_are_clamped(ctx: ParseContext) -> None:
    p = cmpl(ctx, top_k=-5, top_p=1.5, min_p=-0.1, temperature=-1).task.params
    assert (p.top_k, p.top_p, p.min_p, p.temperature) == (0, 1.0, 0.0, 0.0)


def test_huge_windows_are_capped(ctx: ParseContext) -> None:
    """A Python int this big would overflow the sampler's deque / torch.topk."""
    p = cmpl(ctx, repeat_last_n=2**70, top_k=2**70).task.params
    assert p.repeat_last_n == INT32_MAX and p.top_k == INT32_MAX


def test_seed_conventions(ctx: ParseContext) -> None:
    assert cmpl(ctx, seed=0xFFFFFFFF).task.params.seed == -1  # llama.cpp's "random"
    assert cmpl(ctx, seed=-1).task.params.seed == -1
    assert cmpl(ctx, seed=0).task.params.seed == 0


def test_stop_forms(ctx: ParseContext) -> None:
    assert cmpl(ctx, stop="x").task.stop == ["x"]
    assert cmpl(ctx, stop=["a", "", "b"]).task.stop == ["a", "b"]
    assert cmpl(ctx, stop=[]).task.stop == []


def test_completion_logprobs_alias(ctx: ParseContext) -> None:
    assert cmpl(ctx, logprobs=3).task.n_probs == 3
    assert cmpl(ctx, logprobs=3, n_probs=2).task.n_probs == 2


# ---- chat -----------------------------------------------------------------------------------


def test_chat_prompt_is_the_rendered_template(ctx: ParseContext, tok: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = ctx.chat_template.render(msgs, add_generation_prompt=True)
    assert chat(ctx, messages=msgs).task.prompt_tokens == tok.encode(text)
    assert text.endswith("<|im_start|>assistant\n")


def test_chat_content_parts_equal_string_content(ctx: ParseContext) -> None:
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    a = chat(ctx, messages=[{"role": "user", "content": parts}]).task.prompt_tokens
    b = chat(ctx, messages=[{"role": "user", "content": "Hi\nthere"}]).task.prompt_tokens
    assert a == b


@pytest.mark.parametrize("role", ["developer", "tool", "assistant", "system"])
def test_chat_known_roles(ctx: ParseContext, role: str) -> None:
    msgs = [
        {"role": "user", "content": "a"},
        {"role": role, "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert chat(ctx, messages=msgs).task.prompt_tokens


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([{"role": "wizard", "content": "x"}], "Field 'messages[0].role': unknown role 'wizard'"),
        ([{"role": 5, "content": "x"}], "Field 'messages[0].role': Value must be a string"),
        ([{"content": "x"}], "Field 'messages[0].role' is required"),
        ([{"role": "user", "content": 5}], "Field 'messages[0].content': message content must"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "Field 'messages[0].content': unsupported content part type 'image_url'",
        ),
        ([{"role": "user"}], "Field 'messages[0].content' is required"),
        ([{"role": "user", "content": None}], "Field 'messages[0].content' is required"),
        (
            [{"role": "user", "content": "a"}, {"role": "assistant"}],
            "Field 'messages[1].content' is required",
        ),
        ([], "Field 'messages' must not be empty"),
        # tool_calls the template polyfills could not read (were 500s: TypeError,
        # AttributeError in text/chat_caps.py)
        (
            [{"role": "user", "content": "hi", "tool_calls": 7}],
            "Field 'messages[0].tool_calls': Value must be an array of tool call objects",
        ),
        (
            [{"role": "user", "content": "a"},
             {"role": "assistant", "content": "x", "tool_calls": ["f"]},
             {"role": "user", "content": "b"}],
            "Field 'messages[1].tool_calls': Value must be an array of tool call objects",
        ),
        (
            [{"role": "user", "content": "hi", "tool_calls": [{"function": 5}]}],
            "Field 'messages[0].tool_calls': a tool call's 'function' must be an object",
        ),
        ("hi", "Field 'messages': Input should be a valid list"),
        (["hi"], "Field 'messages[0]': Input should be a valid dictionary"),
    ],
)
def test_chat_message_errors(ctx: ParseContext, messages: Any, expected: str) -> None:
    assert bad_request(chat, ctx, messages=messages).startswith(expected)


def test_chat_requires_messages(ctx: ParseContext) -> None:
    assert bad_request(parse_chat, {}, ctx) == "Field 'messages' is required"
    assert bad_request(parse_chat, {"messages": None}, ctx).startswith("Field 'messages'")


def test_chat_logprobs(ctx: ParseContext) -> None:
    assert chat(ctx).task.n_probs == 0
    assert chat(ctx, logprobs=True).task.n_probs == 20
    assert chat(ctx, logprobs=True, top_logprobs=5).task.n_probs == 5
    assert chat(ctx, logprobs=False, n_probs=4).task.n_probs == 4  # native field passes
    assert "requires 'logprobs'" in bad_request(chat, ctx, top_logprobs=3)
    assert "Field 'logprobs': Value must be a boolean" in bad_request(chat, ctx, logprobs=3)
    assert bad_request(chat, ctx, logprobs=True, top_logprobs=500).startswith(
        "Field 'top_logprobs': Value must be between 0"
    )


def test_chat_passes_native_fields_through(ctx: ParseContext) -> None:
    r = chat(
        ctx,
        id_slot=1,
        cache_prompt=False,
        n_cache_reuse=128,
        top_k=3,
        min_p=0.2,
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    t = r.task
    assert (t.id_slot, t.cache_prompt, t.n_cache_reuse, t.n_predict) == (1, False, 128, 9)
    assert (t.params.top_k, t.params.min_p) == (3, 0.2)
    assert r.stream and r.include_usage


def test_chat_n_and_tools(ctx: ParseContext) -> None:
    assert "Field 'n': Value must be between 1 <= value <= 2" in bad_request(chat, ctx, n=3)
    assert [t.index for t in chat(ctx, n=2).tasks] == [0, 1]
    tools = [{"type": "function", "function": {"name": "f"}}]
    ctx.n_ctx_slot = 2048  # the tools' description is in the prompt
    r = chat(ctx, tools=tools, n=2)  # the default template has no tools: the generic format
    assert r.chat_output is not None and r.chat_output.kind == "generic"
    assert all(t.grammar for t in r.tasks)
    assert "Field 'tools[0]'" in bad_request(chat, ctx, tools=[{"type": "retrieval"}])


def test_chat_trailing_assistant_message_is_a_prefill(ctx: ParseContext, tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, "}]
    got = tok.decode(chat(ctx, messages=msgs).task.prompt_tokens)
    assert got.endswith("<|im_start|>assistant\nSure, ")


def test_chat_drops_template_bos_when_tokenizer_adds_it(
    ctx: ParseContext, bos_tok: Tokenizer
) -> None:
    bos_text = bos_tok.token_text(bos_tok.bos_id)
    ctx.tokenizer = bos_tok
    ctx.chat_template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}", bos_token=bos_text
    )
    tokens = chat(ctx).task.prompt_tokens
    assert tokens[0] == bos_tok.bos_id and bos_tok.bos_id not in tokens[1:]


def test_chat_template_kwargs_and_errors(ctx: ParseContext, tok: Tokenizer) -> None:
    ctx.chat_template = ChatTemplate("{{ greeting }}{{ messages[0].content }}")
    r = chat(ctx, chat_template_kwargs={"greeting": "Yo "})
    assert tok.decode(r.task.prompt_tokens) == "Yo Hi"
    ctx.chat_template = ChatTemplate("{{ raise_exception('no system role') }}")
    assert "no system role" in bad_request(chat, ctx)


def test_chat_tool_calls_in_history_still_render(ctx: ParseContext, tok: Tokenizer) -> None:
    """The tiny template shows no tool calls: they are polyfilled into the content."""
    ctx.n_ctx_slot = 4096
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    msgs = [{"role": "user", "content": "a"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            {"role": "user", "content": "b"}]
    assert '"name": "f"' in tok.decode(chat(ctx, messages=msgs).task.prompt_tokens)
    assert chat(ctx, messages=[{"role": "user", "content": "a", "tool_calls": []}])


@pytest.mark.parametrize("name", ["tools", "t", "caps", "merge_system", "self"])
def test_chat_template_kwargs_cannot_collide_with_the_renderer(ctx: ParseContext,
                                                               name: str) -> None:
    """Were 500s (TypeError: render() got multiple values for argument ...)."""
    msg = bad_request(chat, ctx, chat_template_kwargs={name: 5})
    assert msg.startswith(f"Field 'chat_template_kwargs': '{name}' is ")


def test_logit_bias_key_past_the_int_digit_limit_is_400(ctx: ParseContext) -> None:
    """Was a 500 (int() refuses strings of more than 4300 digits)."""
    assert bad_request(cmpl, ctx, logit_bias={"9" * 5000: 1.0}).startswith("Field 'logit_bias'")
    assert cmpl(ctx, logit_bias={"9" * 30: 1.0}).task.params.logit_bias == []  # out of range


def test_chat_prompt_too_long_for_context(ctx: ParseContext) -> None:
    e = error_of(chat, ctx, messages=[{"role": "user", "content": "word " * 200}])
    assert e.type == "exceed_context_size_error" and e.extra["n_ctx"] == N_CTX
    assert e.extra["n_prompt_tokens"] > N_CTX


# ---- robustness: any JSON body is a task or a 400, never another exception -----------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
_KEYS = ["prompt", "n_predict", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
         "stop", "id_slot", "cache_prompt", "n_cache_reuse", "stream", "stream_options",
         "n_probs", "logprobs", "top_logprobs", "repeat_penalty", "repeat_last_n", "n",
         "response_format", "messages", "chat_template_kwargs", "tools", "tool_choice",
         "parallel_tool_calls", "reasoning_format"]  # fmt: skip
_bodies = st.dictionaries(st.sampled_from(_KEYS), _json, max_size=6)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=_bodies, valid_base=st.booleans())
def test_any_completion_body_is_a_task_or_a_400(
    ctx: ParseContext, body: dict, valid_base: bool
) -> None:
    if valid_base:  # reach the checks behind the prompt/messages ones too
        body = {"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}], **body}
    for parse in (parse_completion, parse_chat):
        try:
            parse(body, ctx)
        except TaskError as e:
            assert e.status == 400 and e.message
