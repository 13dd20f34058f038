"""Pre-decode: how much of a new prompt the slot's own KV already covers.

n_past is the longest common prefix of the slot's tokens and the prompt, always leaving at
least one prompt token to evaluate (its logits give the first sampled token).

`--cache-reuse N` (llama-server): chunks of at least N tokens found further along the old KV
are shifted onto their place in the new prompt (`seq_rm` the rest, `seq_add` the chunk, K
re-rotated) instead of being recomputed. llama-server only shifts left, which covers text
removed from the middle of a prompt; we also shift right, which covers text inserted before a
reused tail. The tokens between reused chunks ("holes") are computed at their own positions:
causal masking by position keeps later chunks invisible to them. As in llama-server, a shifted
chunk keeps the KV it had, computed without the inserted/removed text: an approximation the
user asks for with the flag.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

from radixserve.cache.base import common_prefix
from radixserve.kv.pool import KVPool

log = logging.getLogger(__name__)
GRAM = 8  # index granularity for finding reusable chunks (verified and extended after lookup)
MAX_CANDIDATES = 8  # candidate chunk starts tried per prompt position


@dataclass(slots=True)
class PromptPlan:
    """What the prompt still needs: ranges of positions to compute, in order."""

    n_past: int  # contiguous prefix [0, n_past) already in the KV
    n_reused: int  # tokens reused in total (prefix + shifted chunks): timings.cache_n
    todo: list[tuple[int, int]] = field(default_factory=list)


def pre_decode(pool: KVPool, seq: int, tokens: list[int], prompt: list[int],
               cache_prompt: bool, n_reuse: int) -> PromptPlan:
    """Trim `seq`'s KV (and `tokens`, in place, to the contiguous prefix) to what the prompt
    reuses, and return the plan of what is left to compute."""
    n_past = common_prefix(tokens, prompt) if cache_prompt else 0
    n_past = min(n_past, len(prompt) - 1)
    chunks: list[tuple[int, int, int]] = []
    if cache_prompt and n_reuse > 0:
        chunks = find_chunks(tokens, prompt, n_past, n_reuse)
    place_chunks(pool, seq, n_past, chunks)
    covered = [(0, n_past)] + [(p, p + n) for _, p, n in chunks]
    if covered[-1][1] == len(prompt):  # the last prompt token is always evaluated
        p0, p1 = covered[-1]
        pool.seq_rm(seq, p1 - 1, p1)
        covered[-1] = (p0, p1 - 1)
    todo, at = [], 0
    for p0, p1 in covered:
        if p0 > at:
            todo.append((at, p0))
        at = max(at, p1)
    todo.append((at, len(prompt)))
    contiguous = todo[0][0]
    del tokens[contiguous:]
    tokens[:] = prompt[:contiguous]
    return PromptPlan(contiguous, sum(p1 - p0 for p0, p1 in covered), todo)


def find_chunks(cache: list[int], prompt: list[int], n_past: int, n_reuse: int
                ) -> list[tuple[int, int, int]]:
    """(cache start, prompt start, length) of chunks to reuse, in order, non-overlapping."""
    g = min(GRAM, n_reuse)
    index: dict[tuple[int, ...], list[int]] = {}
    for c in range(n_past, len(cache) - g + 1):
        index.setdefault(tuple(cache[c : c + g]), []).append(c)
    chunks = []
    head_c = head_p = n_past
    while head_p + g <= len(prompt) and head_c < len(cache):
        starts = index.get(tuple(prompt[head_p : head_p + g]), [])
        found = None
        for c in starts[bisect.bisect_left(starts, head_c):][:MAX_CANDIDATES]:
            n = common_prefix(cache[c : c + len(prompt) - head_p], prompt[head_p:])
            if n >= n_reuse:
                found = (c, n)
                break
        if found is None:
            head_p += 1
            continue
        c, n = found
        chunks.append((c, head_p, n))
        log.debug("reusing chunk with size %d, shifting KV cache [%d, %d) -> [%d, %d)",
                  n, c, c + n, head_p, head_p + n)
        head_c, head_p = c + n, head_p + n
    return chunks


def place_chunks(pool: KVPool, seq: int, n_past: int, chunks: list[tuple[int, int, int]]) -> None:
    """Drop every cell past n_past that no chunk keeps, then shift the chunks into place.

    Left shifts go left to right and right shifts right to left: no chunk ever lands on a
    position another chunk still occupies.
    """
    at = n_past
    for c, _, n in chunks:
        pool.seq_rm(seq, at, c)
        at = c + n
    pool.seq_rm(seq, at)
    for c, p, n in [ch for ch in chunks if ch[1] <= ch[0]]:
        pool.seq_add(seq, c, c + n, p - c)
    for c, p, n in reversed([ch for ch in chunks if ch[1] > ch[0]]):
        pool.seq_add(seq, c, c + n, p - c)
