"""The checks llama-server runs before routing: "still loading" (503), the API key (401), and
the request body's size (413) and arrival (408, --timeout).

A plain ASGI middleware (not BaseHTTPMiddleware) so streamed responses and disconnect
detection pass through untouched.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any, Protocol

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.errors import TaskError
from radixserve.http.errors import error_for_path, error_response

log = logging.getLogger(__name__)

PUBLIC_PATHS = ("/health", "/v1/health")


class GateState(Protocol):
    engine: Any  # None while the model loads
    load_error: str | None
    ui_paths: frozenset[str]  # the page's files: public, and served while the model loads

    @property
    def api_prefix(self) -> str: ...

    @property
    def api_keys(self) -> list[str]: ...


def request_api_key(headers: Headers) -> str:
    """`Authorization: Bearer K` (the prefix is optional), else `X-Api-Key: K`."""
    auth = headers.get("authorization", "")
    if auth:
        return auth[7:] if auth[:7].lower() == "bearer " else auth
    return headers.get("x-api-key", "")


def key_ok(key: str, keys: list[str]) -> bool:
    return any(hmac.compare_digest(key.encode(), k.encode()) for k in keys)


class GateMiddleware:
    def __init__(self, app: ASGIApp, state: GateState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = self.state
        path = scope["path"].removeprefix(state.api_prefix)
        if path in state.ui_paths:  # the page shows "loading" and asks for the key itself
            await self.app(scope, receive, send)
            return
        if state.engine is None:  # every other route, /health included, as llama-server
            if state.load_error is not None:
                resp = error_for_path(path, 500, f"Failed to load model: {state.load_error}")
            else:
                resp = error_for_path(path, 503, "Loading model")
            await resp(scope, receive, send)
            return
        guarded = scope["method"] != "OPTIONS" and path not in PUBLIC_PATHS
        if (
            state.api_keys
            and guarded
            and not key_ok(request_api_key(Headers(scope=scope)), state.api_keys)
        ):
            await error_for_path(path, 401, "Invalid API Key")(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyGuard:
    """llama-server's limits on reading a request: a body larger than `max_bytes` is a 413
    (refused from Content-Length before reading, or as soon as a chunked body passes it), and
    a client silent for `timeout_s` while sending its body is a 408 (--timeout). Raised as
    TaskError from `receive`, so the route's error handling shapes the answer."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            await error_for_path(scope["path"], 413, too_large_message(self.max_bytes),
                                 "invalid_request_error")(scope, receive, send)
            return
        seen, done = 0, False

        async def guarded() -> Message:
            nonlocal seen, done
            if done:  # the body is read: later receives wait for a disconnect, untimed
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                raise TaskError(408, "invalid_request_error",
                                f"request body not received within {self.timeout_s:g} s "
                                "(--timeout)") from None
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                done = not msg.get("more_body", False)
                if seen > self.max_bytes:
                    raise TaskError(413, "invalid_request_error", too_large_message(self.max_bytes))
            else:
                done = True
            return msg

        await self.app(scope, guarded, send)


def too_large_message(max_bytes: int) -> str:
    return f"request body larger than {max_bytes} bytes (--max-body-mib)"


def too_large(max_bytes: int) -> Any:
    """The 413 for a body past --max-body-mib (one server's and the cluster ingress's)."""
    return error_response(413, too_large_message(max_bytes), "invalid_request_error")
