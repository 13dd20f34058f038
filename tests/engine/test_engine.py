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
from radixserve.model.sampling import SamplingParams


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
