"""`timings.reuse` (memory/miss_report.py) on each kind of hit and miss, through the real scheduler on
the default model: the tier that served and what it gave, the longest prefix any tier held, and
where the prompt left the best cached sequence, with both texts from there; never another
`cache_salt`'s text. Every answer is the one its prompt gives alone (deterministic mode)."""

from __future__ import annotations

import pytest

from radixserve.config import ServerConfig
from radixserve.engine.counters import ServerMetrics
from radixserve.memory.miss_report import EXCERPT_TOKENS, describe
from radixserve.engine.build import build_scheduler
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.task import FinalResult, Reuse
from radixserve.model.loader import Model
from tests.engine.test_cache_salt import Alone, drive, greedy

pytestmark = pytest.mark.model
SYSTEM = "system: you are a helpful agent. today is {date}. tools: search, read, write, send."
ASK = " user: find the report from last week and send it to the team."


@pytest.fixture(scope="module")
def alone(model: Model) -> Alone:
    return Alone(model)


def one(sched: Scheduler, alone: Alone, prompt: list[int], salt: str = "", **kw) -> Reuse:
    (f,) = drive(sched, [greedy(prompt, salt, **kw)])
    assert isinstance(f, FinalResult) and f.tokens == alone(prompt)
    r = f.timings.reuse
    assert r is not None and r.n_tokens == f.timings.cache_n
    assert f.timings.fields()["reuse"] == r.to_json()  # beside `timings`, never in it
    assert "reuse" not in f.timings.to_json()
    return r


def prompt(model: Model, date: str = "2026-12-04", ask: str = ASK) -> list[int]:
    return model.tokenizer.encode(SYSTEM.format(date=date) + ask, add_special=True)


def test_full_hit_then_a_changed_date_shows_where_and_what(model: Model, alone: Alone) -> None:
    sched = build_scheduler(model, ServerConfig(n_parallel=1, ctx_size=512), ServerMetrics())
    a = prompt(model)
    assert one(sched, alone, a) == Reuse("none", 0, 0, None, None, None)  # a cold start
    full = one(sched, alone, a)
    assert full == Reuse("slot", len(a) - 1, len(a), None, None, None)  # all but the last token
    b = prompt(model, date="2026-12-05")
    d = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    r = one(sched, alone, b)
    assert (r.tier, r.n_tokens, r.n_held, r.first_diff) == ("slot", d, d, d)
    assert r.cached_text is not None and r.prompt_text is not None
    assert r.cached_text.startswith("4.") and r.prompt_text.startswith("5.")
    assert r.prompt_text == model.tokenizer.decode(b[d:d + EXCERPT_TOKENS])
    assert "differs at %d" % d in describe(r)
    assert sched.slots[0].to_json()["reuse"] == r.to_json()  # /slots: the slot's last


def test_another_salt_holds_nothing_and_shows_nothing(model: Model, alone: Alone) -> None:
    sched = build_scheduler(model, ServerConfig(n_parallel=2, ctx_size=512), ServerMetrics())
    a = prompt(model)
    one(sched, alone, a, salt="tenant-a")
    r = one(sched, alone, a, salt="tenant-b")
    assert r == Reuse("none", 0, 0, None, None, None)
    r = one(sched, alone, prompt(model, date="2026-12-05"), salt="tenant-a")
    assert r.tier == "slot" and r.first_diff == r.n_held > 10


def test_ram_and_slot_share_tiers(model: Model, alone: Alone) -> None:
    sched = build_scheduler(model, ServerConfig(n_parallel=2, ctx_size=512), ServerMetrics())
    a, other = prompt(model), model.tokenizer.encode("unrelated words here " * 20)
    one(sched, alone, a, id_slot=0)
    one(sched, alone, other, id_slot=0)  # a goes to the RAM tier
    r = one(sched, alone, a + model.tokenizer.encode(" thanks.", add_special=False), id_slot=0)
    assert r.tier == "ram" and r.n_tokens >= len(a) and r.n_held >= len(a)
    # no host tier: another slot's cells are the only source
    sched = build_scheduler(model, ServerConfig(n_parallel=2, ctx_size=512, cache_ram_mib=0),
                      ServerMetrics())
    one(sched, alone, a, id_slot=0)
    r = one(sched, alone, a + model.tokenizer.encode(" ok!", add_special=False), id_slot=1)
    assert r.tier == "slot_share" and r.n_tokens == r.n_held == r.first_diff == len(a)


def test_eviction_leaves_only_what_every_prompt_shares(model: Model, alone: Alone) -> None:
    # a RAM tier of 2 MiB holds 91 tokens of the default model (23 KiB each): the third
    # prompt saved evicts the first
    sched = build_scheduler(model, ServerConfig(n_parallel=1, ctx_size=512, cache_ram_mib=2),
                      ServerMetrics())
    a = prompt(model)
    one(sched, alone, a)
    for words in ("apples and pears ", "rivers and hills "):
        one(sched, alone, model.tokenizer.encode(words * 8))
    r = one(sched, alone, a)  # the slot's content saved first evicts a, the oldest
    assert sched.mem.cache.stats()["evictions"] >= 1
    assert r.tier in ("none", "slot") and r.n_held == r.n_tokens <= 1  # at most the BOS
    assert r.first_diff == r.n_held and r.cached_text is not None  # what it found instead


def test_a_pinned_prompt_survives_the_eviction_that_takes_an_unpinned_one(
        model: Model, alone: Alone) -> None:
    """`prompt_cache_retention: 24h` (task.pin_s): the same workload as above, but the first
    prompt pinned: it comes back whole from RAM, while the unpinned run lost it."""
    a = prompt(model)
    fill = [model.tokenizer.encode(w * 8) for w in ("apples and pears ", "rivers and hills ")]
    for pin_s, tier in ((0.0, "none"), (24 * 3600.0, "ram")):
        cfg = ServerConfig(n_parallel=1, ctx_size=512, cache_ram_mib=2, cache_pin_mib=2)
        sched = build_scheduler(model, cfg, ServerMetrics())
        one(sched, alone, a, pin_s=pin_s)
        assert sched.mem.cache.stats()["pins"] == (1 if pin_s else 0)
        for p in fill:
            one(sched, alone, p)
        r = one(sched, alone, a)
        assert r.tier == tier and (r.n_tokens == len(a) - 1 if pin_s else r.n_tokens <= 1)
        assert sched.mem.cache.stats()["evictions"] >= 1  # the pressure was there both times
