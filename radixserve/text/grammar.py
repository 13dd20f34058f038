"""Constrained decoding with llguidance: GBNF, JSON schemas and Lark grammars -> token masks.

llguidance is llama.cpp's own optional grammar backend (its `%llguidance` grammars); it reads
llama.cpp's GBNF (converted to its Lark dialect), compiles JSON schemas directly, and computes a
vocabulary mask in tens of microseconds (measured in docs/PERFORMANCE.md), so the mask is
computed on the engine thread when the sampler asks for it.

Grammars are compiled and checked against the vocabulary when a request is parsed: a bad
grammar or schema is a ValueError naming the problem (HTTP 400) before any slot is touched.
A `Constraint` is the per-sequence state: what the grammar allows next, fed with each token.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import TYPE_CHECKING, Any

import llguidance as llg
from llguidance.gbnf_to_lark import gbnf_to_lark
import numpy as np
import torch

if TYPE_CHECKING:
    from radixserve.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_VOCABS: dict[int, tuple[Tokenizer, llg.LLTokenizer]] = {}


class _Vocab:
    """The tokenizer as llguidance's TokenizerWrapper reads it: every token's bytes, special
    (control) tokens marked with a leading 0xff as llguidance's llama.cpp binding marks them,
    and an encode function for the text a grammar forces."""

    def __init__(self, tok: Tokenizer) -> None:
        from radixserve.text.tokenizer import CONTROL, USER_DEFINED

        self._tok = tok
        self.eos_token_id = tok.eos_id
        self.bos_token_id = tok.bos_id
        tokens, special = [], []
        for i in range(tok.n_vocab):
            piece, kind = tok.token_to_piece(i, special=True), tok.token_type(i)
            if kind == CONTROL or (kind == USER_DEFINED and piece.startswith(b"<")
                                   and piece.endswith(b">")):
                piece = b"\xff" + piece
                special.append(i)
            tokens.append(piece)
        self.tokens = tokens
        self.special_token_ids = special

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_special=False, parse_special=False)


def ll_tokenizer(tok: Tokenizer) -> llg.LLTokenizer:
    """llguidance's view of `tok` (built once per tokenizer: ~0.1 s)."""
    with _LOCK:
        hit = _VOCABS.get(id(tok))
        if hit is not None and hit[0] is tok:
            return hit[1]
        eog = sorted(tok.eog_ids) or ([tok.eos_id] if tok.eos_id is not None else [])
        lt = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab(tok)), n_vocab=tok.n_vocab,
                             eos_token=eog or None)
        _VOCABS[id(tok)] = (tok, lt)
        return lt


# ------------------------------------------------------------------ compiling grammars


def from_gbnf(text: str) -> str:
    """A llama.cpp GBNF grammar (or a `%llguidance` Lark grammar, as llama.cpp routes those)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("grammar must be a non-empty string")
    if text.lstrip().startswith("%llguidance"):
        return from_lark(text)
    try:  # GBNF only (llguidance's own router would take a `start ::=` line for Lark)
        return llg.LLMatcher.grammar_from_lark(gbnf_to_lark(_rename_start(text)))
    except Exception as e:  # the converter raises bare Exceptions with a useful message
        raise ValueError(f"invalid grammar: {_first_line(e)}") from None


_GBNF_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*|[A-Za-z0-9_-]+|.',
                         re.DOTALL)


def _rename_start(text: str) -> str:
    """A GBNF rule may be called `start`, but the converter names `root` so in Lark: rename
    the user's (outside strings, character classes and comments) to an unused name."""
    tokens = _GBNF_TOKEN.findall(text)
    if "start" not in tokens:
        return text
    new = "start_"
    while new in tokens:
        new += "_"
    return "".join(new if t == "start" else t for t in tokens)


def from_lark(text: str) -> str:
    try:
        return llg.LLMatcher.grammar_from_lark(text)
    except Exception as e:
        raise ValueError(f"invalid grammar: {_first_line(e)}") from None


# JSON as `{"a": 1, "b": [1, 2]}`: one space after each separator and no other whitespace.
# llguidance's flexible whitespace is an ignored lexeme that may repeat without bound, and a
# small model sampled runs of tabs until n_predict (llama.cpp bounds each run; this bounds all)
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def from_json_schema(schema: Any) -> str:
    """A JSON schema (a dict, or its JSON text) as a grammar; `{}` means any JSON object
    (llama-server's rule for an empty schema)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid JSON schema: not JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"invalid JSON schema: must be an object, got {type(schema).__name__}")
    if schema == {}:
        schema = {"type": "object"}
    try:
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except Exception as e:
        raise ValueError(f"invalid JSON schema: {_first_line(e)}") from None


def check(grammar: str, tok: Tokenizer | None, what: str = "grammar") -> str:
    """`grammar` once llguidance accepts it for this vocabulary (None: for any) else a
    ValueError naming the problem ("invalid <what>: ..."); warnings are logged."""
    lt = None if tok is None else ll_tokenizer(tok)
    err, msgs = llg.LLMatcher.validate_grammar_with_warnings(grammar, lt)
    if err:
        raise ValueError(f"invalid {what}: {msgs[0] if msgs else 'rejected by llguidance'}")
    for m in msgs:
        log.warning("grammar: %s", m)
    return grammar


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ------------------------------------------------------------------ per-sequence state


class Constraint:
    """A sequence's grammar state: the tokens it allows next, advanced by each emitted one.

    The mask is computed on the engine thread when the head asks for it, once per position.
    Computing it in a worker thread during the forward (llguidance releases the GIL) was not
    measurably faster on 2 cores, where the forward already uses both (docs/PERFORMANCE.md).
    `done`: the grammar is complete and allows nothing but end-of-generation, so the sequence
    ends there (llama.cpp would sample the EOS the mask leaves; the text is the same)."""

    def __init__(self, grammar: str, tok: Tokenizer) -> None:
        self._m = llg.LLMatcher(ll_tokenizer(tok), grammar, log_level=0)
        if self._m.is_error():
            raise ValueError(f"invalid grammar: {self._m.get_error()}")
        self._n = tok.n_vocab
        self._mask: torch.Tensor | None = None

    def mask(self) -> torch.Tensor:
        """Allowed tokens, a bool tensor [n_vocab]."""
        if self._mask is None:
            bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8),
                                 bitorder="little")[: self._n]
            self._mask = torch.from_numpy(bits.view(np.bool_))
        return self._mask

    def allows(self, token: int) -> bool:
        return 0 <= token < self._n and bool(self.mask()[token])

    def accept(self, token: int) -> None:
        """Feed an emitted token. One the mask did not allow (a bug upstream) puts the
        matcher in error: logged, and the sequence ends (`done`) rather than run on
        unconstrained."""
        self._mask = None
        if not self._m.consume_token(token):
            log.error("grammar rejected token %d: %s", token, self._m.get_error())

    @property
    def done(self) -> bool:
        return self._m.is_stopped() or self._m.is_error()

    @property
    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""
