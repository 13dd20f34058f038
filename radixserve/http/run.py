"""`radixserve serve`: listen first, load the model in the background (503 until ready).

A model that fails to load stops the server with exit code 1, as llama-server does: a server
that stays up answering 500 to everything would only hide the problem from its supervisor.
"""

from __future__ import annotations

import logging
import os

import uvicorn

from radixserve.config import ServerConfig
from radixserve.engine.engine import Engine
from radixserve.http.app import create_app
from radixserve.model.loader import load_model

log = logging.getLogger(__name__)


def build_engine(cfg: ServerConfig) -> Engine:
    return Engine.boot(cfg, lambda: load_model(cfg.model, cfg.dtype, weights=cfg.weights))


def serve(cfg: ServerConfig) -> int:
    if cfg.slot_save_path is not None and not os.path.isdir(cfg.slot_save_path):
        log.error("--slot-save-path: not a directory: %s", cfg.slot_save_path)
        return 1
    failed: list[BaseException] = []
    server: uvicorn.Server | None = None

    def factory() -> Engine:
        try:
            return build_engine(cfg)
        except BaseException as e:
            failed.append(e)
            log.error("failed to load the model: %s", e)
            if server is not None:
                server.should_exit = True
            raise

    app = create_app(factory, cfg=cfg)
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning",
                                           access_log=False))
    log.info("HTTP server listening on http://%s:%d", cfg.host, cfg.port)
    server.run()
    return 1 if failed else 0
