"""Where a prompt's prefix comes from: one decision, made here.

A new prompt's KV may already exist in four places, and every reuse decision of the engine is
taken in this module from one measure (the longest common prefix, `common_prefix`):

- which slot serves the task (`choose_slot`: llama-server's get_available_slot);
- whether the task should wait for a slot that is computing its prefix right now
  (`pending_prefill`) rather than compute the same prefix twice on the same cores;
- where each range of the prompt comes from (`plan_prefix`): the slot's own KV (n_past, plus
  `--cache-reuse` chunks shifted into place), another slot's cells (device-tier sharing, beyond
  llama.cpp: `seq_cp` shares cells in unified KV, copies them in a partition), the host prompt
  cache, or compute. The last prompt token is always computed: its logits give the first
  sampled token. With a sliding window, a slot's prefix counts only as far as its window (or one
  of its context checkpoints) has the keys the next token reads (`SlotKV.usable_prefix`).

`apply_plan` carries a plan out through the slot's KV owner; when a source fails (a restore
fault, no room for a copy) the caller plans again without it.

Cache namespaces (a request's `cache_salt`, the `ns` of its `PromptKey`): every common prefix
measured here counts 0 between a slot's KV (`SlotKV.salt`) and a prompt of another namespace
(`salted_lcp`, also what the manager's disk lookup measures; the same test guards the own prefix, its chunks and the
prefills worth waiting for), so no choice (slot, wait, own prefix, chunks, donor) ever reuses
or favours another tenant's KV; the host cache is asked within the salt.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from radixserve.memory.checkpoint import Checkpoint
from radixserve.memory.chunk_reuse import find_chunks
from radixserve.memory.holders import Holder, Request
from radixserve.memory.key import PromptKey
from radixserve.memory.seq_kv import SlotKV
from radixserve.memory.tiers.base import PromptCache
from radixserve.memory.tiers.prefix import common_prefix

log = logging.getLogger(__name__)
SHARE_MIN_TOKENS = 16  # shorter shared prefixes are not worth waiting (a step) for or copying


class Source(enum.Enum):
    OWN = "own"  # the slot's own KV (a chunk of it shifted, with --cache-reuse)
    SLOT = "slot"  # another slot's cells
    HOST = "host"  # the host prompt cache
    COMPUTE = "compute"


@dataclass(slots=True, frozen=True)
class Span:
    """Prompt positions [p0, p1) and where their KV comes from; `src_pos`: where an OWN span's
    KV sits in the slot now (!= p0 for a shifted chunk)."""

    p0: int
    p1: int
    source: Source
    src_pos: int = 0


@dataclass(slots=True)
class PrefixPlan:
    spans: list[Span]  # in order, covering the whole prompt; the last one computes
    source: Source  # where [0, n_prefix) comes from
    n_prefix: int = 0
    donor: Holder | None = None  # the slot a SLOT prefix comes from
    # to restore first for an OWN prefix (sliding window), or into the slot after a SLOT
    # prefix's rows (a recurrent state kept whole: the donor's checkpoint)
    checkpoint: Checkpoint | None = None
    restored: int = 0  # tokens a host restore gave (the plan then names them the slot's own)

    @property
    def n_reused(self) -> int:
        """Prompt tokens not computed (timings.cache_n)."""
        return sum(s.p1 - s.p0 for s in self.spans if s.source is not Source.COMPUTE)

    @property
    def todo(self) -> list[tuple[int, int]]:
        """Position ranges to compute, in order."""
        return [(s.p0, s.p1) for s in self.spans if s.source is Source.COMPUTE]

    @property
    def chunks(self) -> list[tuple[int, int, int]]:
        """(slot position, prompt position, length) of the own KV to shift past the prefix."""
        return [(s.src_pos, s.p0, s.p1 - s.p0) for s in self.spans
                if s.source is Source.OWN and s.p0 >= self.n_prefix]


def salted_lcp(kv: SlotKV, key: PromptKey) -> int:
    """Tokens of the prompt `key` the slot's KV holds as a prefix: 0 across namespaces (that KV
    must neither serve the prompt nor steer a choice by it)."""
    return common_prefix(kv.tokens, key.tokens) if kv.salt == key.ns else 0


def choose_slot(slots: Sequence[Holder], task: Request, thold: float) -> tuple[Holder | None, bool]:
    """id_slot if given; else the idle slot with the best LCP similarity above `thold`; else
    the least recently used idle slot (ties go to the later slot, as in llama-server).

    The flag says whether the slot's content should go to the host cache first: it would keep
    less than half of its tokens, or it was picked by LRU. The slot may be busy when the task
    named it: the caller then defers the task.
    """
    key = task.key
    prompt = key.tokens
    if task.id_slot != -1:
        slot = slots[task.id_slot]
        keep = salted_lcp(slot.kv, key) / max(1, len(slot.kv))
        return slot, not len(slot.kv) or keep < 0.5
    best, f_best = None, 0.0
    if thold > 0:
        for slot in slots:
            if slot.is_processing or not len(slot.kv):
                continue
            f_sim = salted_lcp(slot.kv, key) / len(prompt)
            if f_sim > f_best and f_sim > thold:
                best, f_best = slot, f_sim
    if best is not None:
        f_keep = f_best * len(prompt) / len(best.kv)
        log.debug("selected slot %d by LCP similarity, f_sim = %.3f, f_keep = %.3f",
                  best.id, f_best, f_keep)
        return best, f_keep < 0.5
    lru = None
    for slot in slots:
        if not slot.is_processing and (lru is None or slot.t_last_used <= lru.t_last_used):
            lru = slot
    return lru, True


def pending_prefill(slots: Sequence[Holder], task: Request) -> Holder | None:
    """A prefilling slot that will soon hold a prefix of this task's prompt it lacks now."""
    if not task.cache_prompt:  # it will compute everything anyway
        return None
    for s in slots:
        # its KV was claimed for its task's salt at launch: another salt's prefix is no reason
        if (s.prefilling and s.task is not task
                and s.kv.salt == task.key.ns):
            n = common_prefix(s.prompt, task.key.tokens)
            # wait until all of it is there (the last prompt token is always computed anyway)
            if n >= SHARE_MIN_TOKENS and len(s.kv) < min(n, len(task.key) - 1):
                return s
    return None


