"""llama.cpp's built-in chat templates (`--chat-template NAME`) as Jinja texts.

llama.cpp formats its named templates in C++ (src/llama-chat.cpp, llm_chat_apply_template:
the names are its LLM_CHAT_TEMPLATES map, listed in llama-server's --help under
--chat-template). Here each name is a Jinja text that renders what that function writes for a
list of role/content messages and add_generation_prompt ("add_ass"), so the server renders it
as it renders any template (text/chat_template.py). Where llama.cpp ignores add_ass (llama2,
mistral, orion, minicpm, rwkv-world, the hunyuan ones, deepseek-ocr), so does the text.

Its `trim` is C's isspace in the C locale (" \\t\\n\\v\\f\\r"), and its upper-casing (openchat's
first letter, bailing's roles) is ASCII's, so the texts trim and upper-case just those
characters, not Python's Unicode sets.

tests/test_builtin_templates.py compares every name with prompts captured from llama-server
itself (scripts/capture_llama_chat_templates.py: `--no-jinja --chat-template NAME`, POST
/apply-template).
"""

from __future__ import annotations

from radixserve.text.chat_template import CHATML_TEMPLATE

# Jinja fragments: a message's content trimmed as llama.cpp's trim(), and ASCII upper-casing
_T = r"|trim(' \t\n\v\f\r')"
_LOWER = "'abcdefghijklmnopqrstuvwxyz'"
_UPPER_MACRO = ("{%- macro ascii_upper(s) -%}{%- for ch in s -%}{{ ch|upper if ch in "
                + _LOWER + " else ch }}{%- endfor -%}{%- endmacro -%}")


def _gen(text: str) -> str:
    """The generation prompt, written when add_generation_prompt."""
    return "{%- if add_generation_prompt -%}{{ " + text + " }}{%- endif -%}"


def _each(body: str) -> str:
    """`body` once a message, as `m`."""
    return "{%- for m in messages -%}" + body + "{%- endfor -%}"


def _by_role(cases: dict[str, str], other: str = "") -> str:
    """An if/elif chain on m.role: role -> Jinja expression written for it (`other`: the
    expression for any other role, none if empty)."""
    out = ""
    for i, (role, expr) in enumerate(cases.items()):
        out += ("{%- if " if i == 0 else "{%- elif ") + f"m.role == '{role}'" + " -%}"
        out += "{{ " + expr + " }}"
    if other:
        out += "{%- else -%}{{ " + other + " }}"
    return out + "{%- endif -%}"


def _simple(head: str, tail: str, gen: str, content: str = "m.content") -> str:
    """Every message as head + content + tail (head/tail Jinja expressions), then `gen`."""
    return _each("{{ " + head + " + " + content + " + " + tail + " }}") + _gen(gen)


def _mistral_v7(sp: str) -> str:
    return _each(_by_role({
        "system": f"'[SYSTEM_PROMPT]{sp}' + m.content + '[/SYSTEM_PROMPT]'",
        "user": f"'[INST]{sp}' + m.content + '[/INST]'",
    }, other=f"'{sp}' + m.content + '</s>'"))


def _mistral(lead: str, trail: str, trim_assistant: bool) -> str:
    reply = "m.content" + (_T if trim_assistant else "")
    return (
        "{%- set ns = namespace(inside=false) -%}"
        + _each(
            "{%- if not ns.inside -%}{{ '" + lead + "[INST]" + trail + "' }}"
            "{%- set ns.inside = true -%}{%- endif -%}"
            "{%- if m.role == 'system' -%}{{ m.content + '\\n\\n' }}"
            "{%- elif m.role == 'user' -%}{{ m.content + '" + lead + "[/INST]' }}"
            "{%- else -%}{{ '" + trail + "' + " + reply + " + '</s>' }}"
            "{%- set ns.inside = false -%}{%- endif -%}"
        )
    )


