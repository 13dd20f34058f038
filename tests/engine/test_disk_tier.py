"""The disk tier under the radix cache, through the real scheduler on the default model
(deterministic bf16): a restarted engine restores prefixes an earlier one wrote, and answers
token for token as the same prompts computed alone with no cache; another dtype never sees the
files; damaged files and a full disk cost only the reuse; salts never meet on disk; a disk read
does not hold up the other slots; the flush empties every tier.
"""

from __future__ import annotations

import errno
import os
import random
import threading
from typing import Any

import pytest

from radixserve.bench.scenarios import make_text
from radixserve.memory.tiers.disk_block import SUFFIX
from radixserve.memory.tiers.prefix import common_prefix
from radixserve.config import ServerConfig, SpecConfig
from radixserve.engine.counters import ServerMetrics
from radixserve.engine.build import build_scheduler
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.task import CompletionTask
from radixserve.model.loader import Model, load_model
from radixserve.sampling.chain import SamplingParams
from tests.engine.test_deterministic import run_to_end

B = 32  # tokens a block
N_PREDICT = 12


@pytest.fixture(scope="module")
def prompts(model: Model) -> list[list[int]]:
    """Two documents (~300 tokens), two questions each."""
    rng = random.Random(5)
    out = []
    for _ in range(2):
        doc = make_text(rng, 300)
        for ask in ("Summarize the text above.", "What is the text above about?"):
            text = model.chat_template.render([{"role": "user", "content": f"{doc}\n\n{ask}"}])
            out.append(model.tokenizer.encode(text, add_special=True))
    return out


def task(p: list[int], **kw: Any) -> CompletionTask:
    return CompletionTask(list(p), SamplingParams(temperature=0), n_predict=N_PREDICT,
                          ignore_eos=True, **kw)


def engine(model: Model, directory: Any, **kw: Any) -> Scheduler:
    cfg = dict(ctx_size=2048, n_parallel=2, cache_disk=str(directory), cache_disk_block=B)
    return build_scheduler(model, ServerConfig(**(cfg | kw)), ServerMetrics())


def restart(s: Scheduler, model: Model, directory: Any, **kw: Any) -> Scheduler:
    """A new engine on the same directory: nothing in RAM, what the old one wrote on disk."""
    s.mem.close()
    return engine(model, directory, **kw)


@pytest.fixture(scope="module")
def reference(model: Model, prompts: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    s = build_scheduler(model, ServerConfig(ctx_size=2048, n_parallel=1, cache_ram_mib=0),
                  ServerMetrics())
    return {tuple(p): run_to_end(s, [task(p, cache_prompt=False)])[0].tokens for p in prompts}


def files(d: Any) -> list[str]:
    """The block files under `d` (not the weights digest kept beside them)."""
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs
                  if f.endswith(SUFFIX))


def on_disk(first: list[int], prompt: list[int]) -> int:
    """Tokens of `prompt` a restarted engine finds on disk after the prompt `first` ran (it
    diverges from `prompt` inside the prompts): the whole blocks of their common prefix."""
    lcp = common_prefix(first, prompt)
    return min(lcp, len(prompt) - 1) // B * B


