"""Chat templates: OpenAI-style messages -> prompt text, with the GGUF's Jinja template.

Templates come from model files, so they are untrusted code: they run in jinja2's
`ImmutableSandboxedEnvironment`, configured as HF transformers configures it (`trim_blocks`,
`lstrip_blocks`, `loopcontrols`, a non-escaping `tojson`, `raise_exception`, `strftime_now`) so
the same template renders the same text here as in `apply_chat_template`. Every failure —
syntax, sandbox violation, `raise_exception`, a bad message — surfaces as ValueError, which
the server reports as HTTP 400.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn

import gguf
import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from radixserve.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# llama.cpp's fallback (CHATML_TEMPLATE_SRC) for models without a usable template.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}"
)


class _GenerationTag(jinja2.ext.Extension):
    """Accept HF's `{% generation %}...{% endgeneration %}` marker (used for training masks)
    and render its body unchanged, so templates that use it still compile."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def flatten_content(content: Any) -> str:
    """A message's content as one string: a string as is, None as "", and an OpenAI list of
    parts as its text parts joined by newlines (llama.cpp's `concat_typed_text`).

    Bad shapes raise ValueError, not TypeError: they are client errors (HTTP 400)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence):
        raise ValueError(
            f"message content must be a string or a list of parts, got {type(content).__name__}"
        )
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(
                f"unsupported content part type {kind!r}: only 'text' parts are supported"
            )
        if not isinstance(part.get("text"), str):
            raise ValueError("a 'text' content part needs a string 'text' field")
        texts.append(part["text"])
    return "\n".join(texts)


class ChatTemplate:
    """A compiled chat template plus the BOS/EOS strings templates may refer to."""

    def __init__(self, template: str, bos_token: str = "", eos_token: str = "") -> None:
        self.source = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _make_env().from_string(template)
        except jinja2.TemplateError as e:
            raise ValueError(f"invalid chat template: {e}") from e
        self._user_start: str | None = None

    @property
    def user_start(self) -> str:
        """The text that opens a user message after an assistant turn ("<|im_start|>user\n"),
        found by rendering a conversation with and without a last user message (llama.cpp's
        autoparser finds its message delimiters by such differential renders); "" when the
        template does not render that way. Context checkpoints are taken where it starts."""
        if self._user_start is None:
            self._user_start = ""
            turn = [{"role": "user", "content": "RXU1"}, {"role": "assistant", "content": "RXA1"}]
            try:
                head = self.render(turn, add_generation_prompt=False)
                full = self.render([*turn, {"role": "user", "content": "RXU2"}],
                                   add_generation_prompt=False)
            except ValueError:
                return ""
            at = full.find("RXU2", len(head))
            if full.startswith(head) and at > len(head):
                self._user_start = full[len(head) : at]
        return self._user_start

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader, tokenizer: Tokenizer) -> ChatTemplate:
        """The GGUF's `tokenizer.chat_template`; ChatML when absent or unparsable (as llama.cpp)."""
        field = reader.fields.get(gguf.Keys.Tokenizer.CHAT_TEMPLATE)

        def text(tid: int | None) -> str:
            return "" if tid is None else tokenizer.token_to_piece(tid).decode("utf-8", "replace")

        bos, eos = text(tokenizer.bos_id), text(tokenizer.eos_id)
        if field is None:
            logger.info("GGUF has no chat template; using ChatML")
            return cls(CHATML_TEMPLATE, bos, eos)
        try:
            return cls(str(field.contents()), bos, eos)
        except ValueError as e:
            logger.warning("%s; using ChatML instead", e)
            return cls(CHATML_TEMPLATE, bos, eos)

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render `messages` (OpenAI shape). `extra` becomes template variables (e.g. `tools`,
        `enable_thinking`); raises ValueError on bad messages or any template error."""
        msgs = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise ValueError(f"message {i} must be an object with a string 'role'")
            msgs.append({**message, "content": flatten_content(message.get("content"))})
        context = {
            "tools": None,
            "documents": None,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
            "messages": msgs,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e
        except (
            TypeError,
            AttributeError,
            KeyError,
            IndexError,
            ValueError,
            ZeroDivisionError,
        ) as e:
            raise ValueError(f"chat template error: {type(e).__name__}: {e}") from e
