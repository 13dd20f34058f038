"""`cache_salt` (vLLM's request field): requests of different salts never share a cached prefix
in any tier, and a shared salt (or none, the shared namespace "") hits as before.

First the planner and the legacy host cache on fake KV (every decision that measures a common
prefix: own KV, `--cache-reuse` chunks, another slot's cells, waiting for a prefill, slot
choice, host entries). Then each tier on the default model through the real scheduler: the
reused token counts (`timings.cache_n`) are exactly 0 across salts and the expected count
within one, and every answer, donors' included, is the one its prompt gives alone with no
cache (deterministic mode: cached == uncached to the bit).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from radixserve.memory.key import PromptKey
from radixserve.bench.scenarios import make_text
from radixserve.memory.tiers.legacy import LegacyPromptCache
from radixserve.config import ServerConfig
from radixserve.engine.counters import ServerMetrics
from radixserve.memory.prefix_plan import Source, choose_slot, pending_prefill, take_prefix
from radixserve.engine.build import build_scheduler
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.slot import Slot
from radixserve.memory.seq_kv import SlotKV
from radixserve.engine.task import CompletionTask, FinalResult
from radixserve.memory.pool.pool import KVPool
from radixserve.memory.pool.state import fingerprint_of
from radixserve.model.loader import Model
from radixserve.sampling.chain import SamplingParams
from tests.engine.test_deterministic import run_to_end

# -- the planner and the legacy cache on fake KV (K row = the token id) ------------------------


def slots_with(*contents: tuple[list[int], str], n_cells: int = 256) -> list[Slot]:
    """Slots over one unified pool; slot i holds contents[i] = (tokens, salt)."""
    pool = KVPool(1, 1, 2, n_cells, max(2, len(contents)), True, torch.float32, lambda k, d: k)
    slots = [Slot(SlotKV(pool, i), n_cells) for i in range(pool.n_seq)]
    for s, (tokens, salt) in zip(slots, contents):
        if tokens:
            k = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1).repeat(1, 1, 1, 2)
            s.kv.load_rows(list(tokens), k, -k)
        s.kv.salt = salt  # as if a task of that salt had computed them
    return slots


def plan(slot: Slot, prompt: list[int], salt: str, donors: list[Slot] | None = None,
         host: Any = None, n_reuse: int = 0) -> Any:
    """take_prefix, then every invariant: the slot holds exactly the plan's reused KV, in the
    prompt's namespace."""
    p = take_prefix(slot, PromptKey(salt, prompt), donors or [], host, True, n_reuse)
    slot.kv.check()
    slot.kv.pool.check()
    assert sum(p1 - p0 for p0, p1 in p.todo) + slot.kv.n_held == len(prompt)
    assert slot.kv.salt == salt
    return p


A, B, X = list(range(100, 120)), list(range(200, 240)), list(range(300, 306))


def test_own_kv_and_cache_reuse_chunks_only_within_the_salt() -> None:
    (slot,) = slots_with((A + X + B, "a"))[:1]
    p = plan(slot, A + B + [1], "b", n_reuse=4)  # prefix and a shiftable chunk: another salt's
    assert p.n_reused == 0 and p.todo == [(0, 61)] and len(slot.kv) == 0
    (slot,) = slots_with((A + X + B, "a"))[:1]
    p = plan(slot, A + B + [1], "a", n_reuse=4)
    assert p.n_reused == 60 and p.todo == [(60, 61)]  # A kept, B shifted into place
    (slot,) = slots_with((A + B, ""))[:1]
    assert plan(slot, A + B + [1], "").n_reused == 60  # no salt: as before
    (slot,) = slots_with((A + B, ""))[:1]
    assert plan(slot, A + B + [1], "a").n_reused == 0  # the shared namespace is a namespace


