"""The prompt of a fill-in-the-middle request (/infill), laid out as llama-server's
`format_prompt_infill` (tools/server/server-common.cpp) lays it out.

With FIM_REP and FIM_SEP tokens, the repo-level pattern (https://arxiv.org/pdf/2409.12186):

    [FIM_REP]myproject\\n[FIM_SEP]{filename}\\n{text}...[FIM_SEP]filename\\n
    [FIM_PRE]{prefix}[FIM_SUF]{suffix}[FIM_MID]{prompt}

(without FIM_REP no repo line; without FIM_SEP each extra chunk is introduced by
"\\n\\n--- snippet ---\\n\\n" and no file line closes them). The prompt goes after the prefix,
before FIM_SUF; `--spm-infill` puts the suffix part first (Suffix/Prefix/Middle). BOS starts
the FIM part when the vocabulary adds BOS, after the extra context.

What fits: the last 3/4 of a batch of the prefix, the first `n_batch/4 - 2 - len(prompt)`
tokens of the suffix, and the last `n_ctx - n_batch - 2*n_predict` tokens of the extra context
(`n_predict` is the server's --n-predict, -1 by default).
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.text.tokenizer import Tokenizer

REPO_LINE = "myproject\n"  # llama-server's fixed project name (a TODO there)
FILE_LINE = "filename\n"  # and the current file's
SNIPPET = "\n\n--- snippet ---\n\n"  # the chunk separator without FIM_SEP


@dataclass(frozen=True, slots=True)
class ExtraChunk:
    """One `input_extra` entry: another file's text (filename "tmp" when the request names
    none)."""

    text: str
    filename: str = "tmp"


def missing_fim(tok: Tokenizer) -> str:
    """What the vocabulary lacks for /infill, in llama-server's words ("" when nothing)."""
    fim = tok.fim
    return "".join(f"{name} token is missing. " for name, tid in (
        ("prefix", fim.pre), ("suffix", fim.suf), ("middle", fim.mid)) if tid is None)


def format_prompt_infill(
    tok: Tokenizer, prefix: list[int], suffix: list[int], extra: list[ExtraChunk],
    n_batch: int, n_predict: int, n_ctx: int, spm_infill: bool, prompt: list[int],
) -> list[int]:
    """The /infill prompt tokens from the tokenized prefix, suffix and prompt and the extra
    chunks (tokenized here without special tokens, as llama-server does). The vocabulary must
    have FIM pre, suf and mid tokens (`missing_fim` is empty)."""
    fim = tok.fim
    assert fim.pre is not None and fim.suf is not None and fim.mid is not None, missing_fim(tok)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special=False, parse_special=False)

    extra_tokens: list[int] = []
    if fim.rep is not None:
        extra_tokens += [fim.rep, *encode(REPO_LINE)]
    for chunk in extra:
        if fim.sep is not None:
            extra_tokens += [fim.sep, *encode(chunk.filename + "\n")]
        else:
            extra_tokens += encode(SNIPPET)
        extra_tokens += encode(chunk.text)
    if fim.sep is not None:
        extra_tokens += [fim.sep, *encode(FILE_LINE)]

    # the FIM context fits a batch, prefix:suffix = 3:1 (C++ integer division, n_batch > 0)
    n_prefix_take = min(len(prefix), 3 * (n_batch // 4))
    n_suffix_take = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))

    prefix_part = [fim.pre, *prefix[len(prefix) - n_prefix_take:], *prompt]
    suffix_part = [fim.suf, *suffix[:n_suffix_take]]
    first, last = (suffix_part, prefix_part) if spm_infill else (prefix_part, suffix_part)
    bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    kept_extra = extra_tokens[len(extra_tokens) - n_extra_take:]
    return [*kept_extra, *bos, *first, *last, fim.mid]
