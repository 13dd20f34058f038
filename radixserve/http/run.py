"""`radixserve serve`: listen first, load the model in the background (503 until ready).

A model that fails to load stops the server with exit code 1, as llama-server does: a server
that stays up answering 500 to everything would only hide the problem from its supervisor.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import uvicorn

from radixserve.config import ServerConfig
from radixserve.engine.engine import Engine
from radixserve.http.app import create_app
from radixserve.http.wire import http_protocol
from radixserve.model.loader import Model, load_model
from radixserve.text.chat_template import ChatTemplate

log = logging.getLogger(__name__)


def load(cfg: ServerConfig) -> Model:
    """The model, with --chat-template(-file) replacing the GGUF's template."""
    model = load_model(cfg.model, cfg.dtype, device=cfg.device, weights=cfg.weights,
                       deterministic=cfg.deterministic, gpu_layers=cfg.gpu_layers,
                       kernels=cfg.kernels, load_mode=cfg.load_mode)
    if cfg.chat_template is not None:
        t = model.chat_template
        model.chat_template = ChatTemplate(cfg.chat_template, t.bos_token, t.eos_token)
    return model


def build_engine(cfg: ServerConfig) -> Engine:
    return Engine.boot(cfg, lambda: load(cfg))


def bind(cfg: ServerConfig) -> list[socket.socket]:
    """llama-server's --host: comma-separated addresses, a path ending in .sock being a UNIX
    socket; an IPv6 address binds IPv6 only; --reuse-port sets SO_REUSEPORT; --port 0 binds a
    free port (one TCP address only), which becomes `cfg.port` (the log says it)."""
    socks: list[socket.socket] = []
    for host in [h.strip() for h in cfg.host.split(",") if h.strip()]:
        if host.endswith(".sock"):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            if os.path.exists(host):
                os.unlink(host)
            s.bind(host)
        else:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            s = socket.socket(family, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if cfg.reuse_port:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind((host.strip("[]"), cfg.port))
            if cfg.port == 0:  # llama-server's --port 0: a free port, logged as the port
                cfg.port = s.getsockname()[1]
        s.listen(2048)
        s.set_inheritable(True)
        socks.append(s)
    return socks


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

    socks = bind_or_log(cfg)
    if socks is None:
        return 1
    server = http_server(cfg, create_app(factory, cfg=cfg))
    run_server(cfg, server, socks)
    return 1 if failed else 0


def bind_or_log(cfg: ServerConfig) -> list[socket.socket] | None:
    """The listening sockets, or None after logging why not (the server and the router)."""
    try:
        return bind(cfg)
    except OSError as e:
        log.error("cannot listen on %s port %d: %s", cfg.host, cfg.port, e)
        return None


def http_server(cfg: ServerConfig, app: Any) -> uvicorn.Server:
    """uvicorn as the server and the router run it: its own logs off, TLS from --ssl-*."""
    return uvicorn.Server(uvicorn.Config(
        app, log_level="warning", access_log=False, ssl_keyfile=cfg.ssl_key_file,
        ssl_certfile=cfg.ssl_cert_file, http=http_protocol()))  # names spelled as llama-server


def run_server(cfg: ServerConfig, server: uvicorn.Server, socks: list[socket.socket]) -> None:
    scheme = "https" if cfg.ssl_cert_file else "http"
    log.info("HTTP server listening on %s://%s:%d", scheme, cfg.host, cfg.port)
    server.run(sockets=socks)
