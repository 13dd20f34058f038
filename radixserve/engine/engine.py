"""The engine thread: the only thread that touches the model, the KV pool, slots and caches.

HTTP handlers (asyncio) talk to it through one thread-safe queue of typed messages; results flow
back through a per-task asyncio queue. The engine collects the results of a step (or of the
messages it handled) and hands them to the event loop with one `call_soon_threadsafe`: each
call wakes the loop, and a wake-up costs both threads (the loop takes the GIL from the engine),
so a step of several streams (and a task's last text with its final result) wakes it once, not
once per result. No locks inside the engine. What the HTTP side may use is `EngineAPI` (engine/api.py); this class implements it.

It is also the only thread that runs torch's parallel kernels, from loading on (`Engine.boot`):
while another live thread owns an OpenMP team (it ran a parallel op once, e.g. loading the
model), the engine's kernels ran ~35% slower on 2 cores (decode 36 vs 55 tok/s, measured in
docs/PERFORMANCE.md), as slow as with one thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from radixserve.memory.tiers.base import PromptCache
from radixserve.config import ServerConfig
from radixserve.memory.cache_view import CacheView
from radixserve.engine.counters import ServerMetrics
from radixserve.engine.build import build_scheduler
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.task import CompletionTask, FinalResult
from radixserve.errors import TaskError
from radixserve.model.loader import Model

log = logging.getLogger(__name__)
T = TypeVar("T")


# -- messages to the engine thread ------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Submit:
    task: CompletionTask
    stream: TaskStream


@dataclass(slots=True, frozen=True)
class Cancel:
    """Stop `task`: named by the object, not its id, because the id is assigned on the engine
    thread when it takes the Submit, and a client can leave before that (a cancel by id then
    matched nothing and the orphan decoded to n_predict, holding its slot)."""

    task: CompletionTask


@dataclass(slots=True, frozen=True)
class Call:
    """Run `run` on the engine thread (it delivers its own result). `wakes`: a sleeping
    engine reloads its model first (every query but sleep and wake themselves)."""

    run: Callable[[], None]
    wakes: bool = True
    fail: Callable[[BaseException], None] | None = None  # delivers an error instead of running


@dataclass(slots=True, frozen=True)
class Wake:
    """Nothing to do: lets a blocked loop see `stop`."""


Message = Submit | Cancel | Call | Wake


@dataclass(slots=True, frozen=True)
class Asleep:
    """What a sleeping engine keeps (--sleep-idle-seconds): the host cache (RAM tier and the
    disk tier under it) and the figures the HTTP side reads; the model's weights, the KV pool,
    the slots and the draft model are gone with the scheduler."""

    cache: PromptCache
    n_ctx_slot: int
    n_slots: int
    misses: int  # the host tier's miss count, carried into the next one


class TaskStream:
    """Async iterator over one task's results: PartialResult..., then one FinalResult."""

    def __init__(self, engine: Engine, task: CompletionTask, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.task, self.loop = engine, task, loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.done = False

    def emit(self, item: Any) -> None:  # engine thread: delivered at the engine's next flush
        self.engine._outbox.append((self, item))

    def __aiter__(self) -> TaskStream:
        return self

    async def __anext__(self) -> Any:
        if self.done:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, (TaskError, FinalResult)):
            self._end()
            if isinstance(item, TaskError):
                raise item
        return item

    def cancel(self) -> None:
        if not self.done:
            self._end()
            self.engine._post(Cancel(self.task))

    def _end(self) -> None:
        self.done = True
        self.engine.changes += 1


