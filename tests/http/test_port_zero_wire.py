"""One real `radixserve serve` process: --port 0, and what goes on the wire.

llama-server, given --port 0 (tools/server/server-http.cpp start), binds a free port with
bind_to_any_port and logs the address it listens on with that port
("listening on http://127.0.0.1:PORT"). Its header names go out as its code spells them
(cpp-httplib writes them as given: "Access-Control-Allow-Origin", "Content-Type"); uvicorn's
httptools protocol would write them in lower case, so this reads the raw bytes of a socket.
With --api-key its service worker /sw.js answers without the key and the API does not.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def raw(port: int, request: str) -> tuple[str, list[str]]:
    """The status line and header lines of the answer to `request`, as sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(request.encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    lines = data.split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    return lines[0], lines[1:]


def test_port_zero_binds_a_free_port_and_header_names_are_llama_servers(
        tiny_path: str, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    args = [sys.executable, "-m", "radixserve.cli", "serve", "-m", tiny_path, "--port", "0",
            "-c", "256", "-np", "1", "--api-key", "k", "--cors-origins", "http://a.example",
            "--log-file", str(log)]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        port = None
        deadline = time.monotonic() + 120
        while port is None or httpx.get(f"http://127.0.0.1:{port}/health").status_code != 200:
            assert proc.poll() is None, log.read_text() if log.exists() else "no log"
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
            if port is None and log.exists():
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", log.read_text())
                port = int(m.group(1)) if m else None
        assert port != 0 and port != 8080

        pre = ("OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: {}\r\n"
               "Access-Control-Request-Method: POST\r\nConnection: close\r\n\r\n")
        status, headers = raw(port, pre.format("http://a.example"))
        assert status == "HTTP/1.1 200 OK"
        for line in ("Access-Control-Allow-Origin: http://a.example",
                     "Access-Control-Allow-Credentials: true",
                     "Access-Control-Allow-Methods: GET, POST, DELETE, OPTIONS",
                     "Access-Control-Allow-Headers: *", "Content-Type: text/html"):
            assert line in headers, (line, headers)
        status, headers = raw(port, pre.format("http://evil.example"))
        assert status == "HTTP/1.1 200 OK"
        assert not any(h.lower().startswith("access-control-allow-origin") for h in headers)

        get = "GET {} HTTP/1.1\r\nHost: x\r\nOrigin: http://a.example\r\n{}Connection: close\r\n\r\n"
        status, headers = raw(port, get.format("/props", ""))
        assert status.startswith("HTTP/1.1 401") and \
            "Access-Control-Allow-Origin: http://a.example" in headers
        status, headers = raw(port, get.format("/props", "Authorization: Bearer k\r\n"))
        assert status == "HTTP/1.1 200 OK"
        assert any(h.startswith("Content-Type: application/json") for h in headers), headers
        status, headers = raw(port, get.format("/sw.js", ""))
        assert status == "HTTP/1.1 200 OK" and "Cache-Control: no-cache" in headers
    finally:
        proc.terminate()
        proc.wait(30)
