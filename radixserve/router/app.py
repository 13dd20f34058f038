"""The router's HTTP app (llama-server's router mode): no model of its own; `GET /models`,
`POST /models/load` and `/models/unload` are its own, every model route is proxied to the child
server of the model a request names (`model` in a POST body, `?model=` for a GET), loading it
first unless autoload is off (--no-models-autoload, or `?autoload=false` on the request).

Proxying passes the child's status, headers and body through as they arrive (SSE unbuffered);
a client that disconnects closes the upstream request, so the child cancels its task as if the
client had left it directly. Errors are llama-server's, in the OpenAI shape: a missing model
field (400 "model name is missing from the request"), an unknown model (400 "model 'X' not
found"), a model not loaded with autoload off (400 "model is not loaded"); /models/load of an
unknown model 404, of a running one 400; /models/unload of an unknown or stopped model 400.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from radixserve.config import ServerConfig
from radixserve.http.cors import CorsMiddleware
from radixserve.http.errors import GuardedRoute, error_response, install_error_handlers, read_json
from radixserve.http.middleware import BodyGuard, GateMiddleware
from radixserve.router.registry import ModelEntry, Models, RouterError, Spawn

log = logging.getLogger(__name__)

# llama-server's routes that its router proxies (server.cpp), and radixserve's own /cache
PROXY_POST = ("/completion", "/completions", "/v1/completions", "/chat/completions",
              "/v1/chat/completions", "/v1/responses", "/responses", "/v1/messages",
              "/v1/messages/count_tokens", "/infill", "/embedding", "/embeddings",
              "/v1/embeddings", "/rerank", "/reranking", "/v1/rerank", "/v1/reranking",
              "/tokenize", "/detokenize", "/apply-template", "/props", "/lora-adapters",
              "/chat/completions/input_tokens", "/v1/chat/completions/input_tokens",
              "/responses/input_tokens", "/v1/responses/input_tokens", "/slots/{id_slot}")
PROXY_GET = ("/metrics", "/slots", "/lora-adapters", "/cache")
HOP_HEADERS = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"upgrade",
                         b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
                         b"host", b"content-length", b"date", b"server"})


class RouterGate:
    """What GateMiddleware needs (the API key check): the router is never 'loading'."""

    engine: Any = True
    load_error: str | None = None
    ui_paths: frozenset[str] = frozenset()

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg

    @property
    def api_prefix(self) -> str:
        return self.cfg.api_prefix

    @property
    def api_keys(self) -> list[str]:
        return self.cfg.api_key


class ProxyResponse(Response):
    """The child's answer, passed through chunk by chunk; a client disconnect closes it."""

    def __init__(self, upstream: httpx.Response, on_close: Callable[[], None]) -> None:
        self.upstream, self.on_close = upstream, on_close
        self.status_code = upstream.status_code
        self.background = None
        self.raw_headers = [(k.lower(), v) for k, v in upstream.headers.raw
                            if k.lower() not in HOP_HEADERS]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for chunk in self.upstream.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        pumping, watching = asyncio.create_task(pump()), asyncio.create_task(watch())
        try:
            done, _ = await asyncio.wait({pumping, watching},
                                         return_when=asyncio.FIRST_COMPLETED)
            if pumping not in done:
                log.info("client disconnected: closing the request to the model's server")
        finally:
            for t in (pumping, watching):
                t.cancel()
            try:
                results = await asyncio.gather(pumping, watching, return_exceptions=True)
                await self.upstream.aclose()
            finally:
                self.on_close()  # the model is released whatever happened above
        err = results[0]
        if isinstance(err, httpx.HTTPError | OSError):  # the child died mid-answer
            log.warning("the model's server broke off its answer: %s", err)
        elif isinstance(err, Exception):  # not a cancel: a fault of ours, never dropped unseen
            log.error("proxying the model's answer failed", exc_info=err)


def _autoload(cfg: ServerConfig, request: Request) -> bool:
    v = request.query_params.get("autoload", "")
    return cfg.models_autoload if not v else v in ("true", "1")