class Engine:
    def __init__(self, model: Model, cfg: ServerConfig, cache: PromptCache | None = None) -> None:
        """`cache`: a host cache instead of the one `cfg` describes (tests inject faults)."""
        self.model, self.cfg = model, cfg
        self.metrics = ServerMetrics()
        self.scheduler = build_scheduler(model, cfg, self.metrics, cache)
        self.view = CacheView(cfg.slots_debug)
        self.changes = 0  # EngineAPI.changes; event loop only
        self.scheduler.mem.set_disk_wake(lambda: self._post(Wake()))
        self._q: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._outbox: list[tuple[TaskStream, Any]] = []  # results not yet handed to the loop
        self._thread = threading.Thread(target=self._run, name="radixserve-engine", daemon=True)
        self._stopping = False
        self._load: Callable[[], Model] | None = None  # set by boot: what sleep reloads with
        self._asleep: Asleep | None = None

    @property
    def alive(self) -> bool:
        """Whether the engine thread still runs (a health probe's question)."""
        return self._thread.is_alive()

    @classmethod
    def boot(cls, cfg: ServerConfig, load: Callable[[], Model]) -> Engine:
        """Load the model and run the engine loop on one new thread; returns once it is ready
        (or raises what loading raised)."""
        ready: queue.SimpleQueue[Any] = queue.SimpleQueue()

        def main() -> None:
            try:
                if cfg.threads > 0:  # per thread in OpenMP: set where the kernels run
                    torch.set_num_threads(cfg.threads)
                engine = cls(load(), cfg)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                ready.put(e)
                return
            engine._load = load
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
        self._post(Wake())
        self._thread.join(timeout=10)
        if self._asleep is None:
            self.scheduler.mem.close()
        elif (disk := self._asleep.cache.disk_tier()) is not None:
            disk.close()

    def submit(self, task: CompletionTask) -> TaskStream:
        stream = TaskStream(self, task, asyncio.get_running_loop())
        self.changes += 1
        self._post(Submit(task, stream))
        return stream

    async def call(self, fn: Callable[[], T], wakes: bool = True) -> T:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def fail(e: BaseException) -> None:
            loop.call_soon_threadsafe(_set_exc, fut, e)

        def run() -> None:
            try:
                res = fn()
            except BaseException as e:  # noqa: BLE001 - delivered to the awaiting handler
                fail(e)
            else:
                loop.call_soon_threadsafe(_set_res, fut, res)

        self._post(Call(run, wakes, fail))
        return await fut

    def _post(self, msg: Message) -> None:
        self._q.put(msg)

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            # no local keeps the scheduler between turns: sleep frees it while this waits
            block = self.scheduler is None or not self.scheduler.has_active()
            msg: Message | None
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
            self._flush()
            sched = self.scheduler  # None while asleep (a message may wake it)
            try:
                if sched is None:
                    pass  # asleep: nothing runs until a message wakes it
                elif sched.has_active():
                    sched.step()  # polls the disk tier first
                else:
                    sched.poll_io()
            except Exception:  # never let one bad step kill the engine
                log.exception("engine step failed")
            sched = None
            self._flush()
        self._flush()

    def _flush(self) -> None:
        """Hand the collected results to their event loops: one wake-up per loop."""
        out = self._outbox
        if not out:
            return
        self._outbox = []
        loop = out[0][0].loop
        if all(st.loop is loop for st, _ in out):
            by_loop = {loop: out}
        else:
            by_loop = {}
            for st, item in out:
                by_loop.setdefault(st.loop, []).append((st, item))
        for lp, items in by_loop.items():
            try:
                lp.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop is closed: nobody is left to read these
                log.debug("dropped %d results for a closed event loop", len(items))

    def _handle(self, msg: Message) -> None:
        if self._asleep is not None and (isinstance(msg, Submit) or
                                         (isinstance(msg, Call) and msg.wakes)):
            try:
                self._wake()
            except Exception as e:
                log.exception("failed to reload the model after sleeping")
                err = TaskError(500, "server_error", f"failed to reload the model: {e}")
                if isinstance(msg, Submit):
                    msg.stream.emit(err)
                elif msg.fail is not None:  # type: ignore[union-attr]
                    msg.fail(err)  # type: ignore[union-attr]
                return
        if isinstance(msg, Cancel) and self._asleep is not None:
            return  # no task lives in a sleeping engine
        try:
            if isinstance(msg, Submit):
                self.scheduler.submit(msg.task, msg.stream.emit)
            elif isinstance(msg, Cancel):
                self.scheduler.cancel(msg.task)
            elif isinstance(msg, Call):
                msg.run()
        except Exception:
            log.exception("engine failed to handle %s", type(msg).__name__)

    # -- sleep (--sleep-idle-seconds): engine thread ------------------------------------------
    def _sleep(self) -> bool:
        """Release the model's weights and the device KV (pool, slots, draft: the scheduler),
        keeping the host cache: every slot's KV is offered to it first, so what they held is
        reused after waking. False (nothing released) while a task runs or waits."""
        sched = self.scheduler
        if self._asleep is not None:
            return True
        if self._load is None or sched.has_active() or sched.deferred:
            return False
        self._asleep = _keep_host_cache(sched)
        # the tokenizer and template stay (the HTTP side holds them); the weights go
        self.model = dataclasses.replace(self.model, transformer=None)  # type: ignore[arg-type]
        self.scheduler = None  # type: ignore[assignment]
        del sched  # the last reference to the pool, slots and weights: freed now
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        log.info("server is entering sleeping state (model and KV released; the host cache "
                 "keeps %d tokens)", int(self._asleep.cache.stats().get("unique_tokens", 0)))
        return True

    def _wake(self) -> None:
        """Load the model again and build a scheduler over the kept host cache."""
        a = self._asleep
        if a is None:
            return
        assert self._load is not None
        log.info("server is exiting sleeping state")
        t0 = time.perf_counter()
        loaded = self._load()
        model = dataclasses.replace(loaded, tokenizer=self.model.tokenizer,
                                    chat_template=self.model.chat_template)
        sched = build_scheduler(model, self.cfg, self.metrics, a.cache)
        sched.mem.carry_misses(a.misses)
        sched.mem.set_disk_wake(lambda: self._post(Wake()))
        self.model, self.scheduler, self._asleep = model, sched, None
        log.info("model reloaded after sleeping in %.2f s", time.perf_counter() - t0)

    @property
    def sleeping(self) -> bool:
        return self._asleep is not None

    @property
    def can_sleep(self) -> bool:
        """Whether it can reload what sleep releases (an engine `boot` started)."""
        return self._load is not None

    async def sleep(self) -> bool:
        """Release the model and the device KV if no task runs or waits (True: asleep)."""
        return await self.call(self._sleep, wakes=False)

    async def wake(self) -> None:
        """Reload what sleep released (raises what loading raised; the engine stays asleep)."""
        await self.call(self._wake, wakes=False)

    # -- EngineAPI: each runs on the engine thread ---------------------------------------------
    @property
    def n_ctx_slot(self) -> int:
        return self.scheduler.n_ctx_slot if self._asleep is None else self._asleep.n_ctx_slot

    @property
    def n_slots(self) -> int:
        return len(self.scheduler.slots) if self._asleep is None else self._asleep.n_slots

    async def slots_json(self) -> list[dict[str, Any]]:
        return await self.call(lambda: [s.to_json() for s in self.scheduler.slots])

    async def has_idle_slot(self) -> bool:
        return await self.call(lambda: any(not s.is_processing for s in self.scheduler.slots))

    async def cache_stats(self) -> dict[str, float]:
        return await self.call(self.scheduler.mem.cache_stats)

    async def scrape(self) -> tuple[ServerMetrics, dict[str, float]]:
        def scrape() -> tuple[ServerMetrics, dict[str, float]]:
            self.metrics.tiers = self.scheduler.mem.tier_figures()
            return self.metrics.scrape(), self.scheduler.mem.cache_stats()

        return await self.call(scrape)

    async def cache_view(self) -> dict[str, Any]:
        return await self.call(lambda: self.view.snapshot(self.scheduler.mem, self.metrics))

    async def flush_cache(self) -> dict[str, int]:
        """Empty every cache tier: slots (a busy one's KV when its task ends), host RAM, disk."""
        out, fut = await self.call(self.scheduler.mem.flush)
        out["disk_files"] = 0 if fut is None else await asyncio.wrap_future(fut)
        return out

    async def slot_action(self, id_slot: int, action: str, filename: str | None) -> dict[str, Any]:
        """POST /slots/{id}?action=save|restore|erase (disk tier)."""
        return await self.call(lambda: self.scheduler.mem.slot_action(id_slot, action, filename))


def _keep_host_cache(sched: Scheduler) -> Asleep:
    """Before the scheduler goes: every slot's KV offered to the host cache (what it does not
    already hold, within --cache-ram), then what a sleeping engine keeps."""
    cache, misses = sched.mem.keep_host()
    return Asleep(cache, sched.n_ctx_slot, len(sched.slots), misses)


def _deliver(items: list[tuple[TaskStream, Any]]) -> None:  # event loop
    for st, item in items:
        st.queue.put_nowait(item)


def _set_res(fut: asyncio.Future, res: Any) -> None:
    if not fut.done():
        fut.set_result(res)


def _set_exc(fut: asyncio.Future, e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
