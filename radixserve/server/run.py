"""`radixserve serve`: listen first, load the model in the background (503 until ready)."""

from __future__ import annotations

import logging

import torch
import uvicorn

from radixserve.config import ServerConfig
from radixserve.model.loader import load_model
from radixserve.server.app import create_app
from radixserve.server.engine import Engine

log = logging.getLogger(__name__)


def build_engine(cfg: ServerConfig) -> Engine:
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    model = load_model(cfg.model, cfg.dtype)
    engine = Engine(model, cfg)
    engine.start()
    return engine


def serve(cfg: ServerConfig) -> int:
    app = create_app(lambda: build_engine(cfg), cfg=cfg)
    log.info("HTTP server listening on http://%s:%d", cfg.host, cfg.port)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False)
    return 0
