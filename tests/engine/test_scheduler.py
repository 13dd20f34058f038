"""The scheduler without HTTP: continuous batching, slot choice, out-of-cells handling."""

from __future__ import annotations

import pytest

from radixserve.config import ServerConfig
from radixserve.engine.counters import ServerMetrics
from radixserve.engine.build import build_scheduler
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.task import CompletionTask, FinalResult
from radixserve.errors import TaskError
from radixserve.model.loader import load_model
from radixserve.sampling.chain import SamplingParams


@pytest.fixture(scope="module", params=["native", "dequant"])
def model(tiny_path, request):
    return load_model(tiny_path, "f32", weights=request.param)


def run(sched: Scheduler, tasks: list[CompletionTask], each_step=None) -> list[list]:
    """Submit `tasks`, step until all are done (checking every invariant after each step,
    then calling `each_step`); the results each task received."""
    outs: list[list] = [[] for _ in tasks]
    for t, out in zip(tasks, outs):
        sched.submit(t, out.append)
    steps = 0
    while sched.has_active() or sched.deferred:
        sched.step()
        sched.check()
        if each_step is not None:
            each_step()
        steps += 1
        assert steps < 10_000
    sched.check()
    return outs


def task(prompt, n=8, **kw) -> CompletionTask:
    return CompletionTask(prompt, SamplingParams(temperature=0), n_predict=n, ignore_eos=True, **kw)


def test_long_prompt_is_chunked_while_others_decode(model):
    sched = build_scheduler(model, ServerConfig(ctx_size=2048, n_parallel=2, ubatch_size=64,
                                          cache_ram_mib=0), ServerMetrics())
    short, long_ = task(list(range(100, 110)), n=40), task(list(range(200, 700)), n=4)
    outs = run(sched, [short, long_])
    assert all(isinstance(o[-1], FinalResult) for o in outs)
    # the short request streamed its 40 tokens over many steps while the long prompt
    # was prefilled in 64-token chunks: decode steps were not stalled behind it
    assert sched.metrics.n_decode_total >= 500 // 64 + 40 - 1
    alone = run(build_scheduler(model, ServerConfig(ctx_size=2048, n_parallel=2, cache_ram_mib=0),
                          ServerMetrics()), [task(list(range(100, 110)), n=40)])
    assert outs[0][-1].tokens == alone[0][-1].tokens


def test_unified_out_of_cells_clears_an_idle_slot_after_saving_it(model):
    cfg = ServerConfig(ctx_size=256, n_parallel=2, kv_unified=True, cache_idle_slots=False)
    sched = build_scheduler(model, cfg, ServerMetrics())
    run(sched, [task(list(range(1000, 1180)), n=4, id_slot=0)])
    assert len(sched.slots[0].tokens) == 183
    outs = run(sched, [task(list(range(3000, 3100)), n=4, id_slot=1)])
    assert isinstance(outs[0][-1], FinalResult)
    assert sched.slots[0].tokens == [] and sched.mem.cache.stats()["saves"] == 1
    # the purged conversation comes back from the host cache
    back = run(sched, [task(list(range(1000, 1180)) + [5, 6], n=2, id_slot=0)])
    assert back[0][-1].timings.cache_n >= 180


def test_decode_that_cannot_fit_fails_only_its_requests(model):
    cfg = ServerConfig(ctx_size=64, n_parallel=2, kv_unified=True, cache_ram_mib=0)
    sched = build_scheduler(model, cfg, ServerMetrics())
    outs = run(sched, [task(list(range(100, 130)), n=60), task(list(range(200, 230)), n=60)])
    kinds = [type(o[-1]) for o in outs]
    assert TaskError in kinds  # together they need more than 64 cells
    err = next(o[-1] for o in outs if isinstance(o[-1], TaskError))
    assert err.status == 500 and "Context size" in err.message
    ok = run(sched, [task(list(range(300, 310)), n=4)])
    assert isinstance(ok[0][-1], FinalResult)


def test_request_for_a_busy_slot_waits(model):
    sched = build_scheduler(model, ServerConfig(ctx_size=512, n_parallel=2, cache_ram_mib=0),
                      ServerMetrics())
    outs = run(sched, [task(list(range(100, 120)), n=10, id_slot=1),
                       task(list(range(500, 520)), n=3, id_slot=1)])
    assert [o[-1].id_slot for o in outs] == [1, 1]
    assert sched.slots[0].tokens == []