def _llama2(system: bool, bos_inside: bool, strip: bool) -> str:
    c = "m.content" + (_T if strip else "")
    sys_expr = "'<<SYS>>\\n' + " + c + " + '\\n<</SYS>>\\n\\n'" if system else c + " + '\\n'"
    return (
        "{%- set ns = namespace(inside=true) -%}{{ '[INST] ' }}"
        + _each(
            "{%- if not ns.inside -%}{%- set ns.inside = true -%}{{ '"
            + ("<s>[INST] " if bos_inside else "[INST] ") + "' }}{%- endif -%}"
            "{%- if m.role == 'system' -%}{{ " + sys_expr + " }}"
            "{%- elif m.role == 'user' -%}{{ " + c + " + ' [/INST]' }}"
            "{%- else -%}{{ " + c + " + '</s>' }}{%- set ns.inside = false -%}{%- endif -%}"
        )
    )


def _vicuna(orca: bool) -> str:
    system = "'SYSTEM: ' + m.content + '\\n'" if orca else "m.content + '\\n\\n'"
    return _each(_by_role({
        "system": system,
        "user": "'USER: ' + m.content + '\\n'",
        "assistant": "'ASSISTANT: ' + m.content + '</s>\\n'",
    })) + _gen("'ASSISTANT:'")


def _exaone(tool: bool) -> str:
    cases = {
        "system": "'[|system|]' + m.content" + _T + " + '[|endofturn|]\\n'",
        "user": "'[|user|]' + m.content" + _T + " + '\\n'",
        "assistant": "'[|assistant|]' + m.content" + _T + " + '[|endofturn|]\\n'",
    }
    if tool:
        cases["tool"] = "'[|tool|]' + m.content" + _T + " + '[|endofturn|]\\n'"
    return _each(_by_role(cases)) + _gen("'[|assistant|]'")


def _granite(tool_call_role: bool) -> str:
    """3.x writes the role as given, then <|tool_call|> for assistant_tool_call; 4.x writes
    assistant<|end_of_role|><|tool_call|> for it."""
    if tool_call_role:
        head = ("{%- if m.role == 'assistant_tool_call' -%}"
                "{{ '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' }}"
                "{%- else -%}{{ '<|start_of_role|>' + m.role + '<|end_of_role|>' }}{%- endif -%}")
    else:
        head = ("{{ '<|start_of_role|>' + m.role + '<|end_of_role|>' }}"
                "{%- if m.role == 'assistant_tool_call' -%}{{ '<|tool_call|>' }}{%- endif -%}")
    return (_each(head + "{{ m.content + '<|end_of_text|>\\n' }}")
            + _gen("'<|start_of_role|>assistant<|end_of_role|>'"))


def _bailing(think: bool) -> str:
    return (_UPPER_MACRO
            + _each("{{ '<role>' + ('HUMAN' if m.role == 'user' else ascii_upper(m.role)) "
                    "+ '</role>' + m.content }}")
            + _gen("'<role>ASSISTANT</role>" + ("<think>" if think else "") + "'"))


_GEMMA = (
    "{%- set ns = namespace(sys='') -%}"
    + _each(
        "{%- if m.role == 'system' -%}{%- set ns.sys = ns.sys + m.content" + _T + " -%}"
        "{%- else -%}{%- set r = 'model' if m.role == 'assistant' else m.role -%}"
        "{{ '<start_of_turn>' + r + '\\n' }}"
        "{%- if ns.sys and r != 'model' -%}{{ ns.sys + '\\n\\n' }}{%- set ns.sys = '' -%}"
        "{%- endif -%}{{ m.content" + _T + " + '<end_of_turn>\\n' }}{%- endif -%}"
    )
    + _gen("'<start_of_turn>model\\n'")
)

