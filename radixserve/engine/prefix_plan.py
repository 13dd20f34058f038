"""Device-tier prefix sharing between slots (beyond the seeds: llama.cpp cannot do this).

When a new prompt shares a prefix with KV another slot already holds, the new slot takes those
cells with `seq_cp`: with unified KV the cells are shared, not copied (the pool counts
references, and `seq_add` copies a shared cell before shifting it); a partition gets a copy,
which is still cheaper than recomputing. When the other slot is still computing that prefix,
the new task waits for it rather than computing the same prefix twice on the same cores.
"""

from __future__ import annotations

import logging

from radixserve.cache.base import common_prefix
from radixserve.kv.pool import KVPool, OutOfCells
from radixserve.engine.slot import Slot, SlotState
from radixserve.engine.task import CompletionTask

log = logging.getLogger(__name__)
SHARE_MIN_TOKENS = 16  # shorter shared prefixes are not worth waiting (a step) for or copying


def waits_for_prefill(slots: list[Slot], task: CompletionTask) -> bool:
    """A prefilling slot will soon hold a prefix of this task's prompt that it lacks now."""
    if not task.cache_prompt:  # it will compute everything anyway
        return False
    for s in slots:
        if s.state is SlotState.PROCESSING_PROMPT and s.task is not task:
            n = common_prefix(s.prompt, task.prompt_tokens)
            if n >= SHARE_MIN_TOKENS and len(s.tokens) < n:  # wait until all of it is there
                return True
    return False


def share_prefix(pool: KVPool, slots: list[Slot], slot: Slot, prompt: list[int]) -> None:
    """Give `slot` the longest prefix of `prompt` another slot holds, if it beats its own."""
    own = common_prefix(slot.tokens, prompt)
    donor, n_best = None, own
    for s in slots:
        if s is not slot and s.tokens:
            n = common_prefix(s.tokens, prompt)
            if n > n_best:
                donor, n_best = s, n
    if donor is None or n_best - own < SHARE_MIN_TOKENS:
        return
    pool.seq_rm(slot.id)
    try:
        pool.seq_cp(donor.id, slot.id, 0, n_best)
    except OutOfCells:  # a partition too full for the copy: prefill instead
        slot.tokens = []
        return
    slot.tokens = prompt[:n_best]
    log.info("slot %d: sharing %d prompt tokens with slot %d", slot.id, n_best, donor.id)
