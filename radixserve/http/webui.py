"""The page at `/` (radixserve/webui/: chat and a live view of the cache) and `GET /cache`, the
JSON it polls.

As llama-server: the page's own files are public (the page asks for the API key and sends it
on every API call), they load while the model is still loading, `--path DIR` serves a
directory instead, and `--no-ui` serves neither. The files are plain ES modules shipped in the
package: no build step, nothing fetched from the internet at run time; a strict
Content-Security-Policy keeps them to this origin.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from radixserve.config import ServerConfig
from radixserve.http.errors import error_response
from radixserve.http.state import AppState
from radixserve.text.tokenizer import Tokenizer

UI_DIR = Path(__file__).resolve().parent.parent / "webui"
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8"}
FRESH_S = 0.5  # a /cache snapshot is served again for this long
HEADERS = {
    "Cache-Control": "no-cache",  # revalidated: a new version is picked up on the next load
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cross-Origin-Opener-Policy": "same-origin",  # llama-server sends these two on its page
    "Cross-Origin-Embedder-Policy": "require-corp",
}


def ui_files() -> dict[str, Path]:
    """The page's files by URL path ("/index.html" also at "/")."""
    files = {f"/{p.name}": p for p in sorted(UI_DIR.iterdir()) if p.suffix in MEDIA_TYPES}
    if "/index.html" in files:
        files["/"] = files["/index.html"]
    return files


# llama-server's answer to a service worker's update check where its page is not served
# (server-http.cpp, verbatim): a browser that used llama.cpp's page at this address keeps its
# worker, which shows that page from its cache until it is told to remove itself. This server
# never serves llama.cpp's page, so /sw.js is always this (or --path's own sw.js).
SW_REMOVE_JS = """
self.addEventListener('install', () => self.skipWaiting());
self.addEventListener('activate', (e) => e.waitUntil((async () => {
    await self.registration.unregister();
    for (const key of await caches.keys()) await caches.delete(key);
    for (const c of await self.clients.matchAll({ type: 'window' })) c.navigate(c.url);
})()));
"""


def public_paths(cfg: ServerConfig) -> frozenset[str]:
    """Paths the API key does not guard: the page's files (llama-server's frontend paths),
    whether the packaged page or --path's directory is served at those names, and /sw.js
    (public in llama-server, --no-ui included: its page's service worker is one of them)."""
    # "": PREFIX itself, which redirects to PREFIX/ (--api-prefix)
    return frozenset([*ui_files(), "", "/sw.js"]) if cfg.webui else frozenset({"/sw.js"})


def mount_page(app: FastAPI, cfg: ServerConfig) -> None:
    """The page's own files (and --path's directory): static files, not API routes, so they
    stay out of the OpenAPI document; `GET /cache` is an API route (add_routes)."""
    prefix = cfg.api_prefix
    # a static file, not an API route; before --path's mount, which takes every path
    app.add_route(prefix + "/sw.js", _service_worker(cfg), methods=["GET", "HEAD"],
                  include_in_schema=False)
    if not cfg.webui:
        return
    if prefix:  # the page's URLs are relative: it must be loaded from "PREFIX/"
        app.add_api_route(prefix, lambda: RedirectResponse(prefix + "/", 308),
                          methods=["GET"], include_in_schema=False)
    if cfg.static_path:  # --path: a directory of the user's instead of the page
        app.mount(prefix or "/", StaticFiles(directory=cfg.static_path, html=True))
        return
    for path, file in ui_files().items():
        app.add_api_route(prefix + path, _serve(file), methods=["GET", "HEAD"],
                          include_in_schema=False)


def _service_worker(cfg: ServerConfig) -> Any:
    """--path's sw.js where it has one (llama-server serves the directory first), else the
    worker that removes itself."""
    own = Path(cfg.static_path) / "sw.js" if cfg.webui and cfg.static_path else None

    async def serve(_: Request) -> Response:
        if own is not None and own.is_file():
            return FileResponse(own, media_type=MEDIA_TYPES[".js"])
        return Response(SW_REMOVE_JS, media_type="application/javascript",
                        headers={"Cache-Control": "no-cache"})

    return serve


def _serve(file: Path) -> Any:
    async def serve() -> Response:
        return FileResponse(file, media_type=MEDIA_TYPES[file.suffix], headers=HEADERS)

    return serve


def add_routes(r: APIRouter, state: AppState) -> None:
    lock = asyncio.Lock()
    last: list[Any] = [-1.0, None, -1]  # (monotonic time, body, eng.changes) of the latest

    @r.get("/cache")
    async def cache() -> Response:
        """What every cache tier holds and what reuse saved (docs/WEBUI.md). Polls within
        `FRESH_S` of a snapshot share it (open tabs do not multiply the engine's work) unless a
        task started or ended since: a client asking right after its answer sees it counted."""
        if not state.cfg.slots_endpoint:
            return error_response(
                501, "This server does not support the cache view. Start it with `--slots`")
        async with lock:
            if time.monotonic() - last[0] > FRESH_S or last[2] != state.eng.changes:
                changes = state.eng.changes  # before the snapshot: a change during it counts
                view = await state.eng.cache_view()
                last[1] = await run_in_threadpool(with_text, view, state.model.tokenizer)
                last[0], last[2] = time.monotonic(), changes
            body = last[1]
        return JSONResponse(body)


def with_text(view: Any, tok: Tokenizer) -> Any:
    """A copy of `view` with every `text` (token ids, or None where not shown) as text; the
    view itself is left alone (the engine shares its parts between snapshots)."""
    if isinstance(view, dict):
        return {k: (("" if v is None else tok.decode(v)) if k == "text" else with_text(v, tok))
                for k, v in view.items()}
    if isinstance(view, list):
        return [with_text(v, tok) for v in view]
    return view
