"""Pre-decode: how much of a new prompt the slot's own KV already covers (n_past).

n_past is the longest common prefix of the slot's tokens and the prompt, always leaving at
least one prompt token to evaluate (its logits give the first sampled token). With
`--cache-reuse N`, chunks of at least N tokens found further along the old KV are shifted left
onto the prompt (`seq_rm` the gap, `seq_add` the chunk, K re-rotated) instead of recomputed.
"""

from __future__ import annotations

import logging

from radixserve.cache.base import common_prefix
from radixserve.kv.pool import KVPool

log = logging.getLogger(__name__)


def pre_decode(pool: KVPool, seq: int, tokens: list[int], prompt: list[int],
               cache_prompt: bool, n_reuse: int) -> int:
    """Trim `seq`'s KV (and `tokens`, in place) to what the prompt reuses; returns n_past."""
    n_past = 0
    if cache_prompt:
        n_past = common_prefix(tokens, prompt)
        if n_reuse > 0:
            n_past = reuse_chunks(pool, seq, tokens, prompt, n_past, n_reuse)
    n_past = min(n_past, len(prompt) - 1)
    pool.seq_rm(seq, n_past)
    del tokens[n_past:]
    return n_past


def reuse_chunks(pool: KVPool, seq: int, cache: list[int], prompt: list[int], n_past: int,
                 n_reuse: int) -> int:
    """llama-server's --cache-reuse loop; `cache` is edited in place to match the shifted KV."""
    head_c = head_p = n_past
    while head_c < len(cache) and head_p < len(prompt):
        n = 0
        while (head_c + n < len(cache) and head_p + n < len(prompt)
               and cache[head_c + n] == prompt[head_p + n]):
            n += 1
        if n >= n_reuse:
            pool.seq_rm(seq, head_p, head_c)
            pool.seq_add(seq, head_c, head_c + n, head_p - head_c)
            cache[head_p : head_p + n] = cache[head_c : head_c + n]
            log.debug("reusing chunk with size %d, shifting KV cache [%d, %d) -> [%d, %d)",
                      n, head_c, head_c + n, head_p, head_p + n)
            n_past += n
            head_c += n
            head_p += n
        else:
            head_c += 1
    return n_past
