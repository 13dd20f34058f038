"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (anthropic.py),
as llama-server serves it (the same two paths). Their errors, every one, are in Anthropic's
shape (`AnthropicRoute`); `x-api-key` is checked as --api-key's key (middleware.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from radixserve.http import anthropic, openapi
from radixserve.http.errors import AnthropicRoute, read_json
from radixserve.http.routes_completions import ApiShape, completion_handler
from radixserve.http.state import AppState

MESSAGES = ApiShape(anthropic.parse_messages, anthropic.message_json, anthropic.MessageStream,
                    "msg_")


def add_routes(r: APIRouter, state: AppState) -> None:
    complete = completion_handler(state)

    async def messages(request: Request) -> Response:
        return await complete(request, MESSAGES)

    async def count_tokens(request: Request) -> Response:
        body = await read_json(request)
        return JSONResponse(await run_in_threadpool(anthropic.count_tokens, body,
                                                    state.parse_ctx))

    for path, endpoint, doc in (("/v1/messages", messages, openapi.MESSAGES),
                                ("/v1/messages/count_tokens", count_tokens,
                                 openapi.COUNT_TOKENS)):
        r.add_api_route(path, endpoint, methods=["POST"], route_class_override=AnthropicRoute,
                        openapi_extra=doc, responses=openapi.ANTHROPIC_ERROR_RESPONSES)
