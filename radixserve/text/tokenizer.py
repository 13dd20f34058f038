"""Tokenizer built from a GGUF vocabulary, behaving as llama.cpp's `llama_vocab` does.

The GGUF carries no `tokenizer.json`, only `tokenizer.ggml.*` metadata. We rebuild the
tokenizer llama.cpp would use from it, so that a prompt gets the same token ids here as in
llama-server (prompt-cache hits depend on ids matching exactly):

- special tokens (CONTROL / USER_DEFINED / UNKNOWN types) are cut out of the text first,
  longest token first, as `tokenizer_st_partition` does; USER_DEFINED ones always, CONTROL and
  UNKNOWN ones only with `parse_special`;
- the remaining text goes to HF `tokenizers` (Rust, fast): byte-level BPE with the
  pre-tokenizer regexes llama.cpp uses for `tokenizer.ggml.pre` ("gpt2"), or SentencePiece-style
  BPE with byte fallback and merges derived from the scores ("llama");
- pieces, BOS/EOS/EOT and the end-of-generation set follow llama.cpp's rules.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import gguf
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from radixserve.text.pretokenize import PreTokenizerSpec, pre_tokenizer_spec

logger = logging.getLogger(__name__)

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = (int(t) for t in gguf.TokenType)
_SPM_SPACE = "\u2581"  # "▁": SentencePiece's visible space

# Texts llama.cpp recognises as end-of-turn / end-of-generation / FIM tokens (llama-vocab.cpp).
_EOT_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)
_EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
)
_HARMONY_MARKUP = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
# FIM tokens in llama.cpp's order (pre, suf, mid, pad, rep, sep): the GGUF key, the deprecated
# key that overrides it when present (tokenizer.ggml.prefix_token_id...), and the texts searched
# for when neither names a token in the vocabulary
_FIM_TEXTS = {
    gguf.Keys.Tokenizer.FIM_PRE_ID: (
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
        "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>",
    ),
    gguf.Keys.Tokenizer.FIM_SUF_ID: (
        "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
        "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>",
    ),
    gguf.Keys.Tokenizer.FIM_MID_ID: (
        "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
        "\u2581<MID>", "<|code_middle|>", "<|middle|>",
    ),
    gguf.Keys.Tokenizer.FIM_PAD_ID: ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    gguf.Keys.Tokenizer.FIM_REP_ID: (
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
    ),
    gguf.Keys.Tokenizer.FIM_SEP_ID: ("<|file_sep|>",),
}
_FIM_DEPRECATED = {
    gguf.Keys.Tokenizer.FIM_PRE_ID: gguf.Keys.Tokenizer.PREFIX_ID,
    gguf.Keys.Tokenizer.FIM_SUF_ID: gguf.Keys.Tokenizer.SUFFIX_ID,
    gguf.Keys.Tokenizer.FIM_MID_ID: gguf.Keys.Tokenizer.MIDDLE_ID,
}


@dataclass(frozen=True, slots=True)
class FimTokens:
    """The fill-in-the-middle token ids of a vocabulary (None: it has none), as llama.cpp's
    `llama_vocab_fim_*` give them: /infill needs pre, suf and mid; rep and sep give the
    repo-level layout; pad, rep and sep end generation."""

    pre: int | None = None
    suf: int | None = None
    mid: int | None = None
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (byte-level BPE token spelling)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


_UNICODE_TO_BYTE = {c: b for b, c in _byte_alphabet().items()}


@dataclass(slots=True)
class GGUFVocab:
    """The `tokenizer.ggml.*` metadata of a GGUF file (None where the file has no such key)."""

    model: str
    tokens: list[str]
    token_types: list[int] | None = None
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = None
    special_ids: dict[str, int] = field(default_factory=dict)  # GGUF key -> token id
    add_bos: bool | None = None
    add_eos: bool | None = None
    add_space_prefix: bool | None = None

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> GGUFVocab:
        def get(key: str) -> Any:
            f = reader.fields.get(key)
            return None if f is None else f.contents()

        k = gguf.Keys.Tokenizer
        if get(k.MODEL) is None or get(k.LIST) is None:
            raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.model / .tokens missing)")
        id_keys = (k.BOS_ID, k.EOS_ID, k.EOT_ID, k.EOM_ID, k.UNK_ID, *_FIM_TEXTS,
                   *_FIM_DEPRECATED.values())
        return cls(
            model=get(k.MODEL),
            tokens=get(k.LIST),
            token_types=get(k.TOKEN_TYPE),
            scores=get(k.SCORES),
            merges=get(k.MERGES),
            pre=get(k.PRE),
            special_ids={key: int(get(key)) for key in id_keys if get(key) is not None},
            add_bos=get(k.ADD_BOS),
            add_eos=get(k.ADD_EOS),
            add_space_prefix=get(k.ADD_PREFIX),
        )


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary (see the module docstring for the rules)."""

    def __init__(self, vocab: GGUFVocab) -> None:
        self.vocab = vocab
        self.model = vocab.model
        self.n_vocab = len(vocab.tokens)
        # llama.cpp renames empty tokens so every text is unique.
        self._texts = [t or f"[EMPTY_{i}]" for i, t in enumerate(vocab.tokens)]
        self._types = list(vocab.token_types or [NORMAL] * self.n_vocab)
        self._ids: dict[str, int] = {}
        for i, text in enumerate(self._texts):
            self._ids.setdefault(text, i)
        if len(self._ids) != self.n_vocab:
            logger.warning("%d duplicate token texts in vocabulary", self.n_vocab - len(self._ids))
        if self.model == "gpt2":
            spec = pre_tokenizer_spec(vocab.pre)
            default_bos, default_eos, default_unk = 11, 11, None
            add_bos, add_space_prefix = spec.add_bos, False
        elif self.model == "llama":
            spec = None
            default_bos, default_eos, default_unk = 1, 2, 0
            add_bos, add_space_prefix = True, True
        else:
            raise ValueError(f"unsupported tokenizer model {self.model!r} (supported: gpt2, llama)")
        self.add_bos = add_bos if vocab.add_bos is None else bool(vocab.add_bos)
        self.add_eos = False if vocab.add_eos is None else bool(vocab.add_eos)
        self.add_space_prefix = (
            add_space_prefix if vocab.add_space_prefix is None else bool(vocab.add_space_prefix)
        )
        k = gguf.Keys.Tokenizer
        self.bos_id = self._special(k.BOS_ID, default_bos)
        self.eos_id = self._special(k.EOS_ID, default_eos)
        self.unk_id = self._special(k.UNK_ID, default_unk)
        self.eot_id = self._special_or_text(k.EOT_ID, _EOT_TEXTS)
        self.eom_id = self._special_or_text(k.EOM_ID, ("<|eom_id|>",))
        # each id to its field by the key's name (tokenizer.ggml.fim_pre_token_id -> pre)
        self.fim = FimTokens(**{key.split(".fim_")[1].split("_")[0]: self._fim_id(key, texts)
                                for key, texts in _FIM_TEXTS.items()})
        self._eog_ids = self._build_eog_set()
        # Special tokens cut out of the text before tokenizing, longest text first.
        self._specials = sorted(
            (i for i, t in enumerate(self._types) if t in (CONTROL, USER_DEFINED, UNKNOWN)),
            key=lambda i: -len(self._texts[i]),
        )
        self._pieces = [self._piece(i) for i in range(self.n_vocab)]
        self._hf = self._build_bpe(spec)

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        return cls(GGUFVocab.from_gguf(reader))

    # ---- construction helpers --------------------------------------------------------------

    def _special(self, key: str, default: int | None) -> int | None:
        tid = self.vocab.special_ids.get(key, default)
        if tid is not None and not 0 <= tid < self.n_vocab:
            logger.warning(
                "bad special token %s = %d (n_vocab %d); ignored", key, tid, self.n_vocab
            )
            tid = default if default is not None and default < self.n_vocab else None
        return tid

    def _special_or_text(self, key: str, texts: Sequence[str]) -> int | None:
        """The id the GGUF gives under `key`, else the first token spelled as one of `texts`
        (llama.cpp's text auto-detection, which also forces such a token to CONTROL)."""
        tid = self._special(key, None)
        if tid is not None:
            return tid
        for text in texts:
            tid = self._ids.get(text)
            if tid is not None:
                self._types[tid] = CONTROL
                return tid
        return None

    def _fim_id(self, key: str, texts: Sequence[str]) -> int | None:
        """A FIM token as llama-vocab.cpp finds it: the GGUF's key, overridden by its deprecated
        key when that names a token in range, else the text search (`_special_or_text`). Where
        several of `texts` are in the vocabulary llama.cpp takes whichever its hash map yields
        first; the first in `texts` here."""
        old = _FIM_DEPRECATED.get(key)
        if old is not None and (tid := self._special(old, None)) is not None:
            return tid
        return self._special_or_text(key, texts)

    def _build_eog_set(self) -> frozenset[int]:
        eog = {self.fim.pad, self.fim.rep, self.fim.sep}
        for text in _EOG_TEXTS:
            tid = self._ids.get(text)
            if tid is not None:
                self._types[tid] = CONTROL
                eog.add(tid)
        eog |= {self.eos_id, self.eot_id, self.eom_id}
        # gpt-oss (harmony): its message markup is text the chat parser reads, so it is always
        # rendered and parsed, and `<|end|>` only closes a message (`<|return|>` and `<|call|>`
        # end the reply): the model goes on after its analysis message
        for text in _HARMONY_MARKUP:
            if (tid := self._ids.get(text)) is not None:
                self._types[tid] = USER_DEFINED
        end, ret, call = (self._ids.get(t) for t in ("<|end|>", "<|return|>", "<|call|>"))
        if None not in (end, ret, call) and {end, ret, call} <= eog:
            eog.discard(end)
            self._types[end] = USER_DEFINED
        return frozenset(i for i in eog if i is not None)

    def _piece(self, tid: int) -> bytes:
        """A token's bytes as llama.cpp's `token_to_piece(special=true)` renders them."""
        text, ttype = self._texts[tid], self._types[tid]
        if ttype in (CONTROL, UNKNOWN, USER_DEFINED):
            return text.encode()
        if ttype == NORMAL:
            if self.model == "gpt2":  # undo the byte-level spelling; foreign chars stay UTF-8
                return b"".join(
                    bytes([_UNICODE_TO_BYTE[c]]) if c in _UNICODE_TO_BYTE else c.encode()
                    for c in text
                )
            return text.replace(_SPM_SPACE, " ").encode()
        if ttype == BYTE and self.model == "llama":
            return bytes([int(text[3:5], 16)])
        return b""  # UNUSED / undefined types render as nothing

    def _build_bpe(self, spec: PreTokenizerSpec | None) -> HFTokenizer:
        vocab = self._ids
        if spec is not None:
            pairs = [
                (m[: m.find(" ", 1)], m[m.find(" ", 1) + 1 :]) for m in self.vocab.merges or []
            ]
            merges = [(a, b) for a, b in pairs if a in vocab and b in vocab and a + b in vocab]
            if len(merges) != len(pairs):
                logger.warning(
                    "%d merges reference unknown tokens; dropped", len(pairs) - len(merges)
                )
            bpe = models.BPE(vocab, merges, ignore_merges=spec.ignore_merges)
            hf = HFTokenizer(bpe)
            splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
            hf.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
            return hf
        unk = self._texts[self.unk_id] if self.unk_id is not None else None
        return HFTokenizer(
            models.BPE(vocab, self._spm_merges(vocab), unk_token=unk, byte_fallback=True)
        )

    def _spm_merges(self, vocab: dict[str, int]) -> list[tuple[str, str]]:
        """Merges implied by a scored vocabulary: every split of a token into two tokens.

        llama.cpp's SPM tokenizer repeatedly merges the adjacent pair whose concatenation is the
        highest-scoring token; BPE with merges ranked by that score does the same.
        """
        scores = self.vocab.scores or [0.0] * self.n_vocab
        ranked: list[tuple[float, int, str, str]] = []
        for text, tid in vocab.items():
            if self._types[tid] == BYTE:
                continue
            for cut in range(1, len(text)):
                left, right = text[:cut], text[cut:]
                if left in vocab and right in vocab:
                    ranked.append((-scores[tid], tid, left, right))
        ranked.sort()
        return [(a, b) for _, _, a, b in ranked]

    # ---- public API --------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; BOS/EOS added only when `add_special` and the GGUF asks for them."""
        ids: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            ids.append(self.bos_id)
        prev_special = True  # SPM: a space is prefixed to text at the start or after a special
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                ids.append(frag)
                prev_special = True
                continue
            if self.model == "llama":
                frag = " " + frag if self.add_space_prefix and prev_special else frag
                frag = frag.replace(" ", _SPM_SPACE)
            ids.extend(self._hf.encode(frag, add_special_tokens=False).ids)
            prev_special = False
        if add_special and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split `text` into raw-text fragments and special token ids (llama.cpp's order)."""
        frags: list[str | int] = [text] if text else []
        for tid in self._specials:
            if not parse_special and self._types[tid] != USER_DEFINED:
                continue
            special = self._texts[tid]
            if special not in text:
                continue
            out: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or special not in frag:
                    out.append(frag)
                    continue
                for n, part in enumerate(frag.split(special)):
                    if n:
                        out.append(tid)
                    if part:
                        out.append(part)
            frags = out
        return frags

    def token_to_piece(self, tid: int, special: bool = True) -> bytes:
        """Raw bytes of one token (may be a partial UTF-8 sequence). Control/unknown tokens
        render as their text when `special`, else as nothing (llama.cpp `token_to_piece`)."""
        self._check(tid)
        if not special and self._types[tid] in (CONTROL, UNKNOWN):
            return b""
        return self._pieces[tid]

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids` as llama.cpp's `detokenize(remove_special=skip_special,
        unparse_special=not skip_special)`, without its `clean_spaces` rewriting."""
        ids = list(ids)
        remove_space = self.add_space_prefix
        if skip_special and self.add_bos and ids and ids[0] == self.bos_id:
            ids, remove_space = ids[1:], False
        if skip_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        pieces = [self.token_to_piece(t, special=not skip_special) for t in ids]
        if remove_space and pieces and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        return b"".join(pieces).decode("utf-8", errors="replace")

    def token_text(self, tid: int) -> str:
        """The token's text as stored in the GGUF (byte-level / "▁" spelling)."""
        self._check(tid)
        return self._texts[tid]

    def token_type(self, tid: int) -> int:
        """The token's `gguf.TokenType` value (after llama.cpp's CONTROL overrides)."""
        self._check(tid)
        return self._types[tid]

    def is_eog(self, tid: int) -> bool:
        """True for tokens that end generation (EOS, EOT, EOM, `<|im_end|>`-like, FIM ends)."""
        return tid in self._eog_ids

    @property
    def eog_ids(self) -> frozenset[int]:
        return self._eog_ids

    def _check(self, tid: int) -> None:
        if not 0 <= tid < self.n_vocab:
            raise ValueError(f"token id {tid} out of range [0, {self.n_vocab})")
