"""Deterministic mode through the real scheduler: 100 RAG-style chat prompts x 40 greedy tokens on
the default model in bf16, answered 4 at a time with every cache tier, chunk size and batch mix,
give bitwise the tokens each prompt gives alone with no cache at all (the token-by-token run:
the first 32 prompts).

The prompts are 25 fresh documents x 4 questions (the words of bench/words.py, seeded; rendered
by the model's chat template), so prefixes are shared and every tier has something to serve.
Each run also asserts that its tier really served prompt tokens (plans are recorded), so a run
that silently recomputed everything cannot pass for a cache test; that its batches really mixed
(steps holding a decode token beside a prefill chunk, counted as the scheduler makes them), so
a run that served the prompts one after the other cannot pass for a concurrency test; and that
every answer, the references' included, has its full N_PREDICT tokens.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import radixserve.memory.prefix_plan as prefix_plan
from radixserve.bench.scenarios import INSTRUCTION, make_text
from radixserve.config import ServerConfig
from radixserve.engine.counters import ServerMetrics
from radixserve.memory.prefix_plan import PrefixPlan, Source
from radixserve.engine.build import build_scheduler
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.slot import SlotState
from radixserve.engine.task import CompletionTask, FinalResult
from radixserve.model.loader import Model
from radixserve.sampling.chain import SamplingParams

# 40 tokens a prompt: each keeps decoding while the others' prefills and decodes share its steps
# (every batch mix the runs below make); 64 made this file the suite's longest, 400 s on 2 cores
N_DOCS, N_Q, N_PREDICT = 25, 4, 40


@pytest.fixture(scope="module")
def prompts(model: Model) -> list[list[list[int]]]:
    """prompts[d][q]: document d's question q, as chat-template tokens."""
    rng = random.Random(15)
    out = []
    for _ in range(N_DOCS):
        doc = make_text(rng, rng.randint(60, 160))
        row = []
        for _ in range(N_Q):
            question = "question: " + make_text(rng, rng.randint(6, 14)) + "?"
            text = model.chat_template.render([
                {"role": "system", "content": INSTRUCTION},
                {"role": "user", "content": f"document:\n{doc}\n\n{question}"}])
            row.append(model.tokenizer.encode(text, add_special=True))
        out.append(row)
    return out


def greedy(prompt: list[int], **kw: Any) -> CompletionTask:
    return CompletionTask(list(prompt), SamplingParams(temperature=0), n_predict=N_PREDICT,
                          ignore_eos=True, **kw)


class Recorder:
    """Every prefix plan the scheduler makes (where each prompt's reused tokens came from; a
    host restore is planned again afterwards as the slot's own prefix: both are recorded)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.plans: list[PrefixPlan] = []
        real = prefix_plan.plan_prefix

        def plan(*a: Any, **kw: Any) -> PrefixPlan:
            p = real(*a, **kw)
            self.plans.append(p)
            return p

        monkeypatch.setattr(prefix_plan, "plan_prefix", plan)

    def reused(self) -> Counter[Source]:
        """Prompt tokens planned to be reused, by source."""
        c: Counter[Source] = Counter()
        for p in self.plans:
            for s in p.spans:
                if s.source is not Source.COMPUTE:
                    c[s.source] += s.p1 - s.p0
        return c


class Steps:
    """Every batch `sched` runs, by what it holds: "decode" tokens only, "prefill" chunks only,
    or both ("mixed": a decode token beside a prefill chunk). Read off the slots' states as the
    scheduler returns the batch (before it runs), the scheduler's own choices unchanged."""

    def __init__(self, sched: Scheduler) -> None:
        self.kinds: Counter[str] = Counter()
        self.last = ""  # the previous batch's kind
        real, depth = sched._schedule, [0]

        def schedule() -> list[Any]:
            depth[0] += 1  # the scheduler calls itself again after failing a starved prompt
            try:
                batch = real()
            finally:
                depth[0] -= 1
            if batch and not depth[0]:
                decode = {s.state is SlotState.GENERATING for s, _ in batch}
                kind = ("mixed" if len(decode) == 2 else
                        "decode" if True in decode else "prefill")
                self.kinds[kind] += 1
                self.kinds[f"{self.last}->{kind}"] += 1
                self.last = kind
            return batch

        sched._schedule = schedule  # type: ignore[method-assign]


