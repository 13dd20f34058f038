"""OpenAI's Responses API: create (streamed or not), count input tokens, retrieve, delete.

`POST /v1/responses` (and `/responses`) and `POST /v1/responses/input_tokens` (and
`/responses/input_tokens`) are llama-server's routes; `GET` and `DELETE /v1/responses/{id}`
(and `/responses/{id}`, as POST has both) are OpenAI's, which llama-server does not have (it
stores nothing). Stored responses live in
this app's `ResponseStore` (response_store.py), in the namespace of the request's
`cache_salt`: GET and DELETE name it with the `cache_salt` query parameter (absent: the
shared namespace).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from radixserve.http import openapi
from radixserve.http.errors import read_json
from radixserve.http.oai_responses import count_input_tokens, not_found, responses_shape
from radixserve.http.response_store import ResponseStore
from radixserve.http.routes_completions import completion_handler
from radixserve.http.state import AppState

SaltQuery = Annotated[str | None, Query(description="the cache_salt the response was created "
                                                    "with (absent: none)")]


def add_routes(r: APIRouter, state: AppState) -> None:
    store = ResponseStore()
    shape = responses_shape(store)
    complete = completion_handler(state)

    @r.post("/responses", openapi_extra=openapi.RESPONSES)
    @r.post("/v1/responses", openapi_extra=openapi.RESPONSES)
    async def create_response(request: Request) -> Response:
        return await complete(request, shape)

    @r.post("/responses/input_tokens", openapi_extra=openapi.RESPONSES_INPUT_TOKENS)
    @r.post("/v1/responses/input_tokens", openapi_extra=openapi.RESPONSES_INPUT_TOKENS)
    async def input_tokens(request: Request) -> Response:
        """The prompt's length in tokens, as the request would be run (llama-server's
        `{"object": "response.input_tokens", "input_tokens"}`); nothing is generated or kept."""
        body = await read_json(request)
        return JSONResponse(await run_in_threadpool(count_input_tokens, body, state.parse_ctx,
                                                    store))

    @r.get("/responses/{response_id}")
    @r.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, cache_salt: SaltQuery = None) -> Response:
        entry = store.get(cache_salt or "", response_id)
        if entry is None:
            raise not_found(response_id)
        return JSONResponse(entry.response)

    @r.delete("/responses/{response_id}")
    @r.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, cache_salt: SaltQuery = None) -> Response:
        if not store.delete(cache_salt or "", response_id):
            raise not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
