"""One child `radixserve serve` process per loaded model, as llama-server's router spawns one
`llama-server` per model: on a free loopback port, with the router's environment and flags
(less the ones the router owns: registry.ROUTER_FLAGS / router_env) plus the model's preset
flags, `-m PATH` and `--alias NAME`. Ready once its /health answers 200; stopped with SIGINT
(its clean shutdown: the disk tier's last writes), then SIGKILL after the preset's
`stop-timeout` (10 s). The process itself is the benchmark's `ServerProcess`
(server_proc.py); its output goes to a log file per child in the router's log directory.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import httpx

from radixserve.server_proc import ServerProcess
from radixserve.flags import ALL_FLAGS
from radixserve.router.registry import ModelEntry, router_env

READY_TIMEOUT_S = 600.0
_ERROR_LINE = re.compile(r"error|Error|ERROR|Traceback|exception")


class Child:
    """A child server for one model (registry.ChildLike)."""

    def __init__(self, entry: ModelEntry, log_dir: Path, api_prefix: str = "",
                 ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        args = [*entry.args, "-m", entry.path, "--alias", entry.name]
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", entry.name)
        self.proc = ServerProcess(args, log_dir / f"{safe}.log", ready_timeout_s,
                                  env={k: None for k in router_env(ALL_FLAGS)},
                                  ready_path=api_prefix + "/health")
        self.url, self.port, self.name = self.proc.url, self.proc.port, entry.name
        self.api_prefix = api_prefix

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc.proc is not None else -1

    def argv(self) -> list[str]:
        return ["radixserve", *self.proc.command, "--host", "127.0.0.1", "--port",
                str(self.port), *self.proc.args]

    async def start(self) -> None:
        await asyncio.to_thread(self.proc.__enter__)

    async def stop(self, timeout_s: float) -> None:
        await asyncio.to_thread(self.proc.stop, timeout_s)

    def exit_code(self) -> int | None:
        return None if self.proc.proc is None else self.proc.proc.poll()

    def failure_reason(self) -> str:
        """The child's last log line that reads as an error, else ""."""
        lines = [ln.strip() for ln in self.proc.log_tail(1 << 16).splitlines() if ln.strip()]
        for ln in reversed(lines):
            if _ERROR_LINE.search(ln) and not ln.startswith("Traceback"):
                return ln[-500:]
        return ""

    async def info(self) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.get(self.url + self.api_prefix + "/v1/models")
            r.raise_for_status()
            data = r.json().get("data") or [{}]
            return dict(data[0])