def run_to_end(sched: Scheduler, tasks: list[CompletionTask],
               check_steps: bool = False) -> list[FinalResult]:
    """Submit every task, step until all are done (checking every invariant after each step
    with `check_steps`, and at the end); each task's final result."""
    outs: list[list[Any]] = [[] for _ in tasks]
    for t, out in zip(tasks, outs):
        sched.submit(t, out.append)
    steps = 0
    while sched.has_active() or sched.deferred:
        sched.step()
        if check_steps:
            sched.check()
        steps += 1
        assert steps < 2_000_000
    sched.check()
    finals = [o[-1] for o in outs]
    assert all(isinstance(f, FinalResult) for f in finals), finals
    return finals


def drive(sched: Scheduler, tasks: list[CompletionTask]) -> list[list[int]]:
    """Every task run to its end, none truncated; each task's tokens."""
    finals = run_to_end(sched, tasks)
    assert not any(f.truncated for f in finals), finals
    return [f.tokens for f in finals]


@pytest.fixture(scope="module")
def reference(model, prompts) -> dict[tuple[int, ...], list[int]]:
    """Each prompt alone: one slot, no cache of any kind, ubatch 512."""
    sched = build_scheduler(model, ServerConfig(ctx_size=1024, n_parallel=1, cache_ram_mib=0),
                      ServerMetrics())
    ref = {}
    for row in prompts:
        for p in row:
            ref[tuple(p)] = drive(sched, [greedy(p, cache_prompt=False)])[0]
    return ref


def order(prompts: list[list[list[int]]], n_docs: int = N_DOCS) -> list[list[int]]:
    """Questions 0-1 of the first `n_docs` documents, then their questions 2-3: the second
    half finds its documents gone from the slots (host tiers serve them) while same-document
    requests still run side by side (slots share their prefill)."""
    return [prompts[d][q] for pair in ((0, 1), (2, 3)) for d in range(n_docs) for q in pair]


def check_all(outs: list[list[int]], sent: list[list[int]], reference,
              n_docs: int = N_DOCS) -> None:
    bad = [i for i, (o, p) in enumerate(zip(outs, sent)) if o != reference[tuple(p)]]
    assert len(sent) == n_docs * N_Q and not bad, f"{len(bad)} of {len(sent)} differ: {bad}"
    # every answer whole (the reference's too: two equally cut answers would compare equal)
    assert len(outs) == len(sent)
    assert [len(o) for o in outs] == [len(reference[tuple(p)]) for p in sent] == [N_PREDICT] * len(sent)


