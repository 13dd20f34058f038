"""The routes: llama-server's (/health, /props, /slots, /metrics, /completion, tokenizer
endpoints) and OpenAI's (/v1/models, /v1/completions, /v1/chat/completions).

Handlers validate, tokenize (in a worker thread: long prompts must not stall the event loop),
talk to the engine only through `submit` and `call`, and shape JSON.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from radixserve.http import info
from radixserve.http.errors import GuardedRoute, error_response, read_json
from radixserve.http.prometheus import CONTENT_TYPE, render_metrics
from radixserve.http.parse import parse_chat, parse_completion, render_chat
from radixserve.http.responses import (
    ResponseContext,
    chat_completion_json,
    completion_json,
    random_id,
    text_completion_json,
)
from radixserve.http.schemas import ChatRequest, validate_body
from radixserve.http.sse import ChatStream, NativeStream, TextStream
from radixserve.http.streaming import collect_final, stream_response
from radixserve.engine.task import invalid_request
from radixserve.http.routes_tokenize import detokenize, tokenize

if TYPE_CHECKING:
    from radixserve.http.app import AppState

log = logging.getLogger(__name__)

# endpoint kind -> (parser, non-stream body, stream formatter, id prefix)
_KINDS: dict[str, tuple[Callable, Callable, type, str]] = {
    "native": (parse_completion, completion_json, NativeStream, ""),
    "text": (parse_completion, text_completion_json, TextStream, "cmpl-"),
    "chat": (parse_chat, chat_completion_json, ChatStream, "chatcmpl-"),
}
SLOT_ACTIONS = ("save", "restore", "erase")


def build_router(state: AppState) -> APIRouter:
    """All routes over `state` (the gate middleware guarantees `state.engine` is set)."""
    r = APIRouter(route_class=GuardedRoute)

    @r.get("/health")
    @r.get("/v1/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @r.get("/props")
    async def props() -> Response:
        e = state.engine
        stats = await e.call(e.cache_stats)
        facts = await state.facts()
        body = info.props_json(state.model, facts, state.cfg, e.n_ctx_slot, e.n_slots, stats)
        return JSONResponse(body)

    @r.post("/props")
    async def set_props() -> Response:
        return error_response(501, "This server does not support changing global properties.")

    @r.get("/models")
    @r.get("/v1/models")
    async def models() -> Response:
        facts = await state.facts()
        body = info.models_json(
            state.model, facts, state.cfg, state.engine.n_ctx_slot, state.started
        )
        return JSONResponse(body)

    @r.get("/slots")
    async def slots(request: Request) -> Response:
        e = state.engine
        if not state.cfg.slots_endpoint:
            return error_response(
                501, "This server does not support slots endpoint. Start it with `--slots`"
            )
        fail_on_no_slot = request.query_params.get("fail_on_no_slot", "") not in ("", "0", "false")
        if fail_on_no_slot and not await e.call(e.is_idle_slot_available):
            return error_response(503, "no slot available")
        return JSONResponse(await e.call(e.slots_json))

    @r.post("/slots/{id_slot}")
    async def slot_action(id_slot: str, request: Request) -> Response:
        e = state.engine
        if not state.cfg.slot_save_path or not hasattr(e, "slot_action"):
            return error_response(
                501, "This server does not support slots action. Start it with `--slot-save-path`"
            )
        try:
            sid = int(id_slot)
        except ValueError:
            raise invalid_request("Invalid slot ID") from None
        action = request.query_params.get("action")
        if action not in SLOT_ACTIONS:
            raise invalid_request("Invalid action")
        filename = None
        if action != "erase":
            body = await read_json(request)
            filename = body.get("filename") if isinstance(body, dict) else None
            if not isinstance(filename, str):
                raise invalid_request("Field 'filename' is required and must be a string")
        result = await e.call(lambda: e.slot_action(sid, action, filename))
        if inspect.isawaitable(result):
            result = await result
        return JSONResponse(result)

    @r.get("/metrics")
    async def metrics() -> Response:
        e = state.engine
        if not state.cfg.metrics:
            return error_response(
                501, "This server does not support metrics endpoint. Start it with `--metrics`"
            )
        snap, stats = await e.call(lambda: (e.metrics.scrape(), e.cache_stats()))
        headers = {"Process-Start-Time-Unix": str(state.started)}
        return Response(render_metrics(snap, stats), media_type=CONTENT_TYPE, headers=headers)

    async def complete(request: Request, kind: str) -> Response:
        parse, build, formatter, prefix = _KINDS[kind]
        body = await read_json(request)
        req = await run_in_threadpool(parse, body, state.parse_ctx)  # tokenizing off the loop
        ctx = ResponseContext(
            info.model_alias(state.model, state.cfg),
            state.model.tokenizer,
            state.engine.n_ctx_slot,
            id=random_id(prefix),
        )
        fmt = formatter(req, ctx) if req.stream else None
        stream = state.engine.submit(req.task)  # from here on, every path must end the task
        if fmt is not None:
            return await stream_response(request, stream, fmt)
        final = await collect_final(request, stream)
        return JSONResponse(await run_in_threadpool(build, final, req, ctx))

    @r.post("/completion")
    @r.post("/completions")
    async def native_completion(request: Request) -> Response:
        return await complete(request, "native")

    @r.post("/v1/completions")
    async def oai_completion(request: Request) -> Response:
        return await complete(request, "text")

    @r.post("/chat/completions")
    @r.post("/v1/chat/completions")
    async def chat_completion(request: Request) -> Response:
        return await complete(request, "chat")

    @r.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        body = await read_json(request)
        return JSONResponse(await run_in_threadpool(tokenize, body, state.model.tokenizer))

    @r.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        body = await read_json(request)
        return JSONResponse(await run_in_threadpool(detokenize, body, state.model.tokenizer))

    @r.post("/apply-template")
    async def apply_template(request: Request) -> Response:
        req = validate_body(ChatRequest, await read_json(request))
        m = state.model
        prompt = await run_in_threadpool(render_chat, req, m.chat_template, m.tokenizer)
        return JSONResponse({"prompt": prompt})

    return r
