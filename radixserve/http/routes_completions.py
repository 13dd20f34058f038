"""Completion routes: llama-server's /completion and OpenAI's /v1/completions and
/v1/chat/completions, streamed (SSE) or not.

Parsing and tokenizing run in a worker thread (long prompts must not stall the event loop); from
`submit` on, every path ends the task (a disconnect cancels it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from radixserve.http import info, openapi
from radixserve.http.errors import read_json
from radixserve.http.parse import ParseContext, ParsedRequest, parse_chat, parse_completion
from radixserve.http.responses import (
    ResponseContext,
    chat_completion_json,
    completion_json,
    random_id,
    text_completion_json,
)
from radixserve.http.sse import ChatStream, NativeStream, StreamFormatter, TextStream
from radixserve.http.state import AppState
from radixserve.http.streaming import collect_all, stream_all

Parser = Callable[[Any, ParseContext], ParsedRequest]


@dataclass(frozen=True, slots=True)
class ApiShape:
    """One completion API: how its body becomes tasks (`parse`), its non-streamed answer
    (`build(final, req, ctx)`), its stream (`stream(req, ctx)`, a formatter) and its ids'
    prefix. llama-server's and OpenAI's are `KINDS`; other APIs bring their own."""

    parse: Parser
    build: Callable[..., Any]
    stream: Callable[..., StreamFormatter]
    prefix: str


KINDS: dict[str, ApiShape] = {
    "native": ApiShape(parse_completion, completion_json, NativeStream, ""),
    "text": ApiShape(parse_completion, text_completion_json, TextStream, "cmpl-"),
    "chat": ApiShape(parse_chat, chat_completion_json, ChatStream, "chatcmpl-"),
}

Completer = Callable[[Request, "str | ApiShape", Parser | None], Awaitable[Response]]


def completion_handler(state: AppState) -> Completer:
    """`complete(request, kind, parse=None)`: a completion of `kind` (native, text, chat, or
    an `ApiShape`), its body parsed by `parse` (None: the kind's parser; /infill brings its
    own)."""
    def ping_s(req: ParsedRequest) -> int:
        """Seconds of silence before an SSE ping: the request's, else --sse-ping-interval."""
        return state.cfg.sse_ping_interval if req.sse_ping_interval is None \
            else req.sse_ping_interval

    async def complete(request: Request, kind: str | ApiShape,
                       parse: Parser | None = None) -> Response:
        api = KINDS[kind] if isinstance(kind, str) else kind
        build, formatter, prefix = api.build, api.stream, api.prefix
        parse = parse or api.parse
        body = await read_json(request)
        req = await run_in_threadpool(parse, body, state.parse_ctx)  # tokenizing off the loop
        e = state.eng
        ctx = ResponseContext(
            info.model_alias(state.model, state.cfg),
            state.model.tokenizer,
            e.n_ctx_slot,
            id=random_id(prefix),
        )
        subs = req.per_task()  # several prompts and/or n_cmpl > 1: parents before children
        fmts = [formatter(sub, ctx) for sub in subs] if req.stream else []
        streams = [e.submit(sub.task) for sub in subs]  # from here on, every path ends them
        if req.stream:
            return await stream_all(request, streams, fmts, ping_s(req))
        finals = await collect_all(request, streams)

        def shape() -> Any:
            """One task: its body. Several: /completion an array, OpenAI one object whose
            `choices` are every task's (usage and timings of the first, as llama-server)."""
            bodies = [build(f, sub, ctx) for f, sub in zip(finals, subs)]
            if len(bodies) == 1:
                return bodies[0]
            if kind == "native":
                return bodies
            for b in bodies[1:]:
                bodies[0]["choices"].append(b["choices"][0])
            return bodies[0]

        return JSONResponse(await run_in_threadpool(shape))

    return complete


def add_routes(r: APIRouter, state: AppState) -> None:
    complete = completion_handler(state)

    @r.post("/completion", openapi_extra=openapi.COMPLETION)
    @r.post("/completions", openapi_extra=openapi.COMPLETION)
    async def native_completion(request: Request) -> Response:
        return await complete(request, "native")

    @r.post("/v1/completions", openapi_extra=openapi.COMPLETION)
    async def oai_completion(request: Request) -> Response:
        return await complete(request, "text")

    @r.post("/chat/completions", openapi_extra=openapi.CHAT)
    @r.post("/v1/chat/completions", openapi_extra=openapi.CHAT)
    async def chat_completion(request: Request) -> Response:
        return await complete(request, "chat")
