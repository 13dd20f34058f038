"""Quantized KV (`-ctk` / `-ctv` q8_0 and q4_0) through every tier of the real scheduler, in
deterministic bf16 on the default model: 6 documents x 3 questions, answered 4 at a time with
slot sharing and the radix host tier, with the legacy host cache, from slot files and from
the disk tier after a restart, give bitwise the tokens each prompt gives alone with no cache
(with the same cache type); each run checks its tier really served prompt tokens. And one
cache type's slot files and disk blocks never serve a server of another type.

The deterministic suite (test_deterministic.py) runs the bf16 tiers on 100 prompts; this is its
parametrized shorter twin for the quantized types (18 prompts, 24 tokens each)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from radixserve.bench.scenarios import INSTRUCTION, make_text
from radixserve.config import ServerConfig
from radixserve.engine.counters import ServerMetrics
from radixserve.memory.prefix_plan import Source
from radixserve.engine.build import build_scheduler
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.task import CompletionTask
from radixserve.errors import TaskError
from radixserve.model.loader import Model
from radixserve.sampling.chain import SamplingParams
from tests.engine.test_deterministic import Recorder, drive, run_to_end

N_DOCS, N_Q, N_PREDICT = 6, 3, 24
TYPES = ["q8_0", "q4_0"]


@pytest.fixture(scope="module")
def prompts(model: Model) -> list[list[list[int]]]:
    rng = random.Random(38)
    out = []
    for _ in range(N_DOCS):
        doc = make_text(rng, rng.randint(80, 140))
        out.append([model.tokenizer.encode(model.chat_template.render([
            {"role": "system", "content": INSTRUCTION},
            {"role": "user", "content": f"document:\n{doc}\n\nquestion: "
                                        f"{make_text(rng, rng.randint(6, 12))}?"}]),
            add_special=True) for _ in range(N_Q)])
    return out


def greedy(prompt: list[int], **kw: Any) -> CompletionTask:
    return CompletionTask(list(prompt), SamplingParams(temperature=0), n_predict=N_PREDICT,
                          ignore_eos=True, **kw)


def sched(model: Model, kv: str, **kw: Any) -> Scheduler:
    cfg = dict(ctx_size=4096, n_parallel=4, cache_type_k=kv, cache_type_v=kv) | kw
    return build_scheduler(model, ServerConfig(**cfg), ServerMetrics())


def flat(prompts: list[list[list[int]]]) -> list[list[int]]:
    """Questions 0-1 of every document, then question 2 of every document: the last round
    finds its documents gone from the slots."""
    return [prompts[d][q] for qs in ((0, 1), (2,)) for d in range(N_DOCS) for q in qs]


@pytest.fixture(scope="module")
def reference(model: Model, prompts) -> dict[str, dict[tuple[int, ...], list[int]]]:
    """Per cache type, each prompt alone: one slot, no cache of any kind."""
    out = {}
    for kv in TYPES:
        s = sched(model, kv, ctx_size=1024, n_parallel=1, cache_ram_mib=0)
        assert [t.name for t in s.pool.types] == [kv, kv]
        out[kv] = {tuple(p): drive(s, [greedy(p, cache_prompt=False)])[0]
                   for row in prompts for p in row}
    return out


def check(outs: list[list[int]], sent: list[list[int]], ref: dict) -> None:
    bad = [i for i, (o, p) in enumerate(zip(outs, sent)) if o != ref[tuple(p)]]
    assert len(sent) == N_DOCS * N_Q and not bad, f"{len(bad)} of {len(sent)} differ: {bad}"


def test_the_types_are_in_use(reference):
    """The two types' answers differ somewhere (so the runs below compare what each type
    computes; tests/model/test_step.py shows the rows are stored in the type)."""
    assert reference["q8_0"] != reference["q4_0"]


RUNS = {
    "radix-unified": (dict(kv_unified=True, ubatch_size=512, cache_ram_mib=256),
                      {Source.HOST, Source.SLOT, Source.OWN}),
    "legacy-ub64": (dict(ubatch_size=64, cache_ram_mib=256, cache_radix_prompt=False),
                    {Source.HOST}),
}


@pytest.mark.parametrize("kv", TYPES)
@pytest.mark.parametrize("run", list(RUNS))
def test_host_tiers_and_slot_sharing_equal_no_cache(model, prompts, reference, monkeypatch,
                                                    kv, run):
    kw, sources = RUNS[run]
    rec = Recorder(monkeypatch)
    s = sched(model, kv, **kw)
    sent = flat(prompts)
    check(drive(s, [greedy(p) for p in sent]), sent, reference[kv])
    reused = rec.reused()
    assert all(reused[src] > 0 for src in sources), reused


@pytest.mark.parametrize("kv", TYPES)
def test_slot_files_equal_no_cache_and_refuse_another_type(model, prompts, reference,
                                                           tmp_path, kv):
    """Each slot saved, erased and restored between questions; then a file of this type is
    refused by a server of every other type, naming the cache type, its slot untouched."""
    s = sched(model, kv, cache_ram_mib=0, slot_save_path=str(tmp_path))
    outs, sent = [], []
    for d0 in range(0, N_DOCS, 4):
        docs = list(range(d0, min(d0 + 4, N_DOCS)))
        for q in range(N_Q):
            if q:
                for i in range(len(docs)):
                    s.mem.slot_action(i, "save", f"d{d0}-s{i}.bin")
                    s.mem.slot_action(i, "erase", None)
                    assert s.mem.slot_action(i, "restore", f"d{d0}-s{i}.bin")["n_restored"] > 40
            outs += drive(s, [greedy(prompts[d][q], id_slot=i) for i, d in enumerate(docs)])
            sent += [prompts[d][q] for d in docs]
    check(outs, sent, reference[kv])
    for other in ["", "f16", *TYPES]:
        if other == kv:
            continue
        o = sched(model, other, cache_ram_mib=0, slot_save_path=str(tmp_path))
        with pytest.raises(TaskError, match="cache type .dtype: file '" + kv):
            o.mem.slot_action(0, "restore", "d0-s0.bin")
        assert o.pool.seq_len(0) == 0


@pytest.mark.parametrize("kv", TYPES)
def test_disk_tier_after_a_restart_equals_no_cache_and_no_other_type_reads_it(
        model, prompts, reference, tmp_path, kv):
    disk = dict(cache_disk=str(tmp_path), cache_disk_block=32, n_parallel=2)
    s = sched(model, kv, **disk)
    firsts = [row[0] for row in prompts]
    assert drive(s, [greedy(p) for p in firsts]) == [reference[kv][tuple(p)] for p in firsts]
    s.mem.disk.disk.drain()
    s.mem.close()
    for other in ["", *TYPES]:  # "": bf16
        if other == kv:
            continue
        o = sched(model, other, **disk)
        got = run_to_end(o, [greedy(prompts[0][1])])[0]
        assert got.timings.cache_n == 0 and o.mem.tier_figures()["disk"]["hits"] == 0
        o.mem.close()
    s = sched(model, kv, **disk)
    rest = [row[q] for q in (1, 2) for row in prompts]
    finals = run_to_end(s, [greedy(p) for p in rest])
    assert [f.tokens for f in finals] == [reference[kv][tuple(p)] for p in rest]
    assert any(f.timings.reuse is not None and f.timings.reuse.tier == "disk" for f in finals)
    assert s.mem.tier_figures()["disk"]["hits"] > 0
    s.mem.close()


def test_props_and_slot_state_fingerprint_name_the_types(model):
    s = sched(model, "q8_0", cache_type_v="q4_0")
    assert [t.name for t in s.pool.types] == ["q8_0", "q4_0"]
    assert s.slots[0].kv.fp.dtype == "q8_0/q4_0"
