"""Engine.boot: the model is loaded on the engine thread, which then serves; load errors reach
the caller. (A model loaded on one thread and run on another ran ~35% slower: engine.py.)"""

from __future__ import annotations

import asyncio
import threading

import pytest

from radixserve.config import ServerConfig
from radixserve.engine.engine import Engine
from radixserve.engine.task import CompletionTask, FinalResult
from radixserve.model.loader import load_model
from radixserve.sampling.chain import SamplingParams


def test_boot_loads_and_serves_on_one_thread(tiny_path: str) -> None:
    seen: list[threading.Thread] = []

    def load():
        seen.append(threading.current_thread())
        return load_model(tiny_path, "f32")

    engine = Engine.boot(ServerConfig(ctx_size=256, n_parallel=1, cache_ram_mib=0), load)
    try:
        assert seen[0] is engine._thread and seen[0] is not threading.current_thread()
        assert seen[0].name == "radixserve-engine" and seen[0].is_alive()

        async def one() -> FinalResult:
            stream = engine.submit(CompletionTask([1, 2, 3, 4], SamplingParams(temperature=0),
                                                  n_predict=3, ignore_eos=True))
            items = [item async for item in stream]
            return items[-1]

        final = asyncio.run(one())
        assert isinstance(final, FinalResult) and len(final.tokens) == 3
    finally:
        engine.stop()
    assert not seen[0].is_alive()


def test_boot_raises_what_loading_raised() -> None:
    def load():
        raise FileNotFoundError("no such model: nowhere.gguf")

    with pytest.raises(FileNotFoundError, match="nowhere.gguf"):
        Engine.boot(ServerConfig(), load)


def test_a_cancel_sent_before_the_engine_took_the_task_still_stops_it(tiny_path: str) -> None:
    """The client leaves before the engine thread took its Submit off the queue (the id is
    assigned there): the cancel must still find the task. Reproduced with the engine thread not
    yet started, so the Submit and the Cancel are both queued before the engine reads either;
    then a task submitted after it must be served while the cancelled one never runs."""
    cfg = ServerConfig(ctx_size=512, n_parallel=1, cache_ram_mib=0)
    engine = Engine(load_model(tiny_path, "f32"), cfg)

    async def run() -> FinalResult:
        gone = engine.submit(CompletionTask(list(range(1, 40)), SamplingParams(temperature=0),
                                            n_predict=400, ignore_eos=True))
        gone.cancel()  # before the engine thread even started: id still unassigned
        engine.start()
        stream = engine.submit(CompletionTask([1, 2, 3, 4], SamplingParams(temperature=0),
                                              n_predict=3, ignore_eos=True))
        return [item async for item in stream][-1]

    try:
        final = asyncio.run(run())
        assert isinstance(final, FinalResult) and len(final.tokens) == 3

        async def slots() -> list[dict]:
            return await engine.slots_json()

        (slot,) = asyncio.run(slots())
        assert slot["is_processing"] is False and not engine.scheduler.deferred
        # only the second task's 4-token prompt was computed: the cancelled one never ran (a
        # lost cancel let it prefill its 39 tokens and decode 400 before the second one)
        m = engine.metrics
        assert (m.prompts_done_total, m.prompt_tokens_total) == (1, 4), m
    finally:
        engine.stop()
