"""`--sleep-idle-seconds N`: after N idle seconds the engine releases the model's weights and
the device KV (engine.py `Engine.sleep`); the next request that needs the model reloads it.

As llama-server (server-queue.cpp start_loop, server-context.cpp create_response): requests
that need the model wait until it is loaded again; /health answers at once and GET /props,
/models (/v1/models) and /metrics answer during sleep from what they said when the server fell
asleep (/props with `"is_sleeping": true`), without waking it and without counting as
activity (/metrics does not reset llama-server's idle timer; the others post no task). The
page's files and GET /cache (its view, polled while the page is open) are served the same way.

Beyond llama-server, the host cache tiers (RAM, disk) are kept: a slot's KV goes to them
before the device KV is released, so the first request after waking reuses its prefix.

No request meets a half-released engine: a request is counted in flight from the moment it
passes here until its response ends, and the server falls asleep only when none is, and only
after the idle time; from then until it is awake again every request that needs the model
waits. Transitions run on the event loop one at a time; the engine does the releasing and the
reloading on its own thread (and would reload for a task that reached it asleep anyway).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from typing import Any

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.http.errors import error_for_path
from radixserve.http.state import AppState

log = logging.getLogger(__name__)

LIVE_WHILE_ASLEEP = frozenset({"/health", "/v1/health"})  # they never touch the engine
# answered from a snapshot taken when the server fell asleep (GET only)
SNAPSHOT_PATHS = ("/props", "/models", "/v1/models", "/metrics", "/cache")


class Phase(enum.Enum):
    AWAKE = "awake"
    FALLING_ASLEEP = "falling asleep"
    ASLEEP = "asleep"
    WAKING = "waking"


class IdleSleep:
    def __init__(self, state: AppState, idle_s: float) -> None:
        self.state, self.idle_s = state, idle_s
        self.phase = Phase.AWAKE
        self.in_flight = 0  # requests inside the app now (any kind)
        self.last_activity: float | None = None  # monotonic; None until the engine is ready
        self.inner: ASGIApp | None = None  # the app below the middleware (for snapshots)
        self.app_obj: Any = None  # the application (scope["app"]), for snapshot scopes
        self.snapshots: dict[str, tuple[int, list[tuple[bytes, bytes]], bytes]] = {}
        self._settled = asyncio.Event()  # set unless a transition is under way
        self._settled.set()
        self.sleeps = self.wakes = 0
        self.failures = 0  # reloads that failed; every request waiting on one gets its error
        self.wake_error = ""

    @property
    def tick_s(self) -> float:
        return max(0.05, min(1.0, self.idle_s / 4))

    async def run(self) -> None:
        """The idle clock (a task for the app's lifetime)."""
        while True:
            await asyncio.sleep(self.tick_s)
            eng = self.state.engine
            if (eng is None or self.state.load_error is not None or self.phase is Phase.ASLEEP
                    or not getattr(eng, "can_sleep", False)):
                continue  # loading, failed, or an engine that cannot reload (test doubles)
            now = time.monotonic()
            if self.last_activity is None:
                self.last_activity = now  # llama-server counts from the loop's start
            if (self.phase is Phase.AWAKE and self.in_flight == 0 and self.inner is not None
                    and now - self.last_activity >= self.idle_s):
                await self._fall_asleep(eng)

    async def _fall_asleep(self, eng: Any) -> None:
        self.phase = Phase.FALLING_ASLEEP  # from here on requests wait (no await before this)
        self._settled.clear()
        since, asleep = self.last_activity, False
        try:
            snaps = await self._snapshots()
            # a request that came meanwhile (it waits) keeps the model: no sleep to undo
            if self.last_activity == since:
                # False while a task runs or waits (a client left); shielded: a cancelled
                # transition still ends with the engine's state known
                asleep = await asyncio.shield(eng.sleep())
        except Exception:
            log.exception("could not enter the sleeping state")
        finally:
            asleep = asleep or bool(getattr(eng, "sleeping", False))
            if asleep:
                self.snapshots, self.phase = snaps, Phase.ASLEEP
                self.sleeps += 1
            else:
                self.phase, self.last_activity = Phase.AWAKE, time.monotonic()
            self._settled.set()

    async def wake(self) -> str | None:
        """Until the engine is awake (reloading it if it sleeps): None, or the error of the
        reload this request made or waited for (the next request tries again)."""
        failures = self.failures
        while True:
            if self.phase is Phase.AWAKE:
                return None
            if self.phase is Phase.ASLEEP:
                if self.failures != failures:
                    return self.wake_error
                self.phase = Phase.WAKING
                self._settled.clear()
                eng = self.state.eng
                try:
                    await asyncio.shield(eng.wake())  # a cancelled request: the reload goes on
                except Exception as e:
                    log.exception("failed to reload the model after sleeping")
                    self.failures += 1
                    self.wake_error = f"{type(e).__name__}: {e}"
                    return self.wake_error
                else:
                    self.snapshots, self.last_activity = {}, time.monotonic()
                    self.wakes += 1
                    return None
                finally:  # the engine says where it is (a failed or cancelled reload)
                    self.phase = Phase.ASLEEP if getattr(eng, "sleeping", False) else Phase.AWAKE
                    self._settled.set()
            await self._settled.wait()

    # -- snapshots: the inner app's own answers, taken while it is still awake ------------------
    async def _snapshots(self) -> dict[str, tuple[int, list[tuple[bytes, bytes]], bytes]]:
        out = {}
        for path in SNAPSHOT_PATHS:
            status, headers, body = await self._get(self.state.api_prefix + path)
            if path == "/props" and status == 200:
                props = json.loads(body)
                props["is_sleeping"] = True
                body = json.dumps(props, ensure_ascii=False, separators=(",", ":")).encode()
            out[path] = (status, [(k, v) for k, v in headers if k.lower() != b"content-length"],
                         body)
        return out

    async def _get(self, path: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        assert self.inner is not None
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": "1.1", "method": "GET", "scheme": "http", "path": path,
                 "raw_path": path.encode(), "root_path": "", "query_string": b"",
                 "headers": [(b"host", b"localhost")], "client": ("127.0.0.1", 0),
                 "server": ("127.0.0.1", 0), "state": {}, "app": self.app_obj}
        done = asyncio.Event()
        sent = False
        status, headers, body = 500, [], bytearray()

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(msg: Message) -> None:
            nonlocal status, headers
            if msg["type"] == "http.response.start":
                status, headers = msg["status"], list(msg.get("headers", []))
            elif msg["type"] == "http.response.body":
                body.extend(msg.get("body", b""))
                if not msg.get("more_body", False):
                    done.set()

        await self.inner(scope, receive, send)
        done.set()
        return status, headers, bytes(body)


class SleepMiddleware:
    """Counts requests in flight and the last activity; while the server sleeps, answers what
    llama-server answers asleep and holds every other request until the model is back."""

    def __init__(self, app: ASGIApp, sleeper: IdleSleep | None) -> None:
        self.app, self.sleeper = app, sleeper
        if sleeper is not None:
            sleeper.inner = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        z = self.sleeper
        if z is None or scope["type"] != "http":
            if z is not None and z.app_obj is None:
                z.app_obj = scope.get("app")
            await self.app(scope, receive, send)
            return
        if z.app_obj is None:
            z.app_obj = scope.get("app")
        prefix, raw = z.state.api_prefix, scope["path"]
        path = raw[len(prefix):] if raw.startswith(prefix) else ""  # "": not under the prefix
        if (path in LIVE_WHILE_ASLEEP or path in z.state.ui_paths or scope["method"] == "OPTIONS"
                or not _routed(scope)):  # a 404 (a scanner, a probe) never wakes the model
            await self._inside(scope, receive, send, activity=False)
            return
        snapshot = scope["method"] == "GET" and path in SNAPSHOT_PATHS
        if snapshot:
            while z.phase is not Phase.AWAKE:
                if z.phase is Phase.ASLEEP and path in z.snapshots:
                    await _replay(z.snapshots[path], send)
                    return
                if z.phase is Phase.ASLEEP:
                    break  # no snapshot of it: wake
                await z._settled.wait()
            if z.phase is Phase.AWAKE:
                await self._inside(scope, receive, send, activity=False)
                return
        z.last_activity = time.monotonic()
        error = await z.wake()
        if error is not None:
            await error_for_path(raw, 500, f"Failed to load model: {error}", "server_error")(
                scope, receive, send)
            return
        await self._inside(scope, receive, send, activity=True)

    async def _inside(self, scope: Scope, receive: Receive, send: Send, activity: bool) -> None:
        z = self.sleeper
        assert z is not None
        z.in_flight += 1  # no await since the phase was seen awake: the clock cannot interleave
        try:
            await self.app(scope, receive, send)
        finally:
            z.in_flight -= 1
            if activity:
                z.last_activity = time.monotonic()


def _routed(scope: Scope) -> bool:
    """Whether a route of the app answers this path (a request no route takes is a 404 that
    needs no model)."""
    router = getattr(scope.get("app"), "router", None)
    if router is None:
        return True
    return any(r.matches(scope)[0] is not Match.NONE for r in router.routes)


async def _replay(snap: tuple[int, list[tuple[bytes, bytes]], bytes], send: Send) -> None:
    status, headers, body = snap
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
