"""Which slot serves a task (llama-server's get_available_slot)."""

from __future__ import annotations

import logging

from radixserve.cache.base import common_prefix
from radixserve.engine.slot import Slot
from radixserve.engine.task import CompletionTask

log = logging.getLogger(__name__)


def choose_slot(slots: list[Slot], task: CompletionTask, thold: float) -> tuple[Slot | None, bool]:
    """id_slot if given; else the idle slot with the best LCP similarity above `thold`; else
    the least recently used idle slot (ties go to the later slot, as in llama-server).

    The flag says whether the slot's content should go to the host cache first: it would keep
    less than half of its tokens, or it was picked by LRU. The slot may be busy when the task
    named it: the caller then defers the task.
    """
    prompt = task.prompt_tokens
    if task.id_slot != -1:
        slot = slots[task.id_slot]
        keep = common_prefix(slot.tokens, prompt) / max(1, len(slot.tokens))
        return slot, not slot.tokens or keep < 0.5
    best, f_best = None, 0.0
    if thold > 0:
        for slot in slots:
            if slot.is_processing or not slot.tokens:
                continue
            f_sim = common_prefix(slot.tokens, prompt) / len(prompt)
            if f_sim > f_best and f_sim > thold:
                best, f_best = slot, f_sim
    if best is not None:
        f_keep = f_best * len(prompt) / len(best.tokens)
        log.debug("selected slot %d by LCP similarity, f_sim = %.3f, f_keep = %.3f",
                  best.id, f_best, f_keep)
        return best, f_keep < 0.5
    lru = None
    for slot in slots:
        if not slot.is_processing and (lru is None or slot.t_last_used <= lru.t_last_used):
            lru = slot
    return lru, True
