"""`--cache-reuse N` (llama-server): chunks of the slot's old KV that reappear further along a
new prompt, found here and shifted into place by the slot's KV owner instead of recomputed.

Chunks of at least N tokens found past the common prefix are moved (`seq_rm` the rest,
`seq_add` the chunk, K re-rotated) onto their place in the new prompt. llama-server only shifts
left, which covers text removed from the middle of a prompt; we also shift right, which covers
text inserted before a reused tail. The tokens between reused chunks ("holes") are computed at
their own positions: causal masking by position keeps later chunks invisible to them. As in
llama-server, a shifted chunk keeps the KV it had, computed without the inserted/removed text:
an approximation the user asks for with the flag.
"""

from __future__ import annotations

import bisect
import logging

from radixserve.memory.tiers.prefix import common_prefix

log = logging.getLogger(__name__)
GRAM = 8  # index granularity for finding reusable chunks (verified and extended after lookup)
MAX_CANDIDATES = 8  # candidate chunk starts tried per prompt position


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
