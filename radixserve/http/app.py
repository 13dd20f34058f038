"""The HTTP application: llama-server's routes and OpenAI's, over one engine (`EngineAPI`).

The app can listen before the model is loaded (llama-server does): give `create_app` a
factory and it builds the engine in a worker thread at startup, answering 503 "Loading model"
on every route until it is ready. Routes come in families (routes_*.py); handlers only validate,
tokenize, talk to the engine through its API and shape JSON; they never touch tensors.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI

from radixserve.config import ServerConfig
from radixserve.engine.api import EngineAPI
from radixserve.http import (openapi, routes_completions, routes_embeddings, routes_infill,
                             routes_info, routes_messages, routes_rerank, routes_responses,
                             routes_slots, routes_tokenize, webui)
from radixserve.http.cors import CorsMiddleware
from radixserve.http.errors import GuardedRoute, install_error_handlers
from radixserve.http.middleware import BodyGuard, GateMiddleware
from radixserve.http.sleep import IdleSleep, SleepMiddleware
from radixserve.http.state import AppState

log = logging.getLogger(__name__)


def _is_engine(obj: Any) -> bool:
    return hasattr(obj, "submit")  # an engine; a factory is a plain callable


def create_app(
    engine_or_factory: EngineAPI | Callable[[], EngineAPI], cfg: ServerConfig | None = None
) -> FastAPI:
    """An app over a ready engine, or over `factory() -> EngineAPI` (started, ready to serve),
    which runs in a thread at startup; the app stops an engine it built when it shuts down."""
    cfg = cfg or getattr(engine_or_factory, "cfg", None) or ServerConfig()
    state = AppState(cfg, ui_paths=webui.public_paths(cfg))
    # --sleep-idle-seconds: release the model when idle, reload it for the next request
    sleeper = IdleSleep(state, cfg.sleep_idle_seconds) if cfg.sleep_idle_seconds > 0 else None
    factory: Callable[[], EngineAPI] | None = None
    if _is_engine(engine_or_factory):
        state.set_engine(engine_or_factory)  # type: ignore[arg-type]
    elif callable(engine_or_factory):
        factory = engine_or_factory
    else:
        raise TypeError("create_app needs an engine or a callable returning one")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(_load(state, factory)) if factory else None
        clock = asyncio.create_task(sleeper.run()) if sleeper is not None else None
        yield
        if clock is not None:
            clock.cancel()
            await asyncio.gather(clock, return_exceptions=True)
        if loader is not None:
            await asyncio.gather(loader, return_exceptions=True)  # never mid-load on exit
            if state.engine is not None:
                await asyncio.to_thread(state.engine.stop)

    app = FastAPI(
        title="radixserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.radixserve = state
    install_error_handlers(app)
    app.add_middleware(BodyGuard, max_bytes=cfg.max_body_mib << 20, timeout_s=cfg.timeout)
    app.add_middleware(SleepMiddleware, sleeper=sleeper)  # inside the gate: 401s never wake
    app.add_middleware(GateMiddleware, state=state)
    app.add_middleware(CorsMiddleware, cfg=cfg)  # outermost: preflights skip the gate
    # every API route is in the OpenAPI document (`app.openapi()`, bodies from openapi.py); it
    # is not served (`openapi_url=None`: llama-server has no such route)
    router = APIRouter(route_class=GuardedRoute, responses=openapi.ERROR_RESPONSES)
    for family in (routes_info, routes_slots, routes_completions, routes_messages,
                   routes_responses, routes_infill, routes_embeddings, routes_rerank,
                   routes_tokenize, webui):
        family.add_routes(router, state)
    app.include_router(router, prefix=cfg.api_prefix)
    webui.mount_page(app, cfg)  # after the API: --path's files answer what the API does not
    return app


async def _load(state: AppState, factory: Callable[[], EngineAPI]) -> None:
    t0 = time.perf_counter()
    try:
        engine = await asyncio.to_thread(factory)
    except Exception as e:
        log.exception("model loading failed")
        state.load_error = f"{type(e).__name__}: {e}"
        return
    state.set_engine(engine)
    log.info("engine ready after %.2f s; serving requests", time.perf_counter() - t0)