def test_another_slots_cells_only_within_the_salt() -> None:
    doc = list(range(500, 560))
    mine, donor = slots_with((doc[:5], "b"), (doc, "a"))
    p = plan(mine, doc + [1, 2], "b", donors=[mine, donor])
    assert p.source is Source.OWN and p.n_reused == 5 and p.donor is None
    assert not set(mine.kv.pool.seq_cells(0)) & set(donor.kv.pool.seq_cells(1))
    mine, donor = slots_with((doc[:5], "a"), (doc, "a"))
    p = plan(mine, doc + [1, 2], "a", donors=[mine, donor])
    assert p.source is Source.SLOT and p.donor is donor and p.n_reused == 60
    assert mine.kv.salt == "a"  # the shared cells keep their namespace


def _task(prompt: list[int], salt: str, **kw: Any) -> CompletionTask:
    return CompletionTask(list(prompt), SamplingParams(temperature=0), n_predict=4,
                          cache_salt=salt, **kw)


def test_slot_choice_by_similarity_and_id_slot_keep_only_within_the_salt() -> None:
    doc = list(range(500, 560))
    s0, s1 = slots_with((doc, "a"), ([7, 8], "b"))
    s0.t_last_used, s1.t_last_used = 2.0, 1.0  # s1 is the LRU one
    assert choose_slot([s0, s1], _task(doc + [1], "a"), 0.1) == (s0, False)  # kept whole
    assert choose_slot([s0, s1], _task(doc + [1], "b"), 0.1) == (s1, True)  # by LRU
    assert choose_slot([s0, s1], _task(doc + [1], ""), 0.1) == (s1, True)
    # a named slot keeps nothing of another salt's KV: it is saved first (update_cache)
    assert choose_slot([s0, s1], _task(doc + [1], "a", id_slot=0), 0.1) == (s0, False)
    assert choose_slot([s0, s1], _task(doc + [1], "b", id_slot=0), 0.1) == (s0, True)


def test_waiting_for_a_prefill_only_within_the_salt() -> None:
    doc = list(range(500, 560))
    (busy, _) = slots_with(([], ""), ([], ""))
    running = _task(doc + [1], "a")
    busy.kv.claim(PromptKey("a", []))
    busy.start(running, None, lambda _: None, [(0, len(doc) + 1)], 0)  # type: ignore[arg-type]
    assert pending_prefill([busy], _task(doc + [2], "a")) is busy
    assert pending_prefill([busy], _task(doc + [2], "b")) is None
    assert pending_prefill([busy], _task(doc + [2], "")) is None


def legacy_cache(pool: KVPool) -> LegacyPromptCache:
    return LegacyPromptCache(0, 10_000, fingerprint_of(pool, "llama"))


def test_legacy_entries_match_only_their_salt() -> None:
    holder, other, slot = slots_with((A + B, "a"), (A + B, "b"), ([], ""))
    pool = holder.kv.pool
    c = legacy_cache(pool)
    assert holder.kv.save_to(c) and c.states[0].salt == "a"
    # the same tokens under another salt are not "already cached": a second entry
    assert other.kv.save_to(c) and [e.salt for e in c.states] == ["a", "b"]
    assert c.match(pool, 2, [], PromptKey("", A + B + [1])) == 0
    assert c.load(pool, 2, [], PromptKey("", A + B + [1])) is None
    assert c.match(pool, 2, [], PromptKey("a", A + B + [1])) == 60
    # a longer prompt of salt "b" supersedes b's entry only
    assert c.save(pool, 1, PromptKey("b", list(other.kv.tokens))) is False  # already cached
    p = plan(slot, A + B + [1, 2], "b", host=c)
    assert p.source is Source.OWN and p.n_reused == 60  # restored b's entry, then own KV
    assert [e.salt for e in c.states] == ["a"]  # consumed
    k = torch.tensor(A + B + [1], dtype=torch.float32).view(1, 1, -1, 1).repeat(1, 1, 1, 2)
    other.kv.load_rows(A + B + [1], k, -k)
    other.kv.salt = "b"
    assert other.kv.save_to(c)
    assert [(e.salt, len(e.tokens)) for e in c.states] == [("a", 60), ("b", 61)]
    other.kv.drop()
    other.kv.load_rows(A + B + [1, 3], torch.cat([k, k[:, :, :1]], 2),
                       -torch.cat([k, k[:, :, :1]], 2))
    other.kv.salt = "b"
    assert other.kv.save_to(c)  # b's 61 tokens are obsolete now; a's 60 stay
    assert [(e.salt, len(e.tokens)) for e in c.states] == [("a", 60), ("b", 62)]
    c.check()


