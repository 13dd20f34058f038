"""Start a real `radixserve serve` process on a free loopback port, and stop it afterwards.

The benchmark's launcher does the work (one way to start a server, for tests and benchmarks).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fastapi.testclient import TestClient

from radixserve.server_proc import ServerProcess, free_port
from radixserve.config import ServerConfig
from radixserve.engine.engine import Engine
from radixserve.http.app import create_app

__all__ = ["ServerProcess", "app_client", "free_port", "running_server"]


@contextmanager
def app_client(engine: Engine, cfg: ServerConfig) -> Iterator[TestClient]:
    """The app over a started `engine`, in process; the engine is stopped afterwards."""
    engine.start()
    try:
        with TestClient(create_app(engine, cfg)) as c:
            yield c
    finally:
        engine.stop()


@contextmanager
def running_server(args: list[str], log_path: str | None = None,
                   env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(log_path) if log_path else Path(tmp) / "server.log"
        with ServerProcess(args, path, ready_timeout_s=120, env=env) as srv:
            yield srv
