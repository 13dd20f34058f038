"""A cold `radixserve serve` process per benchmark run, and a sampler of its memory.

Each (scenario, mode, repeat) gets its own process on a free loopback port, so no cache state,
allocator state or warm page leaks from one measurement into the next. The RSS sampler runs in a
thread of the benchmark (not the server) and polls with psutil: the peak is what an operator
would see in `top`, host cache included.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

import httpx
import psutil

from radixserve.bench.stats import MIB


def free_port() -> int:
    """A port the OS says is free now (another process could take it first: rare on loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`python -m radixserve.cli serve --port P ARGS...` (or `command` in place of `serve`,
    e.g. `cluster --replicas 2`), logged to `log_path`; `env` is added to this process's
    environment (a value of None removes that variable)."""

    def __init__(self, args: list[str], log_path: Path, ready_timeout_s: float = 300.0,
                 env: dict[str, str | None] | None = None,
                 command: tuple[str, ...] = ("serve",), ready_path: str = "/health") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args, self.log_path, self.ready_timeout_s = args, log_path, ready_timeout_s
        self.env, self.command, self.ready_path = env or {}, command, ready_path
        # a cluster's ingress answers /health as soon as one replica is up; the command says
        # this once every replica is
        self.ready_text = "radixserve cluster: listening on" if command[0] == "cluster" else ""
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        cmd = [sys.executable, "-m", "radixserve.cli", *self.command, "--host", "127.0.0.1",
               "--port", str(self.port), *self.args]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            log.write((" ".join(cmd) + "\n").encode())
            log.flush()
            env = {k: v for k, v in {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}.items()
                   if v is not None}
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if (httpx.get(self.url + self.ready_path, timeout=2).status_code == 200
                        and self.ready_text in self.log_tail(1 << 20)):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {self.ready_timeout_s}s:\n{self.log_tail()}")

    def log_tail(self, n_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float | None = None) -> bool:
        """SIGINT (clean shutdown), then SIGKILL if it does not exit within `timeout_s` (15 s;
        60 s for a cluster, which stops its Ray instance).
        True unless it had to be killed: a restart scenario records whether the server had
        the chance to finish its shutdown (e.g. a disk tier's last writes)."""
        if self.proc is None or self.proc.poll() is not None:
            return True
        if timeout_s is None:
            timeout_s = 60.0 if self.command[0] == "cluster" else 15.0
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return False


class RssSampler:
    """Polls a process's resident set size every `interval_s` in a daemon thread."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.proc = psutil.Process(pid)
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def rss_bytes(self) -> int:
        try:
            return int(self.proc.memory_info().rss)
        except psutil.Error:  # the process is gone: nothing more to see
            return 0

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self.rss_bytes())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        self.peak_bytes = self.rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self.rss_bytes())

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / MIB
