"""CORS as llama-server answers it (tools/server/server-http.cpp, its pre-routing handler).

- Every OPTIONS request is a preflight: 200 with an empty text/html body, before the loading
  gate and the API key (a browser sends no key on one), whatever its path, method or origin:
  `Access-Control-Allow-Credentials` ("true"/"false"), `Access-Control-Allow-Methods`
  (--cors-methods) and `Access-Control-Allow-Headers` (--cors-headers), and
  `Access-Control-Allow-Origin` when the origin is allowed. An origin that is not allowed gets
  no Allow-Origin (the browser then refuses the request), not an error status.
- Every other response carries `Access-Control-Allow-Origin` for an allowed origin, and no
  `Access-Control-Allow-Credentials` (llama-server says it on preflights only: a page cannot
  read a credentialed answer).
- Allowed: --cors-origins '*' (the default) with --cors-credentials (the default) echoes the
  request's Origin; '*' without credentials answers '*'; 'localhost' echoes local origins only
  (http(s)://localhost, 127.0.0.1 or [::1], any port); a list echoes the origins it names.

Where radixserve answers more than llama-server (each makes a browser allow what llama-server's
flags say is allowed): a listed origin is echoed alone (llama-server sends the whole list,
which a browser matches against one origin only); `--cors-headers '*'` with credentials answers
a preflight with the headers it asks for (browsers do not expand '*' for credentialed
requests); an echoed origin's responses say `Vary: Origin`.

Header names go out as llama-server spells them (http/wire.py).
"""

from __future__ import annotations

import re

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.config import ServerConfig

LOCAL_ORIGIN = re.compile(r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?")

ALLOW_ORIGIN = "access-control-allow-origin"
ALLOW_CREDENTIALS = "access-control-allow-credentials"


class CorsMiddleware:
    def __init__(self, app: ASGIApp, cfg: ServerConfig) -> None:
        self.app = app
        origins = [o.strip() for o in cfg.cors_origins.split(",") if o.strip()]
        self.localhost = origins == ["localhost"]
        self.any = "*" in origins
        self.origins = frozenset(origins)
        self.credentials = cfg.cors_credentials
        self.methods, self.headers = cfg.cors_methods, cfg.cors_headers

    def allow_origin(self, origin: str) -> str | None:
        """The Access-Control-Allow-Origin for a request from `origin` ("" if it sent none),
        None when that origin is not allowed."""
        if self.any and not self.credentials:
            return "*"
        if not origin:
            return None
        if self.localhost:
            return origin if LOCAL_ORIGIN.fullmatch(origin) else None
        return origin if self.any or origin in self.origins else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        req = Headers(scope=scope)
        allow = self.allow_origin(req.get("origin", ""))
        if scope["method"] == "OPTIONS":
            await self.preflight(req, allow, send)
            return

        async def send_with_cors(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                h = MutableHeaders(scope=msg)
                for name in (ALLOW_ORIGIN, ALLOW_CREDENTIALS):  # ours, not a proxied child's
                    del h[name]
                if allow is not None:
                    h[ALLOW_ORIGIN] = allow
                    if allow != "*":
                        h.add_vary_header("Origin")
            await send(msg)

        await self.app(scope, receive, send_with_cors)

    async def preflight(self, req: Headers, allow: str | None, send: Send) -> None:
        headers = []
        if allow is not None:
            headers.append((ALLOW_ORIGIN, allow))
        allow_headers = self.headers
        asked = req.get("access-control-request-headers", "").strip()
        if allow_headers.strip() == "*" and self.credentials and asked:
            allow_headers = asked
        headers += [(ALLOW_CREDENTIALS, "true" if self.credentials else "false"),
                    ("access-control-allow-methods", self.methods),
                    ("access-control-allow-headers", allow_headers)]
        if allow not in (None, "*"):
            headers.append(("vary", "Origin"))
        headers += [("content-type", "text/html"), ("content-length", "0")]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]})
        await send({"type": "http.response.body", "body": b""})
