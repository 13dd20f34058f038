"""What the routes share: the settings, the engine once it is loaded, and derived facts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from radixserve.config import RequestDefaults, ServerConfig
from radixserve.engine.api import EngineAPI
from radixserve.http import info
from radixserve.http.parse import ParseContext
from radixserve.model.loader import Model


@dataclass
class AppState:
    """`engine` is None until the model is loaded (the gate middleware answers 503 until then,
    so a route may assume it is set)."""

    cfg: ServerConfig
    engine: EngineAPI | None = None
    load_error: str | None = None
    parse_ctx: ParseContext | None = None
    started: int = field(default_factory=lambda: int(time.time()))
    ui_paths: frozenset[str] = frozenset()  # the page's files (http/webui.py)
    _facts: info.ModelFacts | None = None
    # what a request gets for the fields it leaves out: built once, from `cfg` (the flags)
    defaults: RequestDefaults = field(init=False)

    def __post_init__(self) -> None:
        self.defaults = RequestDefaults.from_config(self.cfg)

    @property
    def api_keys(self) -> list[str]:
        return self.cfg.api_key

    @property
    def api_prefix(self) -> str:
        return self.cfg.api_prefix

    @property
    def eng(self) -> EngineAPI:
        assert self.engine is not None, "a route ran before the engine was ready"
        return self.engine

    @property
    def model(self) -> Model:
        return self.eng.model

    async def facts(self) -> info.ModelFacts:
        if self._facts is None:
            self._facts = await run_in_threadpool(info.model_facts, self.model)
        return self._facts

    def set_engine(self, engine: EngineAPI) -> None:
        m = engine.model
        self.parse_ctx = ParseContext.for_model(
            m.tokenizer, m.chat_template, engine.n_ctx_slot, engine.n_slots, self.defaults)
        self.engine = engine