def test_similar_prompt_picks_the_slot_holding_it(model):
    sched = build_scheduler(model, ServerConfig(ctx_size=512, n_parallel=3, cache_ram_mib=0),
                      ServerMetrics())
    base = list(range(100, 160))
    first = run(sched, [task(base)])[0][-1]
    second = run(sched, [task(base + [7, 8, 9])])[0][-1]
    assert second.id_slot == first.id_slot and second.timings.cache_n == 60
    other = run(sched, [task(list(range(900, 960)))])[0][-1]
    assert other.id_slot != first.id_slot  # LRU, not the similar one


@pytest.mark.parametrize("unified", [True, False])
def test_concurrent_requests_share_one_prefill(model, unified):
    """Two requests with one 300-token prefix arrive together: it is computed once; the
    second waits for it and reads the same cells (unified) or a copy (partitioned)."""
    cfg = ServerConfig(ctx_size=2048, n_parallel=2, kv_unified=unified, ubatch_size=64,
                       cache_ram_mib=0)
    sched = build_scheduler(model, cfg, ServerMetrics())
    doc = list(range(2000, 2300))
    tasks = [task(doc + [11, 12, 13], n=6), task(doc + [21, 22], n=6)]
    outs = run(sched, tasks)
    a, b = outs[0][-1], outs[1][-1]
    assert a.timings.prompt_n == 303 and b.timings.cache_n == 300 and b.timings.prompt_n == 2
    fresh = build_scheduler(model, ServerConfig(ctx_size=2048, n_parallel=2, cache_ram_mib=0),
                      ServerMetrics())
    assert b.tokens == run(fresh, [task(doc + [21, 22], n=6, cache_prompt=False)])[0][-1].tokens
    if unified:  # one copy of the prefix in the pool
        assert sched.pool.n_cells - sched.pool.n_free < len(sched.slots[0].tokens) + len(
            sched.slots[1].tokens)


def test_cache_prompt_false_neither_waits_nor_shares(model):
    cfg = ServerConfig(ctx_size=2048, n_parallel=2, kv_unified=True, ubatch_size=64,
                       cache_ram_mib=0)
    sched = build_scheduler(model, cfg, ServerMetrics())
    doc = list(range(2000, 2300))
    outs = run(sched, [task(doc + [1], n=3), task(doc + [2], n=3, cache_prompt=False)])
    assert outs[1][-1].timings.cache_n == 0 and outs[1][-1].timings.prompt_n == 301


def test_partials_only_for_streamed_tasks(model):
    """A non-streamed task gets its final result alone (no per-token wake-ups of the HTTP
    thread); a streamed one gets partials whose text adds up to the final's, same tokens."""
    cfg = ServerConfig(ctx_size=512, n_parallel=2, cache_ram_mib=0)
    streamed = task(list(range(300, 320)), n=12)
    quiet = task(list(range(300, 320)), n=12, stream=False)
    out_s, out_q = run(build_scheduler(model, cfg, ServerMetrics()), [streamed, quiet])
    assert [type(o).__name__ for o in out_q] == ["FinalResult"]
    assert len(out_s) > 2 and isinstance(out_s[-1], FinalResult)
    assert "".join(p.text for p in out_s[:-1]) == out_s[-1].content
    assert out_q[0].tokens == out_s[-1].tokens and out_q[0].content == out_s[-1].content


def test_prompts_that_cannot_all_fit_fail_one_at_a_time(model):
    """Two prompts filling the pool together: the first that cannot grow fails and frees its
    cells, the other completes (not both failed)."""
    cfg = ServerConfig(ctx_size=64, n_parallel=2, kv_unified=True, batch_size=16,
                       ubatch_size=16, cache_ram_mib=0)
    sched = build_scheduler(model, cfg, ServerMetrics())
    out1: list = []
    sched.submit(task(list(range(100, 140)), n=4, id_slot=1), out1.append)
    sched.step()
    sched.check()
    outs = run(sched, [task(list(range(300, 360)), n=4, id_slot=0)])
    assert isinstance(out1[-1], FinalResult) and len(out1[-1].tokens) == 4
    err = outs[0][-1]
    assert isinstance(err, TaskError) and err.status == 500 and "Context size" in err.message
    ok = run(sched, [task(list(range(500, 530)), n=4, id_slot=0)])  # and the server carries on
    assert isinstance(ok[0][-1], FinalResult)
