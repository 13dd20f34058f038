"""Drafts without a draft model: the text so far predicts its own continuation (llama.cpp's
`ngram-simple` and `ngram-mod`, common/ngram-map.cpp and common/ngram-mod.cpp, rule for rule).

Where answers quote their context (RAG, code edits, tool results echoed back) the tokens after
the last occurrence of the current n-gram are a good guess of what comes next, and a guess costs
nothing but the rows the target verifies alongside the token it had to compute anyway.

- `ngram_simple_draft`: stateless; the last `size_n` tokens (the sampled one included) are
  searched backwards in the sequence, and up to `size_m` tokens that followed the latest earlier
  occurrence are the draft (none shorter than `size_n`).
- `NgramMod`: one hash table shared by every slot (4M entries, as llama.cpp), mapping a hash of
  `n_match` tokens to the token that followed them; a draft chains lookups up to `n_max` tokens
  (none shorter than `n_min`). The table is reset when it is a quarter full, or after five
  steps in a row where a slot's drafts were mostly rejected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MASK64 = (1 << 64) - 1
MUL = 6364136223846793005


def ngram_simple_draft(tokens: Sequence[int], sampled: int, size_n: int, size_m: int
                       ) -> list[int]:
    """common_ngram_simple_draft: `tokens` the sequence's tokens, `sampled` the token just
    sampled (not in `tokens` yet)."""
    cur = len(tokens)
    if cur <= size_n + size_m + 1:
        return []
    pattern = list(tokens[cur - size_n + 1 :]) + [sampled]
    first = pattern[0]
    match = 0  # position 0 means no match, as there
    for j in range(cur - size_n - 1, 0, -1):
        if tokens[j] == first and list(tokens[j : j + size_n]) == pattern:
            match = j
            break
    if match == 0:
        return []
    n_copy = min(size_m, cur - (match + size_n))
    if n_copy < size_n:
        return []
    return list(tokens[match + size_n : match + size_n + n_copy])


@dataclass(slots=True)
class _SeqInfo:
    i_last: int = 0  # tokens before this position are in the table
    n_draft_last: int = 0  # length of the last draft (for the acceptance streak)
    n_low: int = 0  # consecutive steps with acceptance below a quarter


class NgramMod:
    EMPTY = -1
    SIZE = 4 * 1024 * 1024
    OCCUPANCY_RESET = 0.25

    def __init__(self, n_match: int, n_min: int, n_max: int, n_seq: int,
                 size: int = SIZE) -> None:
        self.n, self.n_min, self.n_max = n_match, n_min, n_max
        self.entries = np.full(size, self.EMPTY, dtype=np.int32)
        self.used = 0
        self.seqs = [_SeqInfo() for _ in range(n_seq)]

    def _idx(self, tokens: Sequence[int], i: int) -> int:
        h = 0
        for t in tokens[i : i + self.n]:
            h = (h * MUL + t) & MASK64
        return h % len(self.entries)

    def _add(self, tokens: Sequence[int], i: int) -> None:
        k = self._idx(tokens, i)
        if self.entries[k] == self.EMPTY:
            self.used += 1
        self.entries[k] = tokens[i + self.n]

    def reset(self) -> None:
        self.entries.fill(self.EMPTY)
        self.used = 0

    def begin(self, seq: int, prompt: Sequence[int]) -> None:
        """A new task on `seq`: its prompt's n-grams go into the table."""
        info = self.seqs[seq]
        info.i_last = info.n_draft_last = 0
        if len(prompt) < self.n:
            return
        for i in range(len(prompt) - self.n):
            self._add(prompt, i)
        info.i_last = len(prompt) - self.n
        if self.used / len(self.entries) > self.OCCUPANCY_RESET:
            self.reset()

    def draft(self, seq: int, tokens: Sequence[int], sampled: int, n_max: int) -> list[int]:
        info = self.seqs[seq]
        info.n_draft_last = 0
        cur, n = len(tokens), self.n
        if cur < n:
            return []
        if info.i_last + 32 < cur:  # new n-grams go in by chunks
            for i in range(info.i_last, cur - n):
                self._add(tokens, i)
            info.i_last = cur - n
        ctx = list(tokens[cur - n + 1 :]) + [sampled]
        out: list[int] = []
        for i in range(min(self.n_max, n_max)):
            t = int(self.entries[self._idx(ctx, i)])
            if t == self.EMPTY:
                if i < self.n_min:
                    return []
                break
            ctx.append(t)
            out.append(t)
        info.n_draft_last = len(out)
        return out

    def accept(self, seq: int, n_accepted: int) -> None:
        """The target accepted `n_accepted` tokens of the last draft: a streak of poor drafts
        means the table has gone stale."""
        info = self.seqs[seq]
        if info.n_draft_last <= 0:
            return
        if n_accepted / info.n_draft_last < 0.25:
            info.n_low += 1
            if info.n_low >= 5:
                self.reset()
                info.n_low = info.i_last = 0
        else:
            info.n_low = 0