def test_salt_follows_the_kv_through_every_writer() -> None:
    holder, slot = slots_with((A + B, "a"), ([], ""))
    c = legacy_cache(holder.kv.pool)
    assert holder.kv.save_to(c)
    assert slot.kv.restore_from(c, PromptKey("a", A + B + [1])) and slot.kv.salt == "a"
    slot.kv.drop()
    assert slot.kv.salt == ""
    assert slot.kv.share_from(holder.kv, 10) and slot.kv.salt == "a"
    k = torch.zeros(1, 1, 3, 2)
    slot.kv.load_rows([1, 2, 3], k, k, salt="b")  # a slot file's rows: the file's namespace
    assert slot.kv.salt == "b"
    slot.kv.load_rows([1, 2, 3], k, k)  # an unsalted (or version-1) file's: the shared one
    assert slot.kv.salt == ""
    with pytest.raises(AssertionError):
        slot.kv.claim(PromptKey("a", []))  # KV of "" kept for a task of "a": the planner never does this


# -- every tier on the default model ---------------------------------------------------------

N_PREDICT = 6


@pytest.fixture(scope="module")
def texts(model: Model) -> dict[str, list[int]]:
    """A long shared prefix P, suffixes s1.. and unrelated prompts Q1..: token lists whose
    first tokens all differ (so a common prefix is P or nothing, whichever tier holds it)."""
    rng = random.Random(3)
    enc = model.tokenizer.encode
    out = {"P": enc("document: " + make_text(rng, 90), add_special=True)}
    for i in range(1, 7):  # a token of its own first: concatenated lists never merge tokens
        out[f"s{i}"] = [2000 + 101 * i] + enc(" question: " + make_text(rng, 6) + "?",
                                              add_special=False)
        out[f"Q{i}"] = [5000 + 97 * i] + enc(" " + make_text(rng, 30), add_special=False)
    firsts = [v[0] for v in out.values()]
    assert len(set(firsts)) == len(firsts) and len(out["P"]) >= 60
    return out


def greedy(prompt: list[int], salt: str = "", **kw: Any) -> CompletionTask:
    return CompletionTask(list(prompt), SamplingParams(temperature=0), n_predict=N_PREDICT,
                          ignore_eos=True, cache_salt=salt, **kw)


def drive(sched: Scheduler, tasks: list[CompletionTask]) -> list[FinalResult]:
    return run_to_end(sched, tasks, check_steps=True)


class Alone:
    """Each prompt's tokens computed alone with no cache at all (memoized)."""

    def __init__(self, model: Model) -> None:
        self.sched = build_scheduler(model, ServerConfig(n_parallel=1, ctx_size=512, cache_ram_mib=0),
                               ServerMetrics())
        self.memo: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self.memo:
            (f,) = drive(self.sched, [greedy(prompt, cache_prompt=False)])
            assert f.timings.cache_n == 0
            self.memo[key] = f.tokens
        return self.memo[key]


@pytest.fixture(scope="module")
def alone(model: Model) -> Alone:
    return Alone(model)


def check_one_by_one(sched: Scheduler, alone: Alone, steps: list[tuple[list[int], str, int]]
                     ) -> None:
    """Run (prompt, salt, expected cache_n) one request after another: exact reuse counts,
    and every answer that of the prompt alone."""
    for i, (prompt, salt, want) in enumerate(steps):
        (f,) = drive(sched, [greedy(prompt, salt)])
        assert f.timings.cache_n == want, (i, salt, f.timings.cache_n, want)
        assert f.tokens == alone(prompt), (i, salt)


@pytest.mark.model
def test_own_slot(model: Model, texts: dict[str, list[int]], alone: Alone) -> None:
    """One slot, no host cache: its KV serves only its own salt."""
    P, t = texts["P"], texts
    sched = build_scheduler(model, ServerConfig(n_parallel=1, ctx_size=512, cache_ram_mib=0),
                      ServerMetrics())
    n = len(P)
    check_one_by_one(sched, alone, [
        (P + t["s1"], "a", 0),
        (P + t["s2"], "b", 0),  # a's KV in the slot: not b's
        (P + t["s3"], "b", n),
        (P + t["s4"], "", 0),  # no salt: the shared namespace, not b's
        (P + t["s5"], "", n),
        (P + t["s6"], "a", 0),
    ])