def test_restart_restores_from_disk_and_answers_as_no_cache(model, prompts, reference, tmp_path):
    s = engine(model, tmp_path)
    first = run_to_end(s, [task(prompts[0]), task(prompts[2])])
    assert [f.tokens for f in first] == [reference[tuple(p)] for p in (prompts[0], prompts[2])]
    s.mem.disk.disk.drain()
    n_files = len(files(tmp_path))
    assert n_files >= 2 * (len(prompts[0]) // B)
    s = restart(s, model, tmp_path)
    assert s.mem.cache.stats()["bytes"] == 0
    second = run_to_end(s, [task(prompts[1]), task(prompts[3])])
    for f, p, before in zip(second, (prompts[1], prompts[3]), (prompts[0], prompts[2])):
        assert f.tokens == reference[tuple(p)]
        assert f.timings.cache_n == on_disk(before, p) > 200
        assert f.timings.reuse is not None and f.timings.reuse.tier == "disk"
        assert f.timings.reuse.n_tokens == f.timings.cache_n
    fig = s.mem.tier_figures()["disk"]
    assert fig["hits"] == 2 and fig["hit_tokens"] >= sum(f.timings.cache_n for f in second)
    assert fig["bytes"] > 0 and fig["tokens"] % B == 0
    again = run_to_end(s, [task(prompts[0])])[0]  # the same prompt once more: RAM or disk, all of it
    assert again.tokens == reference[tuple(prompts[0])]
    s.mem.close()


def test_another_dtype_never_sees_the_files(model, prompts, tmp_path, default_f32):
    s = engine(model, tmp_path)
    run_to_end(s, [task(prompts[0])])
    s.mem.close()
    n = len(files(tmp_path))
    f32 = default_f32  # load_model("default", "f32"), the session's (tests/conftest.py)
    other = engine(f32, tmp_path)
    got = run_to_end(other, [task(prompts[1])])[0]
    assert got.timings.cache_n == 0
    assert other.mem.tier_figures()["disk"]["misses"] == 1
    other.mem.close()
    assert len(files(tmp_path)) >= n  # its files were not its to judge: left alone


def test_damaged_files_are_misses_and_removed(model, prompts, reference, tmp_path):
    s = engine(model, tmp_path)
    run_to_end(s, [task(prompts[0])])
    s.mem.disk.disk.drain()
    rng = random.Random(1)
    for i, path in enumerate(files(tmp_path)):
        data = bytearray(open(path, "rb").read())
        if i % 2:
            data = data[:rng.randrange(len(data))]
        else:
            data[rng.randrange(len(data))] ^= 0x10
        open(path, "wb").write(bytes(data))
    s = restart(s, model, tmp_path)
    got = run_to_end(s, [task(prompts[1])])[0]
    assert got.tokens == reference[tuple(prompts[1])] and got.timings.cache_n == 0
    fig = s.mem.tier_figures()["disk"]
    assert fig["bad_files"] == 1 and fig["misses"] == 1  # the first block was bad: read stops
    s.mem.close()


def test_full_disk_serving_goes_on(model, prompts, reference, tmp_path):
    s = engine(model, tmp_path)
    full = threading.Event()
    full.set()

    def fault(op: str) -> None:
        if op == "write" and full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")

    s.mem.disk.disk.fault = fault
    got = run_to_end(s, [task(prompts[0]), task(prompts[2])])
    assert [f.tokens for f in got] == [reference[tuple(p)] for p in (prompts[0], prompts[2])]
    s.mem.disk.disk.drain()
    assert files(tmp_path) == [] and s.mem.tier_figures()["disk"]["write_errors"] > 0
    full.clear()  # space again: the next saves reach the disk
    got = run_to_end(s, [task(prompts[1])])[0]
    assert got.tokens == reference[tuple(prompts[1])] and got.timings.cache_n > 200  # RAM
    s.mem.disk.disk.drain()
    assert files(tmp_path)
    s.mem.close()


def test_salts_never_meet_on_disk(model, prompts, reference, tmp_path):
    s = engine(model, tmp_path)
    run_to_end(s, [task(prompts[0], cache_salt="tenant-a")])
    s = restart(s, model, tmp_path)
    other = run_to_end(s, [task(prompts[1], cache_salt="tenant-b"), task(prompts[1])])
    assert [f.timings.cache_n for f in other] == [0, 0]
    s = restart(s, model, tmp_path)
    same = run_to_end(s, [task(prompts[1], cache_salt="tenant-a")])[0]
    assert same.timings.cache_n == on_disk(prompts[0], prompts[1]) > 200
    assert all(f.tokens == reference[tuple(prompts[1])] for f in [*other, same])
    s.mem.close()


def test_a_disk_read_does_not_hold_up_other_slots(model, prompts, reference, tmp_path):
    s = engine(model, tmp_path)
    run_to_end(s, [task(prompts[0])])
    s = restart(s, model, tmp_path)
    armed, release = threading.Event(), threading.Event()

    def slow_disk(op: str) -> None:
        if op == "read" and armed.is_set():
            assert release.wait(60)

    s.mem.disk.disk.fault = slow_disk
    out_x: list[Any] = []
    x = CompletionTask(list(prompts[2]), SamplingParams(temperature=0), n_predict=200,
                       ignore_eos=True)
    s.submit(x, out_x.append)
    while len(s.slots[0].generated) + len(s.slots[1].generated) < 2:
        s.step()
    armed.set()
    out_y: list[Any] = []
    s.submit(task(prompts[1]), out_y.append)
    assert len(s.deferred) == 1  # waits for the disk, in no slot
    n0 = sum(len(sl.generated) for sl in s.slots)
    for _ in range(20):
        s.step()
    assert sum(len(sl.generated) for sl in s.slots) == n0 + 20  # x went on decoding
    assert len(s.deferred) == 1 and not out_y
    release.set()
    while s.has_active() or s.deferred:
        s.step()
    y = out_y[-1]
    assert y.tokens == reference[tuple(prompts[1])]
    assert y.timings.cache_n == on_disk(prompts[0], prompts[1])
    assert out_x[-1].tokens[:N_PREDICT] == reference[tuple(prompts[2])]
    s.mem.close()


def test_a_failing_disk_read_lets_the_task_compute(model, prompts, reference, tmp_path):
    s = engine(model, tmp_path)
    run_to_end(s, [task(prompts[0])])
    s = restart(s, model, tmp_path)
    broken = threading.Event()
    broken.set()

    def fault(op: str) -> None:
        if op == "read" and broken.is_set():
            raise RuntimeError("injected read failure")

    s.mem.disk.disk.fault = fault
    got = run_to_end(s, [task(prompts[1])])[0]  # answered, not left waiting
    assert got.tokens == reference[tuple(prompts[1])] and got.timings.cache_n == 0
    broken.clear()  # the same prefix is not stuck on the failed read
    got = run_to_end(s, [task(prompts[3])])[0]
    assert got.tokens == reference[tuple(prompts[3])]
    s.mem.close()


def test_flush_empties_every_tier(model, prompts, reference, tmp_path):
    s = engine(model, tmp_path)
    run_to_end(s, [task(prompts[0])])
    s.mem.disk.disk.drain()
    assert files(tmp_path) and any(len(sl.kv) for sl in s.slots)
    n_files = len(files(tmp_path))
    out, disk = s.mem.flush()
    assert out["ram_bytes"] > 0 and out["ram_entries"] >= 1 and out["slots"] == 1
    assert disk is not None and disk.result(30) == n_files
    assert files(tmp_path) == [] and s.mem.cache.stats()["bytes"] == 0
    assert not any(len(sl.kv) for sl in s.slots)
    got = run_to_end(s, [task(prompts[1])])[0]
    assert got.timings.cache_n == 0 and got.tokens == reference[tuple(prompts[1])]
    s.mem.close()


def test_flush_while_a_task_runs_spares_it_and_keeps_nothing(model, prompts, reference,
                                                             tmp_path):
    s = engine(model, tmp_path)
    run_to_end(s, [task(prompts[2])])  # something on disk and in RAM to flush
    s.mem.disk.disk.drain()
    out: list[Any] = []
    s.submit(task(prompts[0]), out.append)
    while not any(sl.is_processing and sl.generated for sl in s.slots):
        s.step()
    gone, disk = s.mem.flush()
    assert gone["slots"] >= 1 and gone["ram_bytes"] > 0
    assert disk is not None and disk.result(30) == len(prompts[2]) // B
    while s.has_active() or s.deferred:
        s.step()
    assert out[-1].tokens == reference[tuple(prompts[0])]  # the request itself is unaffected
    s.mem.disk.disk.drain()
    assert s.mem.cache.stats()["bytes"] == 0 and files(tmp_path) == []  # its KV was not kept
    assert not any(len(sl.kv) for sl in s.slots)
    again = run_to_end(s, [task(prompts[0])])[0]
    assert again.timings.cache_n == 0 and again.tokens == reference[tuple(prompts[0])]
    s.mem.close()


def test_draft_rows_come_back_from_disk(model, prompts, reference, tmp_path):
    """Speculative decoding with the model as its own draft: the blocks carry the draft's rows
    too, so after a restart every draft is still accepted (a draft row out of step with its
    token would be rejected) and the answers are the target's own."""
    spec = SpecConfig(types=["draft-simple"], draft_model="default", n_max=4)

    def spec_engine() -> Scheduler:
        cfg = ServerConfig(ctx_size=2048, n_parallel=2, cache_disk=str(tmp_path),
                           cache_disk_block=B, spec=spec)
        return build_scheduler(model, cfg, ServerMetrics(), draft=model)

    s = spec_engine()
    assert run_to_end(s, [task(prompts[0])])[0].tokens == reference[tuple(prompts[0])]
    s.mem.close()
    s = spec_engine()
    got = run_to_end(s, [task(prompts[1])])[0]
    assert got.tokens == reference[tuple(prompts[1])]
    assert got.timings.cache_n == on_disk(prompts[0], prompts[1]) > 200
    assert got.timings.draft_n and got.timings.draft_n_accepted == got.timings.draft_n
    s.mem.close()


def test_sliding_window_model_restores_from_disk(tiny_swa_path, tmp_path):
    """A tiny Gemma 3 (window 16): blocks hold the sliding layers too, so a restarted engine
    restores a prefix far past the window and answers as without any cache."""
    m = load_model(tiny_swa_path, "f32")
    rng = random.Random(2)
    doc = [rng.randrange(10, 200) for _ in range(150)]
    p0, p1 = doc + [3, 4, 5], doc + [6, 7]
    ref = build_scheduler(m, ServerConfig(ctx_size=512, n_parallel=1, cache_ram_mib=0),
                    ServerMetrics())
    expect = [run_to_end(ref, [task(p, cache_prompt=False)])[0].tokens for p in (p0, p1)]
    s = engine(m, tmp_path, ctx_size=512)
    assert run_to_end(s, [task(p0)])[0].tokens == expect[0]
    s = restart(s, m, tmp_path, ctx_size=512)
    got = run_to_end(s, [task(p1)])[0]
    assert got.tokens == expect[1] and got.timings.cache_n == 150 // B * B
    s.mem.close()
