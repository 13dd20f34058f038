"""Driving the task streams of one HTTP request: SSE or JSON, cancelling on disconnect.

A request runs one task, or several (an array of prompts, `n`/`n_cmpl` > 1: llama-server's
server_response_reader over post_tasks / wait_for_all), all submitted at once. A slot
generating for a client that has gone away wastes the whole engine, so every path that can
lose the client (waiting for the first token, mid-stream, waiting for non-streamed results)
ends in `StreamGuard.close()` for every task, which cancels it unless it already finished.
Without streaming the handler waits for every final result (the first error fails the request
and cancels the rest). With streaming each task's chunks go out as they come, carrying its
`index`; OpenAI streams end with one `[DONE]`. Errors before the first result become normal
HTTP errors; later ones are sent as one `data: {"error": ...}` event, as llama-server does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from radixserve.engine.task import FinalResult, PartialResult
from radixserve.errors import TaskError
from radixserve.http.errors import ClientDisconnected
from radixserve.http.sse import StreamFormatter

log = logging.getLogger(__name__)
T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class TaskStreamLike(Protocol):
    def __aiter__(self) -> AsyncIterator[Any]: ...
    def cancel(self) -> None: ...


class StreamGuard:
    """Cancels the engine task on close unless a final result or error ended it."""

    def __init__(self, stream: TaskStreamLike) -> None:
        self.stream = stream
        self.it = stream.__aiter__()
        self.finished = False

    async def next(self) -> PartialResult | FinalResult:
        """The next result; TaskError ends the task; a stream that just stops is a 500."""
        try:
            item = await self.it.__anext__()
        except TaskError:
            self.finished = True
            raise
        except StopAsyncIteration:
            self.finished = True
            raise TaskError(500, "server_error", "the engine ended the task without a result")
        if isinstance(item, FinalResult):
            self.finished = True
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            log.info("client gone before the task finished: cancelling it")
            self.stream.cancel()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, aw: Awaitable[T]) -> T:
    """The result of `aw`, or ClientDisconnected if the client leaves first (aw cancelled)."""
    work = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise ClientDisconnected()
    finally:
        for t in (work, watcher):
            if not t.done():
                t.cancel()


class GuardedStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its generator and guard however sending ends.

    Starlette cancels the sending task on disconnect; a generator suspended at `yield` would
    then only be finalized by the garbage collector, leaving the slot busy until then.
    """

    def __init__(self, body: AsyncIterator[bytes], guard: StreamGuard | _Guards) -> None:
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.guard.close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


SSE_PING = b":\n\n"  # an SSE comment: keeps idle-timeout clients (undici) connected


class _Guards:
    """Closes (cancels unless finished) every task of the request, and its pumps."""

    def __init__(self, streams: Sequence[TaskStreamLike]) -> None:
        self.guards = [StreamGuard(s) for s in streams]
        self.pumps: list[asyncio.Future[Any]] = []

    def close(self) -> None:
        for p in self.pumps:
            if not p.done():
                p.cancel()
        for g in self.guards:
            g.close()


async def collect_all(request: Request, streams: Sequence[TaskStreamLike]) -> list[FinalResult]:
    """Every task's FinalResult, in task order; the first error is raised (the others are
    cancelled), as is a disconnect."""
    gs = _Guards(streams)

    async def drain(g: StreamGuard) -> FinalResult:
        while True:
            item = await g.next()
            if isinstance(item, FinalResult):
                return item

    async def all_done() -> list[FinalResult]:
        gs.pumps = [asyncio.ensure_future(drain(g)) for g in gs.guards]
        pending = set(gs.pumps)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            for f in done:
                if f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
        return [p.result() for p in gs.pumps]

    try:
        return await until_disconnect(request, all_done())
    finally:
        gs.close()


