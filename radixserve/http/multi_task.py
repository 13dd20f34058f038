"""Requests that run several tasks: an array of prompts, `n`/`n_cmpl` > 1 (llama-server's
server_response_reader over post_tasks / wait_for_all).

All tasks are submitted at once and run concurrently. Without streaming the handler waits for
every final result (the first error fails the request and cancels the rest). With streaming,
each task's chunks go out as they come, each carrying the task's `index`; OpenAI streams end
with one `[DONE]` after the last task's closing chunk. Every path ends every task.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from radixserve.engine.task import FinalResult, TaskError
from radixserve.http.parse import ParsedRequest
from radixserve.http.sse import StreamFormatter, sse_error, sse_event
from radixserve.http.streaming import (
    SSE_PING,
    GuardedStreamingResponse,
    StreamGuard,
    TaskStreamLike,
    until_disconnect,
)

log = logging.getLogger(__name__)


def per_task(req: ParsedRequest) -> list[ParsedRequest]:
    """One ParsedRequest per task (same response options), for formatting its result."""
    return [dataclasses.replace(req, task=t, tasks=[t]) for t in req.tasks]


class _Guards:
    """Closes (cancels unless finished) every task of the request, and the pumps."""

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


async def stream_all(request: Request, streams: Sequence[TaskStreamLike],
                     fmts: list[StreamFormatter], ping_s: float = -1) -> StreamingResponse:
    """SSE of several tasks, interleaved as results arrive. An error before the first result
    is a plain HTTP error; later, one error event ends the stream (the rest is cancelled)."""
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
                    yield sse_error(res)
                    return
                fmt = fmts[i]
                if i not in started:
                    started.add(i)
                    for chunk in fmt.start():
                        yield sse_event(chunk)
                if isinstance(res, FinalResult):
                    n_final += 1
                    chunks = fmt.final(res)
                else:
                    chunks = fmt.partial(res)
                for chunk in chunks:
                    yield sse_event(chunk)
                if n_final == len(fmts):
                    break
                while True:  # --sse-ping-interval: a ping per silence that long
                    try:
                        item = await asyncio.wait_for(q.get(), ping_s if ping_s > 0 else None)
                        break
                    except asyncio.TimeoutError:
                        yield SSE_PING
            if fmts[0].done:
                yield fmts[0].done
        except Exception as e:  # noqa: BLE001 - never leave tasks running or hang up silently
            log.exception("streaming failed")
            yield sse_error(TaskError(500, "server_error", f"{type(e).__name__}: {e}"))
        finally:
            gs.close()

    return GuardedStreamingResponse(events(), gs)  # type: ignore[arg-type]
