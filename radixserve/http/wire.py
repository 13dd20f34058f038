"""Response header names on the wire as llama-server spells them.

llama-server (cpp-httplib) writes each header name as its code spells it: "Content-Type",
"Access-Control-Allow-Origin", "ETag" (tools/server/server-http.cpp). ASGI apps give names in
lower case, and uvicorn's httptools protocol writes every name in lower case
("access-control-allow-origin"); HTTP says names are case-insensitive, but some clients look
them up as llama-server spells them. So the server runs uvicorn's protocol with each response's
head (status line and headers, written once before any body) respelled: every word of a name
capitalized ("Content-Type", "Process-Start-Time-Unix"), "ETag" as llama-server writes it.
Bodies pass untouched.
"""

from __future__ import annotations

import asyncio
from typing import Any

SPELLING = {b"etag": b"ETag", b"www-authenticate": b"WWW-Authenticate"}


def spell(name: bytes) -> bytes:
    name = name.lower()
    return SPELLING.get(name) or b"-".join(w[:1].upper() + w[1:] for w in name.split(b"-"))


def respell_head(data: bytes) -> bytes:
    """A response head (and whatever follows it in the same write) with its names spelled."""
    end = data.find(b"\r\n\r\n")
    head, rest = (data, b"") if end < 0 else (data[:end], data[end:])
    lines = head.split(b"\r\n")
    for i in range(1, len(lines)):
        name, sep, value = lines[i].partition(b":")
        if sep:
            lines[i] = spell(name) + sep + value
    return b"\r\n".join(lines) + rest


class HeadSpelling:
    """One response's transport: its head (after any 1xx interim head) respelled, then every
    write passed through. Anything else is the transport's own."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._head_done = False

    def write(self, data: bytes) -> None:
        if not self._head_done and data[:5] == b"HTTP/":
            data = respell_head(data)
            self._head_done = data[9:10] != b"1"  # "HTTP/1.1 1xx": the real head follows
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _respell_cycle(protocol: Any) -> None:
    """Right after the protocol built a request's cycle (before its task runs)."""
    cycle = getattr(protocol, "cycle", None)
    if cycle is not None and not isinstance(cycle.transport, HeadSpelling):
        cycle.transport = HeadSpelling(cycle.transport)


def http_protocol() -> type[asyncio.Protocol]:
    """uvicorn's protocol ("auto": httptools when installed, else h11), writing names as
    llama-server does."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        class H11Spelled(H11Protocol):
            def handle_events(self) -> None:
                super().handle_events()
                _respell_cycle(self)

        return H11Spelled
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsSpelled(HttpToolsProtocol):
        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            _respell_cycle(self)

    return HttpToolsSpelled