# 256 MiB of host cache holds every document (the default model: ~23 KB of KV a token)
RUNS = {
    # radix host tier, unified KV (slots share a concurrent prefill), whole-prompt chunks
    "radix-unified-ub512": (dict(kv_unified=True, ubatch_size=512, cache_ram_mib=256),
                            {Source.HOST, Source.SLOT, Source.OWN}, N_DOCS),
    # llama.cpp's legacy host cache, partitioned KV, 64-token chunks
    "legacy-ub64": (dict(ubatch_size=64, cache_ram_mib=256, cache_radix_prompt=False),
                    {Source.HOST}, N_DOCS),
    # radix with one token per step: every prompt token is its own forward. On 8 documents
    # (32 prompts; twice the slots, so the second half still comes back from the host tier):
    # token-by-token prefill of all 25 took ~100 s of the suite's time for the same paths
    "radix-ub1": (dict(kv_unified=True, ubatch_size=1, cache_ram_mib=256), {Source.HOST}, 8),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_four_way_concurrency_with_each_cache_tier_equals_no_cache(model, prompts, reference,
                                                                   monkeypatch, name):
    kw, sources, n_docs = RUNS[name]
    rec = Recorder(monkeypatch)
    sched = build_scheduler(model, ServerConfig(ctx_size=4096, n_parallel=4, **kw), ServerMetrics())
    steps = Steps(sched)
    sent = order(prompts, n_docs)
    check_all(drive(sched, [greedy(p) for p in sent]), sent, reference, n_docs)
    reused = rec.reused()
    assert all(reused[s] > 0 for s in sources), reused
    mixes(sched, steps)


def mixes(sched: Scheduler, steps: Steps) -> None:
    """The run's batches did mix: decode tokens beside prefill chunks wherever the step budget
    has room for both. With a budget of one token (ubatch 1) a batch holds one slot's token
    alone or the generating slots' tokens (decode is scheduled first, and past its budget no
    chunk is), so there decode steps must have been followed by prefill steps and prefill
    steps by decode steps (the prompts did not all run first, nor one after the other)."""
    k = steps.kinds
    assert k["decode"] > 0 and k["prefill"] > 0, k
    if sched.n_budget > 1:
        assert k["mixed"] > 0, k
    else:
        assert k["mixed"] == 0 and k["decode->prefill"] > 0 and k["prefill->decode"] > 0, k


def test_in_slot_reuse_at_ubatch_7_equals_no_cache(model, prompts, reference, monkeypatch):
    """Each slot answers its document's questions in turn (in-slot prefix reuse), 4 slots at
    once, 7-token chunks, with --cache-reuse set (which the mode never lets shift)."""
    rec = Recorder(monkeypatch)
    sched = build_scheduler(model, ServerConfig(ctx_size=4096, n_parallel=4, ubatch_size=7,
                                          cache_ram_mib=0, cache_reuse=8), ServerMetrics())
    tasks, sent = [], []
    for d in range(N_DOCS):
        for q in range(N_Q):
            tasks.append(greedy(prompts[d][q], id_slot=d % 4))
            sent.append(prompts[d][q])
    steps = Steps(sched)
    check_all(drive(sched, tasks), sent, reference)
    assert rec.reused()[Source.OWN] > 0
    assert not any(p.chunks for p in rec.plans)
    mixes(sched, steps)


def test_slot_files_between_questions_equal_no_cache(model, prompts, reference, tmp_path):
    """Four documents at a time: after each round of questions every slot is saved to a file,
    erased and restored from it, so the next question's prefix comes from the file."""
    sched = build_scheduler(model, ServerConfig(ctx_size=4096, n_parallel=4, cache_ram_mib=0,
                                          slot_save_path=str(tmp_path)), ServerMetrics())
    steps = Steps(sched)
    outs, sent, restored = [], [], 0
    for d0 in range(0, N_DOCS, 4):
        docs = list(range(d0, min(d0 + 4, N_DOCS)))
        for q in range(N_Q):
            if q:
                for s, _ in enumerate(docs):
                    sched.mem.slot_action(s, "save", f"d{d0}-s{s}.bin")
                    sched.mem.slot_action(s, "erase", None)
                    restored += sched.mem.slot_action(s, "restore", f"d{d0}-s{s}.bin")["n_restored"]
            before = sched.metrics.prompt_tokens_cached_total
            outs += drive(sched, [greedy(prompts[d][q], id_slot=s) for s, d in enumerate(docs)])
            sent += [prompts[d][q] for d in docs]
            if q:  # the documents came back from the files
                assert sched.metrics.prompt_tokens_cached_total - before >= 40 * len(docs)
    check_all(outs, sent, reference)
    assert restored > 0
    mixes(sched, steps)
    assert len(list(Path(tmp_path).iterdir())) == 4 * (N_DOCS // 4) + N_DOCS % 4


def test_cache_reuse_never_shifts_in_deterministic_mode(model, prompts, monkeypatch):
    """Prompts where --cache-reuse would shift the document (question first, so the document
    moves): with the mode on nothing is shifted and the answers equal a no-cache run; with it
    off the same requests do shift chunks (so this scenario exercises the flag)."""
    def q_first(d: int, q: int) -> list[int]:
        p = prompts[d][q]
        return p[-30:] + p[:-30]  # the question's tail moved in front of the document

    sent = [q_first(d, q) for d in range(4) for q in range(2)]
    for mode in ("on", "off"):
        rec = Recorder(monkeypatch)
        m = model if mode == "on" else off_model(model)
        sched = build_scheduler(m, ServerConfig(ctx_size=1024, n_parallel=1, cache_ram_mib=0,
                                          cache_reuse=8), ServerMetrics())
        outs = [drive(sched, [greedy(p)])[0] for p in sent]
        assert [len(o) for o in outs] == [N_PREDICT] * len(sent)
        if mode == "on":
            alone = build_scheduler(model, ServerConfig(ctx_size=1024, n_parallel=1,
                                                  cache_ram_mib=0), ServerMetrics())
            want = [drive(alone, [greedy(p, cache_prompt=False)])[0] for p in sent]
            assert outs == want
            assert not any(p.chunks for p in rec.plans)
        else:
            assert any(p.chunks for p in rec.plans)
        monkeypatch.undo()


def off_model(model: Model) -> Model:
    from dataclasses import replace

    from radixserve.model.forward import Transformer
    tr = Transformer(model.hp, model.transformer.w, model.dtype, kern=model.transformer.kern,
                     deterministic="off")
    return replace(model, transformer=tr)
