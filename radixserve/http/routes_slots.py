"""/slots (GET) and /slots/{id}?action=save|restore|erase (POST): llama-server's slot routes; and
the admin flush of every cache tier (ours), under SGLang's name `POST /flush_cache` and vLLM's
`POST /reset_prefix_cache`: behind the API key, like every route but /health."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from radixserve.errors import invalid_request
from radixserve.http import openapi
from radixserve.http.errors import error_response, read_json
from radixserve.http.state import AppState

SLOT_ACTIONS = ("save", "restore", "erase")


def add_routes(r: APIRouter, state: AppState) -> None:
    @r.get("/slots", openapi_extra=openapi.SLOTS)
    async def slots(request: Request) -> Response:
        e = state.eng
        if not state.cfg.slots_endpoint:
            return error_response(
                501, "This server does not support slots endpoint. Start it with `--slots`"
            )
        fail_on_no_slot = request.query_params.get("fail_on_no_slot", "") not in ("", "0", "false")
        if fail_on_no_slot and not await e.has_idle_slot():
            return error_response(503, "no slot available")
        return JSONResponse(await e.slots_json())

    @r.post("/slots/{id_slot}", openapi_extra=openapi.SLOT_ACTION)
    async def slot_action(id_slot: Annotated[str, openapi.SLOT_ID], request: Request) -> Response:
        if not state.cfg.slot_save_path:
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
        return JSONResponse(await state.eng.slot_action(sid, action, filename))

    async def flush(request: Request) -> Response:
        """Empty the slots' KV (a busy slot's when its task ends: the request itself is
        unaffected), the host cache and the disk tier's directory; says what went."""
        return JSONResponse({"flushed": await state.eng.flush_cache()})

    r.add_api_route("/flush_cache", flush, methods=["POST"])
    r.add_api_route("/reset_prefix_cache", flush, methods=["POST"])
