"""The engine thread: the only thread that touches the model, the KV pool, slots and caches.

HTTP handlers (asyncio) talk to it through one thread-safe control queue; results flow back
through a per-task asyncio queue fed with `call_soon_threadsafe`. No locks inside the engine.

It is also the only thread that runs torch's parallel kernels, from loading on (`Engine.boot`):
while another live thread owns an OpenMP team (it ran a parallel op once, e.g. loading the
model), the engine's kernels ran ~35% slower on 2 cores (decode 36 vs 55 tok/s, measured in
docs/PERFORMANCE.md), as slow as with one thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from radixserve.config import ServerConfig
from radixserve.model.loader import Model
from radixserve.http.prometheus import ServerMetrics
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.slot_actions import slot_action
from radixserve.engine.task import CompletionTask, FinalResult, TaskError

log = logging.getLogger(__name__)
T = TypeVar("T")


class TaskStream:
    """Async iterator over one task's results: PartialResult..., then one FinalResult."""

    def __init__(self, engine: "Engine", task: CompletionTask, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.task, self.loop = engine, task, loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.done = False

    def emit(self, item: Any) -> None:  # engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def __aiter__(self) -> "TaskStream":
        return self

    async def __anext__(self) -> Any:
        if self.done:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, TaskError):
            self.done = True
            raise item
        if isinstance(item, FinalResult):
            self.done = True
        return item

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self.engine._post(("cancel", self.task.id))


class Engine:
    def __init__(self, model: Model, cfg: ServerConfig) -> None:
        self.model, self.cfg = model, cfg
        self.metrics = ServerMetrics()
        self.scheduler = Scheduler(model, cfg, self.metrics)
        self.n_ctx_slot = self.scheduler.n_ctx_slot
        self.n_slots = len(self.scheduler.slots)
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="radixserve-engine", daemon=True)
        self._stopping = False

    @classmethod
    def boot(cls, cfg: ServerConfig, load: Callable[[], Model]) -> "Engine":
        """Load the model and run the engine loop on one new thread; returns once it is ready
        (or raises what loading raised)."""
        ready: queue.SimpleQueue[Any] = queue.SimpleQueue()

        def main() -> None:
            try:
                if cfg.threads > 0:  # per thread in OpenMP: set where the kernels run
                    torch.set_num_threads(cfg.threads)
                engine = cls(load(), cfg)
            except BaseException as e:  # handed to the caller
                ready.put(e)
                return
            engine._thread = threading.current_thread()
            ready.put(engine)
            engine._run()

        threading.Thread(target=main, name="radixserve-engine", daemon=True).start()
        got = ready.get()
        if isinstance(got, BaseException):
            raise got
        return got

    # -- handler side ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._post(("wake",))
        self._thread.join(timeout=10)

    def submit(self, task: CompletionTask) -> TaskStream:
        stream = TaskStream(self, task, asyncio.get_running_loop())
        self._post(("submit", task, stream))
        return stream

    async def call(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                res = fn()
            except BaseException as e:  # delivered to the awaiting handler
                loop.call_soon_threadsafe(_set_exc, fut, e)
            else:
                loop.call_soon_threadsafe(_set_res, fut, res)

        self._post(("call", run))
        return await fut

    def _post(self, msg: tuple) -> None:
        self._q.put(msg)

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        sched = self.scheduler
        while not self._stopping:
            block = not sched.has_active()
            try:
                msg = self._q.get(block=block)
            except queue.Empty:
                msg = None
            while msg is not None:
                self._handle(msg)
                try:
                    msg = self._q.get_nowait()
                except queue.Empty:
                    msg = None
            if sched.has_active():
                try:
                    sched.step()
                except Exception:  # never let one bad step kill the engine
                    log.exception("engine step failed")

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        try:
            if kind == "submit":
                _, task, stream = msg
                self.scheduler.submit(task, stream.emit)
            elif kind == "cancel":
                self.scheduler.cancel(msg[1])
            elif kind == "call":
                msg[1]()
        except Exception:
            log.exception("engine failed to handle %s", kind)

    # -- called on the engine thread through `call` ------------------------------------------
    def slots_json(self) -> list[dict[str, Any]]:
        return self.scheduler.slots_json()

    def is_idle_slot_available(self) -> bool:
        return any(not s.is_processing for s in self.scheduler.slots)

    def cache_stats(self) -> dict[str, float]:
        return self.scheduler.cache.stats()

    def slot_action(self, id_slot: int, action: str, filename: str | None) -> dict[str, Any]:
        """POST /slots/{id}?action=save|restore|erase (disk tier), on the engine thread."""
        return slot_action(self.scheduler, id_slot, action, filename)


def _set_res(fut: asyncio.Future, res: Any) -> None:
    if not fut.done():
        fut.set_result(res)


def _set_exc(fut: asyncio.Future, e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
