"""Every failure as an OpenAI-shaped error `{"error": {"code", "message", "type"}}`.

`GuardedRoute` wraps each handler so a `TaskError` becomes its status and body, and any other
exception a 500 `server_error` carrying the message, logged once; the server keeps serving.
Framework-level failures (unknown route, bad path parameters) get the same shape.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from radixserve.errors import TaskError, invalid_request

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


class ClientDisconnected(Exception):
    """The client went away before the response was ready; its task has been cancelled."""


def error_response(status: int, message: str, type_: str | None = None, **extra: Any) -> Response:
    type_ = type_ or ERROR_TYPES.get(status, "invalid_request_error")
    return task_error_response(TaskError(status, type_, message, **extra))


def task_error_response(e: TaskError) -> Response:
    return JSONResponse(e.to_json(), status_code=e.status)


# a UTF-16 surrogate in the raw body: an escape (\uD800-\uDFFF) or its UTF-8 form, which
# json.loads lets through too (surrogatepass); only then are the decoded strings checked
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


async def read_json(request: Request) -> Any:
    """The decoded body; malformed JSON is a 400 (llama-server gives 500, tests accept both).
    So are what Python's decoder cannot take (JSON nested deeper than it recurses, an integer
    of more than 4300 digits) and a lone surrogate in a string (valid JSON to Python, but no
    text: it fails wherever the string is encoded; llama-server's parser refuses it)."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, int digits limit
        raise invalid_request(f"Invalid JSON in request body: {e}") from None
    except RecursionError:
        raise invalid_request("Invalid JSON in request body: nested too deeply") from None
    if _MAYBE_SURROGATE.search(raw) and not _all_text(body):
        raise invalid_request("Invalid JSON in request body: a string holds a lone UTF-16 "
                              "surrogate (not UTF-8 text)")
    return body


def _all_text(value: Any) -> bool:
    """Every string in `value` (keys too) is encodable as UTF-8 (no lone surrogate)."""
    stack = [value]
    while stack:  # not recursive: bodies nest as deep as the decoder allows
        v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return False
        elif isinstance(v, dict):
            stack += v
            stack += v.values()
        elif isinstance(v, list):
            stack += v
    return True


Handler = Callable[[Request], Coroutine[Any, Any, Response]]


class GuardedRoute(APIRoute):
    """An APIRoute whose handler never lets an exception escape as a bare 500 page; its errors
    in OpenAI's shape (`error_shape`: another API's routes answer in their own)."""

    error_shape: Callable[[TaskError], Response] = staticmethod(task_error_response)

    def get_route_handler(self) -> Handler:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except TaskError as e:
                if e.status >= 500:
                    log.error("%s %s: %s", request.method, request.url.path, e.message)
                return self.error_shape(e)
            except (ClientDisconnected, ClientDisconnect):  # ours, or starlette's mid-body
                log.info("%s %s: client disconnected", request.method, request.url.path)
                return Response(status_code=499)
            except (StarletteHTTPException, RequestValidationError):
                raise  # shaped by the exception handlers below
            except Exception as e:
                log.exception("%s %s failed", request.method, request.url.path)
                return self.error_shape(TaskError(500, "server_error", f"{type(e).__name__}: {e}"))

        return guarded


# Anthropic's error types (its Messages API: /v1/messages), by status; others by class
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")


def anthropic_error_json(e: TaskError) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`, Anthropic's shape of `e`."""
    type_ = ANTHROPIC_ERROR_TYPES.get(
        e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": type_, "message": e.message}}


def anthropic_error_response(e: TaskError) -> Response:
    return JSONResponse(anthropic_error_json(e), status_code=e.status)


class AnthropicRoute(GuardedRoute):
    """A GuardedRoute answering its errors in Anthropic's shape (routes_messages.py)."""

    error_shape = staticmethod(anthropic_error_response)


def error_for_path(path: str, status: int, message: str, type_: str | None = None) -> Response:
    """An error before (or outside) routing, in the shape of the API the request's `path`
    belongs to (under any --api-prefix): Anthropic's for its routes, else OpenAI's."""
    if path.endswith(ANTHROPIC_PATHS):
        return anthropic_error_response(TaskError(status, type_ or "", message))
    return error_response(status, message, type_)


def _validation_message(e: RequestValidationError) -> str:
    err = e.errors()[0] if e.errors() else {}
    where = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path"))
    return f"Field '{where}': {err.get('msg', 'invalid value')}" if where else str(e)


def install_error_handlers(app: FastAPI) -> None:
    """Unknown routes, wrong methods and parameter errors in the OpenAI error shape."""

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> Response:
        message = "File Not Found" if e.status_code == 404 else str(e.detail)
        return error_for_path(request.url.path, e.status_code, message)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> Response:
        return error_response(400, _validation_message(e))
