"""Driving a `TaskStream` for one HTTP request: SSE or one JSON, cancelling on disconnect.

A slot generating for a client that has gone away wastes the whole engine, so every path
that can lose the client (waiting for the first token, mid-stream, waiting for a
non-streamed result) ends in `StreamGuard.close()`, which cancels the task unless it already
finished. Errors before the first result become normal HTTP errors; later ones are sent as
one `data: {"error": ...}` event, as llama-server does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from radixserve.engine.task import FinalResult, PartialResult, TaskError
from radixserve.http.errors import ClientDisconnected
from radixserve.http.sse import StreamFormatter, sse_error, sse_event

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


async def collect_final(request: Request, stream: TaskStreamLike) -> FinalResult:
    """Non-streamed request: the FinalResult; the task is cancelled if the client leaves."""
    guard = StreamGuard(stream)

    async def drain() -> FinalResult:
        while True:
            item = await guard.next()
            if isinstance(item, FinalResult):
                return item

    try:
        return await until_disconnect(request, drain())
    finally:
        guard.close()


class GuardedStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its generator and guard however sending ends.

    Starlette cancels the sending task on disconnect; a generator suspended at `yield` would
    then only be finalized by the garbage collector, leaving the slot busy until then.
    """

    def __init__(self, body: AsyncIterator[bytes], guard: StreamGuard) -> None:
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


async def _events(
    first: PartialResult | FinalResult, guard: StreamGuard, fmt: StreamFormatter,
    ping_s: float = -1,
) -> AsyncIterator[bytes]:
    try:
        for chunk in fmt.start():
            yield sse_event(chunk)
        item = first
        while not isinstance(item, FinalResult):
            for chunk in fmt.partial(item):
                yield sse_event(chunk)
            nxt = asyncio.ensure_future(guard.next())
            try:
                # --sse-ping-interval: a ping each time the engine stays silent that long
                while not (await asyncio.wait({nxt}, timeout=ping_s if ping_s > 0 else None))[0]:
                    yield SSE_PING
                item = nxt.result()
            except TaskError as e:
                yield sse_error(e)
                return
            finally:
                nxt.cancel()
        for chunk in fmt.final(item):
            yield sse_event(chunk)
        if fmt.done:
            yield fmt.done
    except Exception as e:  # a bug in formatting must not leave the slot busy or hang up silently
        log.exception("streaming failed")
        yield sse_error(TaskError(500, "server_error", f"{type(e).__name__}: {e}"))
    finally:
        guard.close()


async def stream_response(
    request: Request, stream: TaskStreamLike, fmt: StreamFormatter, ping_s: float = -1
) -> StreamingResponse:
    """SSE response; waits for the first result so an early error is a plain HTTP error."""
    guard = StreamGuard(stream)
    try:
        first = await until_disconnect(request, guard.next())
    except BaseException:
        guard.close()
        raise
    return GuardedStreamingResponse(_events(first, guard, fmt, ping_s), guard)