def plan_prefix(slot: Holder, key: PromptKey, donors: Sequence[Holder],
                host: PromptCache | None, cache_prompt: bool, n_reuse: int,
                prefer: Holder | None = None) -> PrefixPlan:
    """The best source for the prompt's prefix, then `--cache-reuse` chunks, then compute.

    The host cache (when given) wins over the slot's own KV when it restores more; another
    slot wins when it holds SHARE_MIN_TOKENS more than both (`prefer`, the slot of an n_cmpl
    parent: when it holds as much). A slot whose KV was context-shifted is never a source, nor
    is KV (own, another slot's, host-cached) of a cache namespace other than the prompt's.
    """
    prompt, n = key.tokens, len(key)
    if not cache_prompt:
        return PrefixPlan([Span(0, n, Source.COMPUTE)], Source.COMPUTE)
    kv = slot.kv
    own = kv.reusable and kv.salt == key.ns
    n_lcp = common_prefix(kv.tokens, prompt) if own else 0
    n_own, ckpt = kv.usable_prefix(min(n_lcp, n - 1))
    if n_lcp and not n_own:
        log.info("slot %d: %d tokens in common, but no cache data for them (sliding window, no "
                 "checkpoint): full prompt re-processing unless another tier has them",
                 kv.seq, n_lcp)
    source, n_src, donor = Source.OWN, n_own, None
    if host is not None:
        # capped as the slots' counts are: the last prompt token is always computed
        n_host = min(host.match(kv.pool, kv.seq, kv.offered(key), key), n - 1)
        if n_host > n_src:
            source, n_src = Source.HOST, n_host
    n_best, donor_ck = 0, None
    # a recurrent state kept whole is shared through the donor's checkpoint too (its rows,
    # then the checkpoint's state); other windows only as they stand
    via_ck = not kv.pool.layout.rows_every_position
    for other in donors:
        ok = other is not slot and len(other.kv) and other.kv.reusable
        m = salted_lcp(other.kv, key) if ok else 0
        m, via = other.kv.usable_prefix(min(m, n - 1))
        m = 0 if via is not None and not via_ck else m
        if m > n_best or (m and m == n_best and other is prefer):
            donor, n_best, donor_ck = other, m, via
    # an n_cmpl parent's cells are shared, not copied, wherever they hold as much
    min_gain = 0 if donor is not None and donor is prefer else SHARE_MIN_TOKENS
    if donor is not None and n_best - n_src >= min_gain:
        source, n_src = Source.SLOT, n_best
    else:
        donor = None
    n_prefix = min(n_src, n - 1)
    if n_prefix == 0:
        source = Source.OWN  # nothing reused up front (own chunks may still follow)
    spans = [Span(0, n_prefix, source)] if n_prefix else []
    if source is Source.OWN and n_reuse > 0 and own:
        spans += [Span(p, p + m, Source.OWN, c)
                  for c, p, m in find_chunks(list(kv.tokens), prompt, n_prefix, n_reuse)]
    if spans and spans[-1].p1 == n:  # the last prompt token is always computed
        last = spans.pop()
        if last.p1 - 1 > last.p0:
            spans.append(Span(last.p0, last.p1 - 1, last.source, last.src_pos))
    out, at = [], 0
    for s in spans:
        if s.p0 > at:
            out.append(Span(at, s.p0, Source.COMPUTE))
        out.append(s)
        at = s.p1
    out.append(Span(at, n, Source.COMPUTE))
    via = ckpt if source is Source.OWN else donor_ck if source is Source.SLOT else None
    return PrefixPlan(out, source, n_prefix, donor if source is Source.SLOT else None,
                      via if n_prefix else None)


