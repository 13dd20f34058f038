"""Pre-tokenizer regexes: llama.cpp's `llm_tokenizer_bpe` table, keyed by tokenizer.ggml.pre.

Several regexes are applied in turn, each splitting the pieces the previous one produced. The
split decides token ids, and prompt-cache hits depend on ids matching llama.cpp's exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# ---- pre-tokenizer regexes: llama.cpp's `llm_tokenizer_bpe` table, keyed by tokenizer.ggml.pre ----
# Several regexes are applied in turn, each splitting the pieces the previous one produced.

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
# Tekken and GPT-4o: llama.cpp rewrites these for std::regex; Oniguruma takes the originals.
_CASED = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+<C>"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*<C>"
)
_TEKKEN = _CASED.replace("<C>", "") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = (
    _CASED.replace("<C>", _CONTRACTIONS + "?")
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PORO = r" ?[^(\s|.,!?…。，、।۔،)]+"
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")


@dataclass(frozen=True, slots=True)
class PreTokenizerSpec:
    """How llama.cpp pre-splits text for one `tokenizer.ggml.pre` value."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is a whole token is emitted without merging
    add_bos: bool = False  # llama.cpp's default when the GGUF has no add_bos_token key


_PRE_GROUPS: tuple[tuple[tuple[str, ...], PreTokenizerSpec], ...] = (
    (("default",), PreTokenizerSpec(_DEFAULT)),
    (
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        PreTokenizerSpec((_LLAMA3,), ignore_merges=True, add_bos=True),
    ),
    (("dbrx", "smaug-bpe", "glm4", "chatglm-bpe"), PreTokenizerSpec((_LLAMA3,))),
    (
        ("qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan", "grok-2"),
        PreTokenizerSpec((_QWEN2,)),
    ),
    (
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
        PreTokenizerSpec((r"\p{N}", _GPT2)),
    ),
    (
        (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
        ),
        PreTokenizerSpec((_GPT2,)),
    ),
    (("falcon",), PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"))),
    (
        ("deepseek-coder",),
        PreTokenizerSpec(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}")),
    ),
    (("poro-chat", "bloom", "gpt3-finnish"), PreTokenizerSpec((_PORO,))),
    (("viking",), PreTokenizerSpec((_PORO, r"\p{N}"))),
    (("tekken",), PreTokenizerSpec((_TEKKEN,), ignore_merges=True, add_bos=True)),
    (("gpt-4o", "llama4", "minimax-m2"), PreTokenizerSpec((_GPT4O,))),
)
PRE_TOKENIZERS = {name: spec for names, spec in _PRE_GROUPS for name in names}


def pre_tokenizer_spec(pre: str | None) -> PreTokenizerSpec:
    """The spec for `tokenizer.ggml.pre`; unknown or missing values fall back to "default"."""
    if pre not in PRE_TOKENIZERS:
        logger.warning("missing or unrecognized pre-tokenizer type %r, using 'default'", pre)
        return PRE_TOKENIZERS["default"]
    return PRE_TOKENIZERS[pre]


