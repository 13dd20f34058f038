"""Why a prompt missed: the `reuse` report of every completion (beside its `timings`), the log
at info level, the last one per slot in `/slots`.

A user whose agent recomputes its whole history at every step cannot see why from `cache_n`
alone. The report names the tier that served the prefix (`slot`: the slot's own KV, with
`--cache-reuse` chunks; `slot_share`: another slot's cells; `ram` or `disk`: the host tiers;
`none`), what it gave, the longest prefix any tier held, and, where the prompt left the best
cached sequence, that position with the two texts from there: a chat template that re-renders
earlier turns, tools listed in another order or a date in the system prompt show there as two
different texts at one position (docs/PROMPT_REUSE.md). Everything is measured within the
request's own `cache_salt`: another tenant's text is never shown, and KV held under another
salt counts as not held.

The probe is taken before the prefix planner touches the slot (so the slot's previous content
still counts as held), the tier after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.memory.holders import Holder
from radixserve.memory.key import PromptKey
from radixserve.memory.prefix_plan import PrefixPlan, Source
from radixserve.memory.tiers.base import PromptCache
from radixserve.memory.tiers.prefix import common_prefix
from radixserve.text.tokenizer import Tokenizer

EXCERPT_TOKENS = 16  # tokens of each text shown from the first difference on


@dataclass(slots=True, frozen=True)
class Reuse:
    """Where a prompt's reused prefix came from and, when less than the cache held or nothing
    was reused, why: a completion's `reuse`, the log and `/slots`."""

    tier: str  # slot, slot_share, ram, disk or none
    n_tokens: int  # prompt tokens it gave (timings.cache_n)
    n_held: int  # the longest prefix of the prompt any tier held (same cache_salt)
    first_diff: int | None  # where the prompt left the best cached sequence (None: it did not)
    cached_text: str | None  # that sequence's text from first_diff on (a short excerpt)
    prompt_text: str | None  # the prompt's text from first_diff on
    # why fewer than n_held tokens (less the last, always computed) were reused, where a model's
    # memory keeps a window (sliding attention, a recurrent state): "snapshot" (reuse stopped
    # at the latest context checkpoint at or before the held prefix's end), "window" (none
    # was usable: the window had left that prefix); None: not limited so
    limit: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(slots=True, frozen=True)
class Held:
    """The best cached sequence for a prompt: it holds the prompt's first `n` tokens, then
    continues with `more` ([]: it ends there, or nothing is held)."""

    n: int = 0
    more: tuple[int, ...] = ()

    def better_than(self, other: Held) -> bool:
        """Longer wins; of equals, one that continues (it explains where the prompt left)."""
        return self.n > other.n or (self.n == other.n and bool(self.more) and not other.more)


def probe(key: PromptKey, slots: Sequence[Holder], cache: PromptCache) -> Held:
    """What the slots and the host cache hold of the prompt `key`, in its namespace."""
    prompt = key.tokens
    best = Held()
    for s in slots:
        kv = s.kv
        if not len(kv) or kv.salt != key.ns or not kv.reusable:
            continue
        n = common_prefix(kv.tokens, prompt)
        h = Held(n, tuple(kv.tokens[n:n + EXCERPT_TOKENS]))
        if h.better_than(best):
            best = h
    n, more = cache.held(key, EXCERPT_TOKENS)
    h = Held(n, tuple(more))
    return h if h.better_than(best) else best


def tier_of(plan: PrefixPlan, from_disk: bool) -> str:
    if plan.restored:
        return "disk" if from_disk else "ram"
    if plan.source is Source.SLOT:
        return "slot_share"
    return "slot" if plan.n_reused else "none"


def report(held: Held, plan: PrefixPlan, prompt: Sequence[int], from_disk: bool,
           tok: Tokenizer, windowed: bool = False) -> Reuse:
    """`windowed`: the model's memory keeps a window (a held prefix is usable only where a
    snapshot or the window has it)."""
    diverged = bool(held.more) and held.n < len(prompt)
    d = held.n if diverged else None
    limit = None
    if windowed and plan.n_reused < min(held.n, len(prompt) - 1):
        limit = "snapshot" if plan.checkpoint is not None else "window"
    return Reuse(
        tier=tier_of(plan, from_disk), n_tokens=plan.n_reused, n_held=held.n, first_diff=d,
        cached_text=tok.decode(list(held.more)) if diverged else None,
        prompt_text=tok.decode(list(prompt[held.n:held.n + EXCERPT_TOKENS])) if diverged else None,
        limit=limit)


def describe(r: Reuse) -> str:
    """The report in one log line."""
    out = f"reuse: {r.tier} gave {r.n_tokens} tokens, longest held {r.n_held}"
    if r.limit is not None:
        out += f" (stopped at a {r.limit} boundary)"
    if r.first_diff is not None:
        out += (f"; the prompt differs at {r.first_diff}: cached {r.cached_text!r}, "
                f"prompt {r.prompt_text!r}")
    return out
