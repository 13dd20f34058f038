"""llama-server's reranking routes: /rerank, /reranking, /v1/rerank, /v1/reranking.

llama-server serves them with `--reranking` (rank pooling through a reranker's classification
head: its GGUF's cls / cls.output tensors). radixserve loads no such head for any model, so
the flag is refused at start-up (flags/table.py) and these routes give llama-server's answer
to a server started without it: 501, whatever the body.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from radixserve.errors import not_supported
from radixserve.http import openapi
from radixserve.http.state import AppState

NOT_SUPPORTED = "This server does not support reranking. Start it with `--reranking`"


def add_routes(r: APIRouter, state: AppState) -> None:
    @r.post("/rerank", openapi_extra=openapi.RERANK)
    @r.post("/reranking", openapi_extra=openapi.RERANK)
    @r.post("/v1/rerank", openapi_extra=openapi.RERANK)
    @r.post("/v1/reranking", openapi_extra=openapi.RERANK)
    async def rerank() -> Response:
        raise not_supported(NOT_SUPPORTED)
