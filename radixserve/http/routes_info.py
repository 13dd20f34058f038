"""Informational routes: /health, /props, /models (/v1/models), /metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from radixserve.http import info
from radixserve.http.errors import error_response
from radixserve.http.prometheus import CONTENT_TYPE, render_metrics
from radixserve.http.state import AppState


def add_routes(r: APIRouter, state: AppState) -> None:
    @r.get("/health")
    @r.get("/v1/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @r.get("/props")
    async def props() -> Response:
        e = state.eng
        stats = await e.cache_stats()
        facts = await state.facts()
        body = info.props_json(state.model, facts, state.cfg, e.n_ctx_slot, e.n_slots, stats,
                               state.defaults)
        return JSONResponse(body)

    @r.post("/props")
    async def set_props() -> Response:
        if not state.cfg.props_endpoint:
            return error_response(501, "This server does not support changing global "
                                  "properties. Start it with `--props`")
        return JSONResponse({"success": True})  # llama-server changes nothing either

    @r.get("/models")
    @r.get("/v1/models")
    async def models() -> Response:
        facts = await state.facts()
        body = info.models_json(state.model, facts, state.cfg, state.eng.n_ctx_slot,
                                state.started)
        return JSONResponse(body)

    @r.get("/metrics", response_class=PlainTextResponse)  # documents the media type
    async def metrics() -> Response:
        if not state.cfg.metrics:
            return error_response(
                501, "This server does not support metrics endpoint. Start it with `--metrics`"
            )
        snap, stats = await state.eng.scrape()
        headers = {"Process-Start-Time-Unix": str(state.started)}
        return Response(render_metrics(snap, stats), media_type=CONTENT_TYPE, headers=headers)