_ORION = (
    "{%- set ns = namespace(sys='') -%}"
    + _each(
        "{%- if m.role == 'system' -%}{%- set ns.sys = ns.sys + m.content -%}"
        "{%- elif m.role == 'user' -%}{{ 'Human: ' }}"
        "{%- if ns.sys -%}{{ ns.sys + '\\n\\n' }}{%- set ns.sys = '' -%}{%- endif -%}"
        "{{ m.content + '\\n\\nAssistant: </s>' }}"
        "{%- else -%}{{ m.content + '</s>' }}{%- endif -%}"
    )
)

_OPENCHAT = _each(
    "{%- if m.role == 'system' -%}{{ m.content + '<|end_of_turn|>' }}"
    "{%- else -%}{{ 'GPT4 Correct ' + (m.role[:1]|upper if m.role[:1] in " + _LOWER
    + " else m.role[:1]) + m.role[1:] + ': ' + m.content + '<|end_of_turn|>' }}"
    "{%- endif -%}"
) + _gen("'GPT4 Correct Assistant:'")

_GIGACHAT = (
    "{%- set has_sys = messages|length > 0 and messages[0].role == 'system' -%}"
    "{%- if has_sys -%}{{ '<s>' + messages[0].content + '<|message_sep|>' }}"
    "{%- else -%}{{ '<s>' }}{%- endif -%}"
    + _each(
        "{%- if not (loop.first and has_sys) -%}"
        + _by_role({
            "user": "'user<|role_sep|>' + m.content + '<|message_sep|>available "
                    "functions<|role_sep|>[]<|message_sep|>'",
            "assistant": "'assistant<|role_sep|>' + m.content + '<|message_sep|>'",
        })
        + "{%- endif -%}"
    )
    + _gen("'assistant<|role_sep|>'")
)

_BAILING2 = (
    _UPPER_MACRO
    + "{%- if not (messages|length > 0 and messages[0].role == 'system') -%}"
    "{{ '<role>SYSTEM</role>detailed thinking off<|role_end|>' }}{%- endif -%}"
    + _each("{{ '<role>' + ('HUMAN' if m.role == 'user' else ascii_upper(m.role)) + '</role>' "
            "+ m.content + '<|role_end|>' }}")
    + _gen("'<role>ASSISTANT</role>'")
)

_RWKV_WORLD = _each(_by_role({
    "system": "'System: ' + m.content" + _T + " + '\\n\\n'",
    "user": "'User: ' + m.content" + _T + " + '\\n\\n' + ('Assistant:' if loop.last else '')",
    "assistant": "'Assistant: ' + m.content" + _T + " + '\\n\\n'",
}))

_HUNYUAN_DENSE = _each(
    "{%- if loop.first and m.role == 'system' -%}"
    "{{ m.content + '<｜hy_place▁holder▁no▁3｜>' }}{%- endif -%}"
    + _by_role({
        "assistant": "'<｜hy_Assistant｜>' + m.content + '<｜hy_place▁holder▁no▁2｜>'",
        "user": "'<｜hy_User｜>' + m.content + '<｜hy_Assistant｜>'",
    })
)

_HUNYUAN_VL = "{{ '<｜hy_begin▁of▁sentence｜>' }}" + _each(
    "{%- if loop.first and m.role == 'system' -%}"
    "{{ m.content + '<｜hy_place▁holder▁no▁3｜>' }}{%- else -%}"
    + _by_role({
        "user": "m.content + '<｜hy_User｜>'",
        "assistant": "m.content + '<｜hy_Assistant｜>'",
    })
    + "{%- endif -%}"
)

_PANGU = _each(
    "{%- if loop.first and m.role != 'system' -%}{{ '[unused9]系统：[unused10]' }}{%- endif -%}"
    + _by_role({
        "system": "'[unused9]系统：' + m.content + '[unused10]'",
        "user": "'[unused9]用户：' + m.content + '[unused10]'",
        "assistant": "'[unused9]助手：' + m.content + '[unused10]'",
        "tool": "'[unused9]工具：' + m.content + '[unused10]'",
        "function": "'[unused9]方法：' + m.content + '[unused10]'",
    })
) + _gen("'[unused9]助手：'")

