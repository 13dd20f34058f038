"""The checks llama-server runs before routing: "still loading" (503) and the API key (401).

A plain ASGI middleware (not BaseHTTPMiddleware) so streamed responses and disconnect
detection pass through untouched.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any, Protocol

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.http.errors import error_response

log = logging.getLogger(__name__)

PUBLIC_PATHS = frozenset({"/health", "/v1/health"})


class GateState(Protocol):
    engine: Any  # None while the model loads
    load_error: str | None

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
        if state.engine is None:  # every route, /health included, as llama-server
            if state.load_error is not None:
                resp = error_response(500, f"Failed to load model: {state.load_error}")
            else:
                resp = error_response(503, "Loading model")
            await resp(scope, receive, send)
            return
        guarded = scope["method"] != "OPTIONS" and scope["path"] not in PUBLIC_PATHS
        if (
            state.api_keys
            and guarded
            and not key_ok(request_api_key(Headers(scope=scope)), state.api_keys)
        ):
            await error_response(401, "Invalid API Key")(scope, receive, send)
            return
        await self.app(scope, receive, send)
