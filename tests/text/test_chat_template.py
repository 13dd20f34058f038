"""Chat template tests: equality with HF's apply_chat_template on the default model, the
sandbox, content-part flattening, errors as ValueError, and the ChatML fallback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest

from radixserve.model.default_model import default_model_path
from radixserve.text.chat_template import CHATML_TEMPLATE, ChatTemplate, flatten_content
from radixserve.text.tokenizer import GGUFVocab, Tokenizer

CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4, of course.\n"},
    {"role": "user", "content": "Thanks! <b>&</b> ünïcödé 😀"},
]


@pytest.fixture(scope="module")
def reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(default_model_path())


@pytest.fixture(scope="module")
def default_template(reader: gguf.GGUFReader) -> ChatTemplate:
    return ChatTemplate.from_gguf(reader, Tokenizer.from_gguf(reader))


@pytest.fixture(scope="module")
def hf_tokenizer(hf_default_tokenizer: Any) -> Any:
    """transformers' tokenizer for the default GGUF: the reference (test-only dependency), the
    session's (tests/conftest.py)."""
    return hf_default_tokenizer


@pytest.mark.model
@pytest.mark.parametrize("n_messages", [1, 2, 3])
@pytest.mark.parametrize("with_system", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_default_template_matches_hf(
    default_template: ChatTemplate,
    hf_tokenizer: Any,
    n_messages: int,
    with_system: bool,
    add_generation_prompt: bool,
) -> None:
    messages = CONVERSATION[:n_messages]
    if with_system:
        messages = [{"role": "system", "content": "Be brief."}, *messages]
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert (
        default_template.render(messages, add_generation_prompt=add_generation_prompt) == expected
    )


@pytest.mark.model
def test_default_template_two_messages_exact(default_template: ChatTemplate) -> None:
    text = default_template.render(CONVERSATION[:2])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4, of course.\n<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (default_template.bos_token, default_template.eos_token) == (
        "<|im_start|>",
        "<|im_end|>",
    )


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{% set x = [] %}{{ x.append(1) }}",  # immutable sandbox: no mutation of lists
        "{{ raise_exception('nope') }}",
        "{{ messages[0].content | unknown_filter }}",
        "{% for m in messages %}",  # syntax error
        "{{ 1 / 0 }}",
    ],
)
def test_template_errors_are_value_errors(source: str) -> None:
    with pytest.raises(ValueError, match="chat template"):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


def test_sandboxed_attribute_renders_nothing_useful() -> None:
    # Unsafe attributes resolve to an undefined value instead of the real object.
    assert ChatTemplate("{{ ''.__class__ }}").render([]) == ""


def test_helpers_and_variables() -> None:
    t = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{{ m.role }}={{ m.content | tojson }};"
        "{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}"
        "{{ strftime_now('%Y') | length }}|{{ tools }}|{{ enable_thinking }}"
        "{% generation %}G{% endgeneration %}{{ eos_token }}",
        bos_token="<s>",
        eos_token="</s>",
    )
    out = t.render([{"role": "user", "content": "é<>"}], enable_thinking=False)
    assert out == '<s>user="é<>";4|None|FalseG</s>'


def test_trim_and_lstrip_blocks() -> None:
    t = ChatTemplate(
        "{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n{% endif %}\n{% endfor %}"
    )
    assert (
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a\nb\n"
    )


def test_content_parts_are_flattened() -> None:
    t = ChatTemplate(CHATML_TEMPLATE)
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    out = t.render([{"role": "user", "content": parts}], add_generation_prompt=False)
    assert out == "<|im_start|>user\nfirst\nsecond<|im_end|>\n"
    assert flatten_content(None) == "" and flatten_content("x") == "x"


@pytest.mark.parametrize(
    "content",
    [
        [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
        [{"type": "text", "text": "ok"}, {"type": "input_audio", "input_audio": {}}],
        ["bare string part"],
        [{"type": "text"}],
        42,
    ],
)
def test_bad_content_is_value_error(content: Any) -> None:
    with pytest.raises(ValueError):
        ChatTemplate(CHATML_TEMPLATE).render([{"role": "user", "content": content}])


def test_bad_messages_are_value_errors() -> None:
    t = ChatTemplate(CHATML_TEMPLATE)
    with pytest.raises(ValueError, match="role"):
        t.render([{"content": "no role"}])
    with pytest.raises(ValueError, match="role"):
        t.render(["not a dict"])  # type: ignore[list-item]


def _write_gguf(path: Path, template: str | None) -> gguf.GGUFReader:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(["a", "b", "<s>", "</s>"])
    w.add_token_types([1, 1, 3, 3])
    w.add_token_merges([])
    w.add_bos_token_id(2)
    w.add_eos_token_id(3)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(str(path))


@pytest.mark.parametrize("template", [None, "{% if %}broken"])
def test_missing_or_broken_template_falls_back_to_chatml(
    tmp_path: Path, template: str | None
) -> None:
    reader = _write_gguf(tmp_path / "m.gguf", template)
    t = ChatTemplate.from_gguf(reader, Tokenizer.from_gguf(reader))
    assert t.source == CHATML_TEMPLATE
    assert (t.bos_token, t.eos_token) == ("<s>", "</s>")
    out = t.render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert (
        out
        == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"
    )


def test_gguf_template_is_used(tmp_path: Path) -> None:
    reader = _write_gguf(
        tmp_path / "m.gguf", "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"
    )
    t = ChatTemplate.from_gguf(reader, Tokenizer(GGUFVocab.from_gguf(reader)))
    assert t.render([{"role": "user", "content": "hi"}]) == "<s>hi</s>"


def test_user_start_is_found_by_differential_renders():
    assert ChatTemplate(CHATML_TEMPLATE).user_start == "<|im_start|>user\n"
    gemma = ("{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
             "else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}")
    assert ChatTemplate(gemma).user_start == "<start_of_turn>user\n"
    assert ChatTemplate("{{ messages[-1]['content'] }}").user_start == ""  # no turns