# name -> Jinja text; the names are llama.cpp's LLM_CHAT_TEMPLATES (its --help's list)
BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": CHATML_TEMPLATE,  # llama.cpp's Jinja path uses this very text for "chatml"
    "llama2": _llama2(system=False, bos_inside=False, strip=False),
    "llama2-sys": _llama2(system=True, bos_inside=False, strip=False),
    "llama2-sys-bos": _llama2(system=True, bos_inside=True, strip=False),
    "llama2-sys-strip": _llama2(system=True, bos_inside=False, strip=True),
    "mistral-v1": _mistral(" ", " ", trim_assistant=False),
    "mistral-v3": _mistral("", " ", trim_assistant=True),
    "mistral-v3-tekken": _mistral("", "", trim_assistant=False),
    "mistral-v7": _mistral_v7(" "),
    "mistral-v7-tekken": _mistral_v7(""),
    "phi3": _simple("'<|' + m.role + '|>\\n'", "'<|end|>\\n'", "'<|assistant|>\\n'"),
    "phi4": _simple("'<|im_start|>' + m.role + '<|im_sep|>'", "'<|im_end|>'",
                    "'<|im_start|>assistant<|im_sep|>'"),
    "falcon3": _simple("'<|' + m.role + '|>\\n'", "'\\n'", "'<|assistant|>\\n'"),
    "zephyr": _simple("'<|' + m.role + '|>\\n'", "'<|endoftext|>\\n'", "'<|assistant|>\\n'"),
    "monarch": _simple("('' if loop.first else '<s>') + m.role + '\\n'", "'</s>\\n'",
                       "'<s>assistant\\n'"),
    "gemma": _GEMMA,
    "orion": _ORION,
    "openchat": _OPENCHAT,
    "vicuna": _vicuna(orca=False),
    "vicuna-orca": _vicuna(orca=True),
    "deepseek": _each(_by_role({
        "system": "m.content",
        "user": "'### Instruction:\\n' + m.content + '\\n'",
        "assistant": "'### Response:\\n' + m.content + '\\n<|EOT|>\\n'",
    })) + _gen("'### Response:\\n'"),
    "deepseek2": _each(_by_role({
        "system": "m.content + '\\n\\n'",
        "user": "'User: ' + m.content + '\\n\\n'",
        "assistant": "'Assistant: ' + m.content + '<｜end▁of▁sentence｜>'",
    })) + _gen("'Assistant:'"),
    "deepseek3": _each(_by_role({
        "system": "m.content + '\\n\\n'",
        "user": "'<｜User｜>' + m.content",
        "assistant": "'<｜Assistant｜>' + m.content + '<｜end▁of▁sentence｜>'",
    })) + _gen("'<｜Assistant｜>'"),
    "deepseek-ocr": _each("{{ m.content }}"),
    "command-r": _each(_by_role({
        role: f"'<|START_OF_TURN_TOKEN|><|{tok}_TOKEN|>' + m.content{_T} + '<|END_OF_TURN_TOKEN|>'"
        for role, tok in (("system", "SYSTEM"), ("user", "USER"), ("assistant", "CHATBOT"))
    })) + _gen("'<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>'"),
    "llama3": _simple("'<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n'",
                      "'<|eot_id|>'", "'<|start_header_id|>assistant<|end_header_id|>\\n\\n'",
                      content="m.content" + _T),
    "chatglm3": "{{ '[gMASK]sop' }}" + _simple("'<|' + m.role + '|>\\n '", "''",
                                               "'<|assistant|>'"),
    "chatglm4": "{{ '[gMASK]<sop>' }}" + _simple("'<|' + m.role + '|>\\n'", "''",
                                                 "'<|assistant|>\\n'"),
    "glmedge": _simple("'<|' + m.role + '|>\\n'", "''", "'<|assistant|>'"),
    "minicpm": _each(_by_role({"user": "'<用户>' + m.content" + _T + " + '<AI>'"},
                              other="m.content" + _T)),
    "exaone3": _exaone(tool=False),
    "exaone4": _exaone(tool=True),
    "exaone-moe": _each(_by_role({
        role: f"'<|{role}|>\\n' + m.content{_T} + '<|endofturn|>\\n'"
        for role in ("system", "user", "assistant", "tool")
    })) + _gen("'<|assistant|>\\n'"),
    "rwkv-world": _RWKV_WORLD,
    "granite": _granite(tool_call_role=False),
    "granite-4.0": _granite(tool_call_role=True),
    "granite-4.1": _granite(tool_call_role=True),
    "gigachat": _GIGACHAT,
    "megrez": _simple("'<|role_start|>' + m.role + '<|role_end|>'", "'<|turn_end|>'",
                      "'<|role_start|>assistant<|role_end|>'"),
    "yandex": _each(_by_role({
        "user": "' Пользователь: ' + m.content + '\\n\\n'",
        "assistant": "' Ассистент: ' + m.content + '\\n\\n'",
    })) + _gen("' Ассистент:[SEP]'"),
    "bailing": _bailing(think=False),
    "bailing-think": _bailing(think=True),
    "bailing2": _BAILING2,
    "llama4": _simple("'<|header_start|>' + m.role + '<|header_end|>\\n\\n'", "'<|eot|>'",
                      "'<|header_start|>assistant<|header_end|>\\n\\n'",
                      content="m.content" + _T),
    "smolvlm": "{{ '<|im_start|>' }}" + _each(_by_role({
        "system": "m.content + '\\n\\n'",
        "user": "'User: ' + m.content + '<end_of_utterance>\\n'",
    }, other="'Assistant: ' + m.content + '<end_of_utterance>\\n'")) + _gen("'Assistant:'"),
    "hunyuan-moe": _each(_by_role({
        "system": "'<|startoftext|>' + m.content + '<|extra_4|>'",
        "assistant": "m.content + '<|eos|>'",
    }, other="'<|startoftext|>' + m.content + '<|extra_0|>'")),
    "gpt-oss": _each("{{ '<|start|>' + m.role + '<|message|>' + m.content + "
                     "('<|return|>' if m.role == 'assistant' else '<|end|>') }}")
    + _gen("'<|start|>assistant'"),
    "hunyuan-dense": _HUNYUAN_DENSE,
    "hunyuan-vl": _HUNYUAN_VL,
    "kimi-k2": _each(_by_role({
        "system": "'<|im_system|>system<|im_middle|>'",
        "user": "'<|im_user|>user<|im_middle|>'",
        "assistant": "'<|im_assistant|>assistant<|im_middle|>'",
        "tool": "'<|im_system|>tool<|im_middle|>'",
    }) + "{{ m.content + '<|im_end|>' }}") + _gen("'<|im_assistant|>assistant<|im_middle|>'"),
    "seed_oss": _simple("'<seed:bos>' + m.role + '\\n'", "'<seed:eos>'",
                        "'<seed:bos>assistant\\n'",
                        content="(m.content" + _T + " if m.role == 'assistant' else m.content)"),
    "grok-2": _each(_by_role({
        "system": "'System: ' + m.content" + _T + " + '<|separator|>\\n\\n'",
        "user": "'Human: ' + m.content" + _T + " + '<|separator|>\\n\\n'",
        "assistant": "'Assistant: ' + m.content + '<|separator|>\\n\\n'",
    })) + _gen("'Assistant:'"),
    "pangu-embedded": _PANGU,
    "solar-open": _simple("'<|begin|>' + m.role + '<|content|>'", "'<|end|>'",
                          "'<|begin|>assistant'"),
}

BUILTIN_NAMES: tuple[str, ...] = tuple(sorted(BUILTIN_TEMPLATES))  # as llama.cpp lists them


def builtin_template(name: str) -> str | None:
    """The Jinja text of llama.cpp's built-in template `name`; None if it names none."""
    return BUILTIN_TEMPLATES.get(name)