def apply_plan(kv: SlotKV, plan: PrefixPlan, key: PromptKey, host: PromptCache | None) -> bool:
    """Carry out `plan` through the slot's KV owner; False when its source failed (the slot
    then holds nothing; or what it held, for a legacy restore that failed its checks; or its
    prefix, for a shift without room).

    HOST only restores the cache's entry: a legacy entry may continue past the common prefix
    with chunks `--cache-reuse` can use, so the rest is planned again from the slot's own KV.
    A HOST restore reads from the prompt's namespace.
    """
    if plan.source is Source.HOST:
        assert host is not None
        if not kv.restore_from(host, key):
            return False
        log.info("slot %d: restored %d tokens from the %s cache", kv.seq, len(kv), host.name)
        return True
    if plan.source is Source.SLOT:
        assert plan.donor is not None
        if not kv.share_from(plan.donor.kv, plan.n_prefix, plan.checkpoint):
            return False
        log.info("slot %d: sharing %d prompt tokens with slot %d", kv.seq, plan.n_prefix,
                 plan.donor.id)
        return True
    if kv.pool.layout.needs_checkpoints:  # no chunks to shift: the window (or a checkpoint)
        return kv.keep_prefix(plan.n_prefix, plan.checkpoint)
    return kv.shift_chunks(key.tokens, plan.n_prefix, plan.chunks)


def take_prefix(slot: Holder, key: PromptKey, slots: Sequence[Holder],
                host: PromptCache | None, cache_prompt: bool, n_reuse: int,
                prefer: Holder | None = None) -> PrefixPlan:
    """Plan where the prompt's prefix comes from and make the slot hold it. A source that fails
    (a restore fault, no room for a copy or a shift) is left out and the plan made again; after
    a restore, the rest is planned from what the slot now holds. Returns the plan carried out;
    the slot's KV then belongs to the prompt's namespace (its `cache_salt`): this is where a
    slot's KV starts belonging to a task."""
    donors, restored = slots, 0
    while True:
        plan = plan_prefix(slot, key, donors, host, cache_prompt, n_reuse, prefer)
        done = apply_plan(slot.kv, plan, key, host)
        if plan.source is Source.HOST:
            host = None
            if done:
                donors = []  # decided against them already: what the slot holds now is better
                restored = len(slot.kv)
            continue
        if done:
            slot.kv.claim(key)
            plan.restored = min(restored, plan.n_prefix)
            return plan
        if plan.source is Source.SLOT:
            donors = []
        else:  # a shift ran out of cells: the slot kept its prefix, plan without chunks
            n_reuse = 0
