"""`--chat-template NAME`: llama.cpp's built-in templates (radixserve/text/builtin_templates.py).

llama-server renders a name with llama.cpp's llm_chat_apply_template (src/llama-chat.cpp; the
names are its LLM_CHAT_TEMPLATES, listed in its --help under --chat-template). The expected
prompts are llama-server's own: tests/fixtures/llama-chat-templates.json holds what the
llama-server whose --help is tests/fixtures/llama-server-help.txt answered on /apply-template,
started with `--no-jinja --chat-template NAME` (scripts/capture_llama_chat_templates.py; with
its default --jinja it would take the name as a Jinja text and render it literally), for five
conversations with and without add_generation_prompt. A few are also spelled out below as read
from llama-chat.cpp, so a fixture regenerated wrong would not go unnoticed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from radixserve.config import ServerConfig
from radixserve.flags import FlagError, parse_serve
from radixserve.http.app import create_app
from radixserve.http.run import load
from radixserve.text.builtin_templates import BUILTIN_NAMES, BUILTIN_TEMPLATES
from radixserve.text.chat_template import CHATML_TEMPLATE, ChatTemplate
from tests.http.test_app import ScriptedEngine

FIXTURES = Path(__file__).parent / "fixtures"
CAPTURED = json.loads((FIXTURES / "llama-chat-templates.json").read_text())
HELP = (FIXTURES / "llama-server-help.txt").read_text()


def help_names() -> list[str]:
    """The names under --chat-template in llama-server's --help."""
    block = HELP.split("--chat-template JINJA_TEMPLATE", 1)[1].split("list of built-in "
                                                                       "templates:", 1)[1]
    words = []
    for line in block.splitlines()[1:]:
        if "(env:" in line:
            break
        words.append(line.strip())
    return [n.strip() for n in " ".join(words).split(",")]


def test_every_name_llama_server_lists_is_built_in() -> None:
    assert list(BUILTIN_NAMES) == help_names()  # the same names, in its (sorted) order
    assert set(CAPTURED["prompts"]) == set(BUILTIN_NAMES)
    assert BUILTIN_TEMPLATES["chatml"] == CHATML_TEMPLATE  # llama.cpp's Jinja chatml text


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_prompts_equal_llama_servers(name: str) -> None:
    t = ChatTemplate(BUILTIN_TEMPLATES[name])
    for messages, (with_gen, without_gen) in zip(CAPTURED["conversations"],
                                                  CAPTURED["prompts"][name], strict=True):
        assert t.render(messages, add_generation_prompt=True) == with_gen, messages
        assert t.render(messages, add_generation_prompt=False) == without_gen, messages


CHAT = [{"role": "system", "content": " S "}, {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A "}, {"role": "user", "content": "U2"}]

# as read from llm_chat_apply_template (llama-chat.cpp), for CHAT with add_ass
FROM_SOURCE = {
    # trim() of every content; the generation prompt after the last turn
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\nA<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nU2<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
    # the system message joins the first user turn; assistant is "model"
    "gemma": "<start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\nA<end_of_turn>\n"
             "<start_of_turn>user\nU2<end_of_turn>\n<start_of_turn>model\n",
    # v7: a space after each tag, replies after a space and closed by </s>; no add_ass
    "mistral-v7": "[SYSTEM_PROMPT]  S [/SYSTEM_PROMPT][INST] U[/INST] A </s>[INST] U2[/INST]",
    # [INST] opened once, <<SYS>> inside the first turn, the reply closes it
    "llama2-sys": "[INST] <<SYS>>\n S \n<</SYS>>\n\nU [/INST]A </s>[INST] U2 [/INST]",
    "zephyr": "<|system|>\n S <|endoftext|>\n<|user|>\nU<|endoftext|>\n<|assistant|>\nA "
              "<|endoftext|>\n<|user|>\nU2<|endoftext|>\n<|assistant|>\n",
    "deepseek3": " S \n\n<｜User｜>U<｜Assistant｜>A <｜end▁of▁sentence｜><｜User｜>U2<｜Assistant｜>",
}


@pytest.mark.parametrize("name", FROM_SOURCE)
def test_prompts_as_read_from_llama_chat_cpp(name: str) -> None:
    assert ChatTemplate(BUILTIN_TEMPLATES[name]).render(CHAT) == FROM_SOURCE[name]


def test_the_flag_selects_a_name_and_refuses_an_unknown_one() -> None:
    for flag in ("--chat-template", "LLAMA_ARG_CHAT_TEMPLATE"):
        argv, env = ([flag, "phi4"], {}) if flag.startswith("-") else ([], {flag: "phi4"})
        assert parse_serve(argv, env).cfg.chat_template == BUILTIN_TEMPLATES["phi4"]
    jinja = "{{ messages[0].content }}"
    assert parse_serve(["--chat-template", jinja], {}).cfg.chat_template == jinja
    # llama-server (common/arg.cpp, after parsing): "error: the supplied chat template is not
    # supported: llama5", exit 1
    with pytest.raises(FlagError, match="--chat-template: the supplied chat template is not "
                                        "supported: llama5"):
        parse_serve(["--chat-template", "llama5"], {})


def test_a_file_naming_a_template_selects_it(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("vicuna")  # llama-server reads the file into the same parameter
    cfg = parse_serve(["--chat-template-file", str(f)], {}).cfg
    assert cfg.chat_template == BUILTIN_TEMPLATES["vicuna"]


def test_the_server_renders_the_named_template(tiny_path: str) -> None:
    """Flag to /apply-template and /props: the model's own template is replaced."""
    cfg = parse_serve(["-m", tiny_path, "--chat-template", "llama3"], {}).cfg
    engine = ScriptedEngine(load(cfg), ServerConfig())
    with TestClient(create_app(engine, cfg)) as c:
        r = c.post("/apply-template", json={"messages": CHAT})
        assert r.status_code == 200, r.text
        assert r.json()["prompt"] == FROM_SOURCE["llama3"]
        assert c.get("/props").json()["chat_template"] == BUILTIN_TEMPLATES["llama3"]
