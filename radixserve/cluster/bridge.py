"""An HTTP request carried through Ray as plain data, and run on a replica's own ASGI app.

The replica runs the app `radixserve serve` runs, in process: the request's method, path,
headers and body go in, and the response comes back as a stream of items, `Head` first,
then body chunks. Every route therefore behaves on the cluster as on one server. When the
caller goes away (Ray cancels the generator), the app sees `http.disconnect`, so the engine
cancels the task and frees its slot, as when a client of `serve` disconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message


APP_EXIT_WAIT_S = 5.0  # after the caller left, the app's time to wind down before cancelling


@dataclass
class Forwarded:
    """`route_key` steers the prefix router; `target` (a replica id) pins the replica, for
    per-replica routes such as /replicas/{i}/metrics."""

    method: str
    path: str
    query: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    client: tuple[str, int] | None = None
    route_key: str | None = None
    target: str | None = None


@dataclass
class Head:
    status: int
    headers: list[tuple[bytes, bytes]]


def scope_of(req: Forwarded) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": req.method, "scheme": "http",
        "path": req.path, "raw_path": req.path.encode(), "root_path": "",
        "query_string": req.query, "headers": list(req.headers),
        "client": req.client or ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
    }


async def run_asgi(app: ASGIApp, req: Forwarded) -> AsyncGenerator[Head | bytes, None]:
    """Yield the response's head, then its body chunks, until the app ends the body."""
    out: asyncio.Queue[Message | BaseException | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await out.put(message)

    async def call() -> None:
        try:
            await app(scope_of(req), receive, send)
            await out.put(None)
        except BaseException as e:  # the app's own error handlers answer request errors
            await out.put(e)
            raise

    task = asyncio.ensure_future(call())
    try:
        while True:
            msg = await out.get()
            if msg is None:
                return
            if isinstance(msg, BaseException):
                raise msg
            if msg["type"] == "http.response.start":
                yield Head(msg["status"], [(bytes(k), bytes(v)) for k, v in msg["headers"]])
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield bytes(msg["body"])
                if not msg.get("more_body", False):
                    return
    finally:
        gone.set()  # the app's disconnect watchers end; a cancelled caller cancels the task
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(task), timeout=APP_EXIT_WAIT_S)
        if not task.done():
            task.cancel()