async def _next_or_ping(get: Callable[[], Awaitable[T]], ping_s: float) -> T | None:
    """The next result, or None after `ping_s` seconds of silence (<= 0: wait forever).
    `asyncio.timeout` arms one timer on the running task: `wait_for` would start a task per
    result."""
    if ping_s <= 0:
        return await get()
    try:
        async with asyncio.timeout(ping_s):
            return await get()
    except TimeoutError:
        return None


async def stream_all(request: Request, streams: Sequence[TaskStreamLike],
                     fmts: list[StreamFormatter], ping_s: float = -1) -> StreamingResponse:
    """SSE of several tasks, interleaved as results arrive. An error before the first result
    is a plain HTTP error; later, one error event ends the stream (the rest is cancelled).

    One task (the usual request) is read directly; several are pumped into one queue. Each
    result goes out as one body write (a chat stream's role chunk with the first text, the
    closing chunks with `[DONE]`): a write per event costs a syscall and a wake-up of the
    client each."""
    if len(streams) == 1:
        return await _stream_one(request, streams[0], fmts[0], ping_s)
    gs = _Guards(streams)
    q: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, g: StreamGuard) -> None:
        try:
            while True:
                item = await g.next()
                q.put_nowait((i, item))
                if isinstance(item, FinalResult):
                    return
        except TaskError as e:
            q.put_nowait((i, e))

    gs.pumps = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gs.guards)]
    try:
        first = await until_disconnect(request, q.get())
    except BaseException:
        gs.close()
        raise
    if isinstance(first[1], TaskError):
        gs.close()
        raise first[1]

    async def events() -> AsyncIterator[bytes]:
        try:
            started: set[int] = set()
            n_final, item = 0, first
            while True:
                i, res = item
                if isinstance(res, TaskError):
                    yield fmts[0].error(res)
                    return
                fmt = fmts[i]
                head = b""
                if i not in started:
                    started.add(i)
                    head = _events(fmt, fmt.start())
                if isinstance(res, FinalResult):
                    n_final += 1
                    body = _events(fmt, fmt.final(res))
                else:
                    body = fmt.partial_bytes(res)
                if n_final == len(fmts):
                    yield head + body + (fmts[0].done or b"")
                    return
                if head or body:
                    yield head + body
                while (got := await _next_or_ping(q.get, ping_s)) is None:
                    yield SSE_PING  # --sse-ping-interval: a ping per silence that long
                item = got
        except Exception as e:  # noqa: BLE001 - never leave tasks running or hang up silently
            log.exception("streaming failed")
            yield fmts[0].error(TaskError(500, "server_error", f"{type(e).__name__}: {e}"))
        finally:
            gs.close()

    return GuardedStreamingResponse(events(), gs)


def _events(fmt: StreamFormatter, chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(fmt.frame(c) for c in chunks)


async def _stream_one(request: Request, stream: TaskStreamLike, fmt: StreamFormatter,
                      ping_s: float) -> StreamingResponse:
    """`stream_all` of one task: its results straight from its stream (no pump, no queue)."""
    g = StreamGuard(stream)
    try:
        first = await until_disconnect(request, g.next())
    except BaseException:
        g.close()  # a TaskError already ended the task; a disconnect cancels it
        raise

    async def events() -> AsyncIterator[bytes]:
        try:
            head, res = _events(fmt, fmt.start()), first
            while not isinstance(res, FinalResult):
                body = head + fmt.partial_bytes(res)
                if body:
                    yield body
                head = b""
                while (got := await _next_or_ping(g.next, ping_s)) is None:
                    yield SSE_PING  # --sse-ping-interval: a ping per silence that long
                res = got
            yield head + _events(fmt, fmt.final(res)) + (fmt.done or b"")
        except TaskError as e:
            yield fmt.error(e)
        except Exception as e:  # noqa: BLE001 - never leave the task running or hang up silently
            log.exception("streaming failed")
            yield fmt.error(TaskError(500, "server_error", f"{type(e).__name__}: {e}"))
        finally:
            g.close()

    return GuardedStreamingResponse(events(), g)