def create_router_app(cfg: ServerConfig, models: Models,
                      rescan: Callable[[], dict[str, ModelEntry]] | None = None) -> FastAPI:
    """The router over `models`; `rescan` reads the models dir and preset again (?reload=1)."""
    # no connection limit: httpx's default (100) would queue the 101st request, unbounded,
    # while it holds its model
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0),
                               limits=httpx.Limits(max_connections=None))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        models.start()
        yield
        await models.close()
        await client.aclose()

    app = FastAPI(title="radixserve router", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.models = models
    install_error_handlers(app)
    app.add_middleware(BodyGuard, max_bytes=cfg.max_body_mib << 20, timeout_s=cfg.timeout)
    app.add_middleware(GateMiddleware, state=RouterGate(cfg))
    app.add_middleware(CorsMiddleware, cfg=cfg)
    router = APIRouter(route_class=GuardedRoute)

    def fail(e: RouterError) -> Response:
        return error_response(e.status, e.message)

    def resolve(name: Any, autoload: bool) -> Any:
        """llama-server's router_validate_model."""
        if not isinstance(name, str) or not name:
            raise RouterError(400, "model name is missing from the request")
        e = models.get(name)
        if e is None:
            raise RouterError(400, f"model '{name}' not found")
        if not autoload and not e.running:
            raise RouterError(400, "model is not loaded")
        return e

    async def proxy(request: Request) -> Response:
        autoload = _autoload(cfg, request)
        body = b""
        if request.method == "POST":
            body = await request.body()
            parsed = await read_json(request)
            name = parsed.get("model") if isinstance(parsed, dict) else None
        else:
            name = request.query_params.get("model", "")
        try:
            e = resolve(name, autoload)
        except RouterError as ex:
            return fail(ex)
        models.hold(e)
        try:
            await models.ensure_ready(e, autoload)
            child = e.child
            if child is None:
                raise RouterError(400, "model is not running")
            headers = [(k, v) for k, v in request.headers.raw if k.lower() not in HOP_HEADERS]
            url = child.url + request.url.path
            if request.url.query:
                url += "?" + request.url.query
            upstream = await client.send(client.build_request(
                request.method, url, content=body, headers=headers), stream=True)
        except RouterError as ex:
            models.release(e)
            return fail(ex)
        except httpx.HTTPError as ex:
            models.release(e)
            return error_response(502, f"model '{e.name}': its server did not answer: {ex}",
                                  "server_error")
        except BaseException:
            models.release(e)
            raise
        return ProxyResponse(upstream, lambda: models.release(e))

    for path in PROXY_POST:
        router.add_api_route(path, proxy, methods=["POST"], include_in_schema=False)
    for path in PROXY_GET:
        router.add_api_route(path, proxy, methods=["GET"], include_in_schema=False)

    @router.get("/health")
    @router.get("/v1/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @router.get("/props")
    async def props(request: Request) -> Response:
        if request.query_params.get("model"):
            return await proxy(request)
        return JSONResponse({
            "role": "router", "max_instances": cfg.models_max,
            "models_autoload": cfg.models_autoload, "model_alias": "radixserve",
            "model_path": "none", "default_generation_settings": {"params": {}, "n_ctx": 0},
            "ui_settings": cfg.ui_settings})

    @router.get("/models")
    @router.get("/v1/models")
    async def list_models(request: Request) -> Response:
        if request.query_params.get("reload") and rescan is not None:
            try:
                fresh = rescan()
            except ValueError as ex:
                return error_response(400, str(ex))
            await models.reload(fresh)
        t = int(time.time())
        data = []
        for e in models.entries.values():
            info: dict[str, Any] = {
                "id": e.name, "aliases": [], "tags": [], "object": "model",
                "owned_by": "llamacpp", "created": t, "path": e.path,
                "status": e.status_json(),
                "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
                "source": e.source, "can_remove": False}
            if e.status == "loaded":
                for k, v in e.loaded_info.items():
                    info.setdefault(k, v)
            data.append(info)
        return JSONResponse({"data": data, "object": "list"})

    async def named(request: Request) -> ModelEntry | None:
        """The model a /models/load or /models/unload body names (None: none such)."""
        body = await read_json(request)
        name = body.get("model") if isinstance(body, dict) else None
        return models.get(name) if isinstance(name, str) else None

    @router.post("/models/load")
    async def load(request: Request) -> Response:
        e = await named(request)
        if e is None:
            return error_response(404, "model is not found")
        if e.running:
            return error_response(400, "model is already running")
        models.load(e.name)
        return JSONResponse({"success": True})

    @router.post("/models/unload")
    async def unload(request: Request) -> Response:
        e = await named(request)
        if e is None:
            return error_response(400, "model is not found")
        if not e.running:
            return error_response(400, "model is not running")
        await models.unload(e.name)
        return JSONResponse({"success": True})

    app.include_router(router, prefix=cfg.api_prefix)
    return app


def serve_router(cfg: ServerConfig, argv: Sequence[str]) -> int:
    """`radixserve serve --models-dir DIR | --models-preset FILE` without -m: the router."""
    from radixserve.flags import ALL_FLAGS
    from radixserve.http.run import bind_or_log, http_server, run_server
    from radixserve.router.children import Child
    from radixserve.router.registry import build_entries

    try:
        def rescan() -> dict[str, ModelEntry]:
            return build_entries(cfg.models_dir, cfg.models_preset, argv, ALL_FLAGS)

        entries = rescan()
    except ValueError as e:
        log.error("%s", e)
        return 1
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxied request
    log_dir = Path(tempfile.mkdtemp(prefix="radixserve-router-"))
    spawn: Spawn = lambda entry: Child(entry, log_dir, cfg.api_prefix)  # noqa: E731
    models = Models(entries, cfg.models_max, spawn)
    socks = bind_or_log(cfg)
    if socks is None:
        return 1
    server = http_server(cfg, create_router_app(cfg, models, rescan))
    log.info("router mode: %d models (%s), --models-max %d, autoload %s; children's logs in %s",
             len(entries), ", ".join(entries) or "none", cfg.models_max,
             "on" if cfg.models_autoload else "off", log_dir)
    run_server(cfg, server, socks)
    return 0

