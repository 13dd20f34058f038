"""Agent sessions outnumbering the slots (issue 36): each session's prompt is a long shared tool
prefix, then its own history, which grows each step by the model's answer and a tool result.
When another session's request takes a slot, it keeps the shared prefix and drops the rest; the
radix backend must have offered that rest (prompt and generated tokens) to the tree first, so
every step computes exactly the unshared minimum: the tokens no earlier request's prompt or
decoded answer holds, plus the last prompt token. The legacy backend keeps llama.cpp's rule
(save only when less than half is kept) and computes more. Every answer, in both, is the one its
prompt gives alone with no cache (deterministic mode).
"""

from __future__ import annotations

import random

import pytest

from radixserve.bench.scenarios import make_text
from radixserve.bench.stats import unshared_minimum
from radixserve.config import ServerConfig
from radixserve.engine.counters import ServerMetrics
from radixserve.engine.build import build_scheduler
from radixserve.engine.scheduler import Scheduler
from radixserve.model.loader import Model
from tests.engine.test_cache_salt import Alone, drive, greedy

pytestmark = pytest.mark.model
N_SESSIONS, N_STEPS = 5, 3


@pytest.fixture(scope="module")
def alone(model: Model) -> Alone:
    return Alone(model)


def run_agents(model: Model, alone: Alone, radix: bool
               ) -> tuple[int, int, list[list[int]], Scheduler]:
    """N_SESSIONS sessions on 2 slots, a round of steps at a time (every session's next request
    submitted together). Returns (prompt tokens computed, the unshared minimum, prompts, the
    scheduler); every answer is checked against the prompt's alone."""
    rng = random.Random(36)
    enc = model.tokenizer.encode
    tools = enc("tools: " + make_text(rng, 200), add_special=True)
    # a token of their own first: concatenated lists never merge tokens across the seams
    hist = [[3000 + 97 * s] + enc(f" task {s}: " + make_text(rng, 12), add_special=False)
            for s in range(N_SESSIONS)]
    cfg = ServerConfig(n_parallel=2, ctx_size=1024, cache_radix_prompt=radix)
    sched = build_scheduler(model, cfg, ServerMetrics())
    computed, sent = 0, []
    for step in range(N_STEPS):
        prompts = [tools + h for h in hist]
        finals = drive(sched, [greedy(p) for p in prompts])
        for s, (p, f) in enumerate(zip(prompts, finals)):
            assert f.tokens == alone(p), (step, s)  # cached == uncached, every party
            assert f.timings.prompt_n + f.timings.cache_n == len(p)
            computed += f.timings.prompt_n
            sent.append((p, f.tokens))
            result = [4000 + 89 * s] + enc(f" result {step}: " + make_text(rng, 10),
                                           add_special=False)
            hist[s] = hist[s] + f.tokens + result
    return computed, unshared_minimum(sent), [p for p, _ in sent], sched


def test_radix_computes_exactly_the_unshared_minimum(model: Model, alone: Alone) -> None:
    computed, minimum, prompts, sched = run_agents(model, alone, radix=True)
    assert computed == minimum, (computed, minimum)
    # what was saved is what the tree holds: every session's history, once
    assert sched.mem.cache.stats()["evictions"] == 0
    assert minimum < sum(map(len, prompts)) // 3  # the workload does share most of it


def test_legacy_keeps_llama_cpp_rule_and_computes_more(model: Model, alone: Alone) -> None:
    computed, minimum, _, sched = run_agents(model, alone, radix=False)
    assert sched.mem.cache.name == "legacy"
    # a slot taken by another session keeps the tools (more than half): its history is lost
    assert computed > minimum * 1.3, (computed, minimum)
