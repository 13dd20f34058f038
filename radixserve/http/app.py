"""The HTTP application: llama-server's routes and OpenAI's, over one `Engine`.

The app can listen before the model is loaded (llama-server does): give `create_app` a
factory and it builds the engine in a worker thread at startup, answering 503 "Loading model"
on every route until it is ready. Handlers only validate, tokenize, talk to the engine through
`submit`/`call` and shape JSON; they never touch tensors.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from radixserve.config import ServerConfig
from radixserve.model.loader import Model
from radixserve.http import info
from radixserve.http.errors import install_error_handlers
from radixserve.http.middleware import GateMiddleware
from radixserve.http.parse import ParseContext
from radixserve.http.routes import build_router

log = logging.getLogger(__name__)


@dataclass
class AppState:
    """What the routes share; `engine` is None until the model is loaded."""

    cfg: ServerConfig
    engine: Any = None
    load_error: str | None = None
    parse_ctx: ParseContext | None = None
    started: int = field(default_factory=lambda: int(time.time()))
    _facts: info.ModelFacts | None = None

    @property
    def api_keys(self) -> list[str]:
        return self.cfg.api_key

    @property
    def model(self) -> Model:
        return self.engine.model

    async def facts(self) -> info.ModelFacts:
        if self._facts is None:
            self._facts = await run_in_threadpool(info.model_facts, self.model)
        return self._facts

    def set_engine(self, engine: Any) -> None:
        m, cfg = engine.model, self.cfg
        self.parse_ctx = ParseContext(
            m.tokenizer,
            m.chat_template,
            engine.n_ctx_slot,
            engine.n_slots,
            default_n_predict=cfg.n_predict,
            default_cache_prompt=cfg.cache_prompt,
            default_seed=cfg.seed,
        )
        self.engine = engine


def _is_engine(obj: Any) -> bool:
    return hasattr(obj, "submit") and hasattr(obj, "call")


def create_app(
    engine_or_factory: Any, model: Model | None = None, cfg: ServerConfig | None = None
) -> FastAPI:
    """An app over a ready engine, or over `factory() -> Engine` (started, ready to serve),
    which runs in a thread at startup; the app stops an engine it built when it shuts down.
    `model` is accepted for symmetry; the engine's own `model` is what the routes use."""
    cfg = cfg or getattr(engine_or_factory, "cfg", None) or ServerConfig()
    state = AppState(cfg)
    factory: Callable[[], Any] | None = None
    if _is_engine(engine_or_factory):
        state.set_engine(engine_or_factory)
    elif callable(engine_or_factory):
        factory = engine_or_factory
    else:
        raise TypeError("create_app needs an Engine or a callable returning one")
    del model

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(_load(state, factory)) if factory else None
        yield
        if loader is not None:
            await asyncio.gather(loader, return_exceptions=True)  # never mid-load on exit
            stop = getattr(state.engine, "stop", None)
            if stop is not None:
                await asyncio.to_thread(stop)

    app = FastAPI(
        title="radixserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.radixserve = state
    install_error_handlers(app)
    app.add_middleware(GateMiddleware, state=state)
    app.include_router(build_router(state))
    return app


async def _load(state: AppState, factory: Callable[[], Any]) -> None:
    t0 = time.perf_counter()
    try:
        engine = await asyncio.to_thread(factory)
    except Exception as e:
        log.exception("model loading failed")
        state.load_error = f"{type(e).__name__}: {e}"
        return
    state.set_engine(engine)
    log.info("engine ready after %.2f s; serving requests", time.perf_counter() - t0)