@pytest.mark.model
def test_device_sharing_between_slots(model: Model, texts: dict[str, list[int]],
                                      alone: Alone) -> None:
    """Unified KV, four slots, no host cache: two requests with one long prefix, sent together
    (the second waits for the first's prefill, then takes its cells: same salt only), or one
    after the other (the second finds the first's slot by similarity, or takes the cells of
    another slot: same salt only)."""
    P, t, n = texts["P"], texts, len(texts["P"])
    cfg = ServerConfig(n_parallel=4, kv_unified=True, ctx_size=1024, cache_ram_mib=0)
    first, second = P + t["s1"], P + t["s2"]
    for salts, want in ((("a", "b"), 0), (("a", "a"), n), (("", ""), n), (("", "a"), 0)):
        sched = build_scheduler(model, cfg, ServerMetrics())
        f1, f2 = drive(sched, [greedy(first, salts[0]), greedy(second, salts[1])])
        assert (f1.timings.cache_n, f2.timings.cache_n) == (0, want), salts
        assert f1.tokens == alone(first) and f2.tokens == alone(second)

        sched = build_scheduler(model, cfg, ServerMetrics())
        (f1,) = drive(sched, [greedy(first, salts[0])])
        (f2,) = drive(sched, [greedy(second, salts[1])])
        assert (f1.timings.cache_n, f2.timings.cache_n) == (0, want), salts
        assert (f2.id_slot == f1.id_slot) == (want > 0)  # similarity only within the salt
        assert list(sched.slots[f1.id_slot].kv.tokens[:n]) == P  # not overwritten by f2
        free = [s.id for s in sched.slots if not len(s.kv)]
        (f3,) = drive(sched, [greedy(P + t["s3"], salts[1], id_slot=free[0])])
        assert f3.timings.cache_n == n  # f2's slot (its salt) gives its cells
        (f4,) = drive(sched, [greedy(P + t["s4"], "c", id_slot=free[1])])
        assert f4.timings.cache_n == 0  # every slot holding P is of another salt
        for f, prompt in ((f1, first), (f2, second), (f3, P + t["s3"]), (f4, P + t["s4"])):
            assert f.tokens == alone(prompt), salts


def host_steps(texts: dict[str, list[int]]) -> list[tuple[list[int], str, int]]:
    """One slot, overwritten between the requests of a conversation: the host cache serves
    the returning prompt, only within its salt."""
    P, t, n = texts["P"], texts, len(texts["P"])
    return [
        (P + t["s1"], "a", 0),
        (t["Q1"], "", 0),  # a's prompt goes to the host cache
        (P + t["s2"], "b", 0),  # a's entry holds P: not for b
        (t["Q2"], "", 0),
        (P + t["s3"], "a", n),  # a's entry serves a
        (t["Q3"], "", 0),
        (P + t["s4"], "", 0),  # no salt: neither a's nor b's
        (t["Q4"], "", 0),
        (P + t["s5"], "", n),  # the shared namespace's own entry
        (t["Q5"], "", 0),
        (P + t["s6"], "b", n),  # b's entry (saved when Q2 overwrote the slot)
    ]


@pytest.mark.model
@pytest.mark.parametrize("backend", ["legacy", "radix"])
def test_host_cache(model: Model, texts: dict[str, list[int]], alone: Alone,
                    backend: str) -> None:
    """Legacy entries carry their salt; the radix backend keeps one tree namespace per salt
    (memory/tiers/radix.py)."""
    cfg = ServerConfig(n_parallel=1, ctx_size=512, cache_radix_prompt=backend == "radix")
    sched = build_scheduler(model, cfg, ServerMetrics())
    assert sched.mem.cache.name == backend
    check_one_by_one(sched, alone, host_steps(texts))
    assert sched.mem.cache.stats()["loads"] == 3
