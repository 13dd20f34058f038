"""POST /embedding, /embeddings and /v1/embeddings (llama-server's handle_embeddings_impl).

Each input is one task through the same engine as completions: it takes a slot, is batched with
whatever else runs, and ends when its prompt is computed; its result is the output-normed
hidden states (the rows the head would read), pooled as --pooling says (`CompletionTask.pooling`).
`last` pooling reads only the final token's row, so it may start from a cached prefix: exact in
the deterministic mode (the default), which makes a token's hidden state the same bits whatever
was computed before it and how it was chunked. The other poolings need every token's row and
compute the whole input. The KV an embedding leaves in its slot serves later prompts from the
slots (its own, or shared), but never goes to host RAM or disk (`SlotKV.slot_only`), as
llama-server keeps embeddings out of its prompt cache.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from radixserve.engine.task import CompletionTask
from radixserve.errors import TaskError, invalid_request, not_supported
from radixserve.http import info, openapi
from radixserve.http.errors import read_json
from radixserve.http.parse import prompt_list
from radixserve.http.schemas import EmbeddingRequest, validate_body
from radixserve.http.state import AppState
from radixserve.http.streaming import collect_all


def normalize(vec: Sequence[float] | torch.Tensor, norm: int) -> list[float]:
    """llama.cpp's common_embd_normalize: -1 none, 0 max absolute scaled to the int16 range,
    2 euclidean (f32 squares summed in f64), p > 2 (and 1) the p-norm in f64; the scale
    applied in f32."""
    x = torch.as_tensor(vec, dtype=torch.float32)
    if norm == -1:
        total = 1.0
    elif norm == 0:
        total = x.abs().max().item() / 32760.0
    elif norm == 2:
        total = (x * x).double().sum().sqrt().item()
    else:
        total = x.double().abs().pow(norm).sum().pow(1.0 / norm).item()
    scale = torch.tensor(1.0 / total if total > 0 else 0.0, dtype=torch.float32)
    return (x * scale).tolist()


def _b64(vec: list[float]) -> str:
    """OpenAI's base64 encoding: the f32 values' little-endian bytes."""
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")


_MEDIA_PARTS = {"image_url": "image", "input_audio": "audio", "input_video": "video",
                "video_url": "video"}


def _part_text(entry: Any) -> Any:
    """An input given as OpenAI content parts, `{"content": [{"type": "text", "text": ...},
    ...]}` (llama-server's shape) or one part alone, as the text of its parts (so it embeds
    as that text does); any other input as it is. No model here reads media."""
    if not isinstance(entry, dict) or not ("content" in entry or "type" in entry):
        return entry
    parts = entry["content"] if "content" in entry else [entry]
    if not isinstance(parts, list):
        raise invalid_request('"content" must be an array')
    text = ""
    for part in parts:
        kind = part.get("type", "") if isinstance(part, dict) else None
        if kind in _MEDIA_PARTS:
            raise invalid_request(f"{_MEDIA_PARTS[kind]} input is not supported (this server's "
                                  "models read text only)")
        if kind != "text" or not isinstance(part.get("text", ""), str):
            raise invalid_request("unsupported content[].type")
        text += part.get("text", "")
    return text


class EmbeddingPlan:
    """A validated request: its tasks and how the results are shaped."""

    def __init__(self, body: Any, state: AppState, oai: bool) -> None:
        cfg, model = state.cfg, state.model
        if not cfg.embeddings:
            raise not_supported("This server does not support embeddings. Start it with "
                                "`--embeddings`")
        self.pooling = cfg.embedding_pooling(model.hp.pooling)
        if oai and self.pooling == "none":
            raise invalid_request("Pooling type 'none' is not OAI compatible. Please use a "
                                  "different pooling type")
        req = validate_body(EmbeddingRequest, body)
        if req.input is not None:
            prompt = req.input
        elif req.content is not None:
            oai, prompt = False, req.content  # "content" is not OpenAI's: the native shape
        else:
            raise invalid_request('"input" or "content" must be provided')
        self.oai, self.base64 = oai, False
        if req.encoding_format is not None:
            if req.encoding_format not in ("float", "base64"):
                raise invalid_request("The format to return the embeddings in. Can be either "
                                      "float or base64")
            self.base64 = req.encoding_format == "base64"
        n_embd = model.hp.n_embd
        if req.dimensions is not None and req.dimensions != n_embd:
            raise invalid_request(f"dimensions {req.dimensions} is not supported: this model's "
                                  f"embeddings have {n_embd} dimensions (no reduced ones)")
        self.normalize = cfg.embd_normalize if req.embd_normalize is None else req.embd_normalize
        if self.normalize < -1:
            raise invalid_request(f"embd_normalize must be -1, 0 or a p-norm >= 1, got "
                                  f"{self.normalize}")
        if isinstance(prompt, list) and not prompt:
            raise invalid_request('"input" must not be empty')
        if isinstance(prompt, list):
            prompt = [_part_text(p) for p in prompt]
        prompts = prompt_list(_part_text(prompt), model.tokenizer)
        if any(not p for p in prompts):
            raise invalid_request("Input content cannot be empty")
        reuse = self.pooling == "last" and state.defaults.cache_prompt
        self.tasks = [CompletionTask(prompt_tokens=p, n_predict=0, cache_prompt=reuse,
                                     stream=False, pooling=self.pooling, index=i)
                      for i, p in enumerate(prompts)]
        self.model = req.model or info.model_alias(model, cfg)

    def vector(self, rows: torch.Tensor) -> list[list[float]]:
        """A result's rows as returned: pooled ones normalized, per-token ones as computed."""
        if self.pooling == "none":
            return rows.tolist()
        return [normalize(rows[0], self.normalize)]

    def body(self, results: list[torch.Tensor]) -> Any:
        if not self.oai:
            return [{"index": i, "embedding": self.vector(r)} for i, r in enumerate(results)]
        data = []
        for i, r in enumerate(results):
            vec = self.vector(r)[0]
            data.append({"embedding": _b64(vec), "index": i, "object": "embedding",
                         "encoding_format": "base64"} if self.base64 else
                        {"embedding": vec, "index": i, "object": "embedding"})
        n = sum(len(t.prompt_tokens) for t in self.tasks)
        return {"model": self.model, "object": "list",
                "usage": {"prompt_tokens": n, "total_tokens": n}, "data": data}


def add_routes(r: APIRouter, state: AppState) -> None:
    async def embed(request: Request, oai: bool) -> Response:
        body = await read_json(request)
        plan = await run_in_threadpool(EmbeddingPlan, body, state, oai)  # tokenizing
        streams = [state.eng.submit(t) for t in plan.tasks]  # from here on, each one ends
        finals = await collect_all(request, streams)
        results = [f.embedding for f in finals]
        if any(r is None for r in results):  # an engine fault, never a client's
            raise TaskError(500, "server_error", "an embedding task ended without its result")
        return JSONResponse(await run_in_threadpool(plan.body, results))  # JSON off the loop

    @r.post("/embedding", openapi_extra=openapi.EMBEDDING)
    @r.post("/embeddings", openapi_extra=openapi.EMBEDDING)
    async def native_embeddings(request: Request) -> Response:
        return await embed(request, oai=False)

    @r.post("/v1/embeddings", openapi_extra=openapi.EMBEDDING)
    async def oai_embeddings(request: Request) -> Response:
        return await embed(request, oai=True)
