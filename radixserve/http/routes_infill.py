"""llama-server's POST /infill: fill-in-the-middle, a /completion whose prompt is laid out from
the code before and after the hole (text/infill.py), answered as /completion answers (one
JSON body, or SSE with `stream: true`).

A model whose vocabulary lacks FIM prefix, suffix or middle tokens gets llama-server's 501
before the body is read. The body's checks are llama-server's, with its messages; where its
handler sets an error and goes on (a non-string `prompt`, a missing `input_prefix` or
`input_suffix`: it then ignores the prompt, or fails with a 500 on the missing field), the
error is answered here, a 400.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixserve.errors import TaskError, invalid_request, not_supported
from radixserve.http import openapi
from radixserve.http.parse import (ParseContext, ParsedRequest, build_task, completion_n_probs,
                                   request_grammar, tokenize_mixed)
from radixserve.http.routes_completions import completion_handler
from radixserve.http.schemas import InfillRequest, validate_body
from radixserve.http.state import AppState
from radixserve.text.infill import ExtraChunk, format_prompt_infill, missing_fim
from radixserve.text.tokenizer import Tokenizer

EXTRA_SHAPE = '"input_extra" must be an array of {"filename": string, "text": string}'


def check_fim(tok: Tokenizer) -> None:
    """llama-server's answer to /infill on a model without FIM tokens (501)."""
    missing = missing_fim(tok)
    if missing:
        raise not_supported(f"Infill is not supported by this model: {missing}")


def _mixed(value: Any, name: str, tok: Tokenizer) -> list[int]:
    """`input_prefix` / `input_suffix`: a string, or a list of strings and token ids, tokenized
    without special tokens (llama-server's tokenize_mixed(..., false, false))."""
    try:
        return tokenize_mixed(value, tok, add_special=False, parse_special=False)
    except TaskError:
        raise invalid_request(f'"{name}" must be a string or an array of strings and token '
                              "ids") from None


def _extra(body: dict[str, Any]) -> list[ExtraChunk]:
    if "input_extra" not in body:
        return []
    chunks = body["input_extra"]
    if not isinstance(chunks, list):
        raise invalid_request(EXTRA_SHAPE)
    out: list[ExtraChunk] = []
    for chunk in chunks:
        text = chunk.get("text") if isinstance(chunk, dict) else None
        if not isinstance(text, str):
            raise invalid_request('extra_context chunk must contain a "text" field with a '
                                  "string value")
        filename = chunk.get("filename", "tmp")
        if not isinstance(filename, str):
            raise invalid_request('extra_context chunk\'s "filename" field must be a string')
        out.append(ExtraChunk(text, filename))
    return out


def parse_infill(body: Any, ctx: ParseContext, n_batch: int, spm_infill: bool) -> ParsedRequest:
    """An /infill body -> its task (a /completion task of the laid-out prompt). `n_batch` is
    the server's --batch-size, the FIM part's budget."""
    req = validate_body(InfillRequest, body)
    if "prompt" in body and not isinstance(body["prompt"], str):
        raise invalid_request('"prompt" must be a string')
    for name in ("input_prefix", "input_suffix"):
        if name not in body:
            raise invalid_request(f'"{name}" is required')
    extra = _extra(body)
    tok = ctx.tokenizer
    prefix = _mixed(body["input_prefix"], "input_prefix", tok)
    suffix = _mixed(body["input_suffix"], "input_suffix", tok)
    prompt = tok.encode(req.prompt or "", add_special=False, parse_special=True)
    tokens = format_prompt_infill(tok, prefix, suffix, extra, n_batch, ctx.defaults.n_predict,
                                  ctx.n_ctx_slot, spm_infill, prompt)
    return build_task(req, tokens, completion_n_probs(req), ctx,
                      grammar=request_grammar(req, ctx))


def add_routes(r: APIRouter, state: AppState) -> None:
    complete = completion_handler(state)

    @r.post("/infill", openapi_extra=openapi.INFILL)
    async def infill(request: Request) -> Response:
        check_fim(state.model.tokenizer)  # before the body, as llama-server

        def parse(body: Any, ctx: ParseContext) -> ParsedRequest:
            return parse_infill(body, ctx, state.cfg.batch_size, state.cfg.spm_infill)

        return await complete(request, "native", parse)
