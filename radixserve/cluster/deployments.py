"""The two Ray Serve deployments: `EngineReplica` (one radixserve engine and its app each) and
`Ingress` (the HTTP entry, behind Ray Serve's proxy, that routes and forwards).

The ingress forwards every request as bytes (`bridge.Forwarded`) with its routing key, so the
replica's own app validates, authenticates and answers it exactly as `radixserve serve` does.
It adds what only the cluster has: `/metrics` summed over replicas, `/replicas` (each replica's
id, pid, node and routing figures), `/replicas/{i}/<route>` (any route on replica i), and the
cache flush sent to every replica.

Failure: a replica first says it took the request (`Accepted`), then answers. Waiting for a
replica to take it is bounded (--timeout; 30 s for one pinned replica), the answer itself is
not (a long generation is legitimate; a dead replica raises at once). A replica that dies
before the response's head reached the ingress has sent the client nothing, so the request is
sent once more (to another replica: the router has dropped the dead one); one that dies
mid-stream ends the stream with an error event (SSE) or a cut body, since a half-sent answer
cannot be taken back. Ray Serve's controller starts a replacement replica.
"""

import asyncio
import contextlib
import json
import logging
import os
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle
from starlette.datastructures import Headers
from starlette.types import Receive, Scope, Send

from radixserve.cluster import route_key as keys
from radixserve.cluster.bridge import Forwarded, Head, run_asgi
from radixserve.cluster.metrics import aggregate
from radixserve.config import ServerConfig
from radixserve.errors import TaskError
from radixserve.http.errors import error_response
from radixserve.http.middleware import key_ok, request_api_key, too_large
from radixserve.http.sse import sse_error

log = logging.getLogger(__name__)
ATTEMPTS = 2  # a request no replica answered is sent once more
PINNED_WAIT_S = 30.0  # for one named replica to take a request
FIGURES_WAIT_S = 10.0  # for a replica's /metrics, /props or info
REPLICA_HEADER = b"x-radixserve-replica"
DEAD = (RayActorError, ActorUnavailableError)  # the replica is gone, not the request wrong
ACCEPTED = "accepted"  # a replica's first item: it has the request
FLUSH_ROUTES = ("/flush_cache", "/reset_prefix_cache")


def serve_config(argv: list[str]) -> ServerConfig:
    from radixserve.flags import parse_serve

    cfg = parse_serve(argv).cfg
    cfg.validate()
    return cfg


class EngineReplica:
    """One engine, loaded before Ray Serve marks the replica ready (so nothing is routed to a
    replica still loading), serving its `serve` app in process."""

    def __init__(self, serve_argv: list[str]) -> None:
        from radixserve.log_setup import setup_logging
        from radixserve.http.app import create_app
        from radixserve.http.run import build_engine

        from radixserve.model.kernel_config import KernelConfig

        cfg = serve_config(serve_argv)
        setup_logging(cfg)
        cfg.kernels = KernelConfig.from_env()  # the replica's start-up: its process's kernels
        self.engine = build_engine(cfg)
        self.app = create_app(self.engine, cfg=cfg)
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        self.started = time.time()

    async def handle(self, req: Forwarded) -> AsyncGenerator[Head | bytes | str, None]:
        yield ACCEPTED
        async for item in run_asgi(self.app, req):
            if isinstance(item, Head):
                item.headers.append((REPLICA_HEADER, self.replica_id.encode()))
            yield item

    def info(self, req: Forwarded) -> dict[str, Any]:
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)
        return {"id": self.replica_id, "pid": os.getpid(),
                "node_ip": ray.util.get_node_ip_address(), "started": self.started,
                "n_slots": self.engine.n_slots, "cpus": cpus}

    def check_health(self) -> None:
        """Ray Serve's health probe: a replica whose engine thread died is replaced."""
        if not self.engine.alive:
            raise RuntimeError("the engine thread has stopped")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()


class Unavailable(Exception):
    """No replica answered: the client gets a 503 with this message."""


class Relayed(StreamingResponse):
    """A replica's response as it came (every header, duplicates included), whose body
    iterator is closed however sending ends: a client that leaves cancels the replica's
    request now, not when the garbage collector finds the generator."""

    def __init__(self, body: AsyncIterator[bytes], head: Head) -> None:
        super().__init__(body, status_code=head.status)
        self.raw_headers = [(k.lower(), v) for k, v in head.headers
                            if k.lower() != b"transfer-encoding"]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
PINNED = re.compile(r"^/replicas/(\d+)(/.*)$")


def _is_sse(head: Head) -> bool:
    return any(k.lower() == b"content-type" and b"text/event-stream" in v
               for k, v in head.headers)


def _stream_error(status: int, type_: str, message: str) -> bytes:
    """The stream's last event, in the shape of llama-server's errors after a stream began."""
    return sse_error(TaskError(status, type_, message))


@serve.ingress(app)
class Ingress:
    def __init__(self, engines: DeploymentHandle, serve_argv: list[str],
                 engine_deployment: str) -> None:
        self.engines = engines
        self.cfg = serve_config(serve_argv)
        self.engine_deployment = engine_deployment
        self.template: Any = None  # the model's ChatTemplate, once a replica gave it
        self._template_at = 0.0
        self.retried = 0  # requests sent again after their replica died

    # -- forwarding ---------------------------------------------------------------------------

    async def _send(self, fwd: Forwarded) -> tuple[Head, Any]:
        """The response's head and the stream it came on."""
        wait = PINNED_WAIT_S if fwd.target is not None else float(self.cfg.timeout)
        for attempt in range(ATTEMPTS):
            gen: Any = self.engines.options(stream=True).handle.remote(fwd)
            try:
                try:
                    await asyncio.wait_for(gen.__anext__(), timeout=wait)  # ACCEPTED
                except asyncio.TimeoutError:
                    raise Unavailable(f"no replica took the request within {wait:g} s") from None
                head = await gen.__anext__()
            except DEAD as e:
                gen.cancel()
                if attempt + 1 == ATTEMPTS or fwd.target is not None:  # a pinned one is gone
                    raise Unavailable("the replicas serving this request stopped before "
                                      f"answering ({type(e).__name__})") from None
                self.retried += 1
                log.warning("replica died before answering; sending again (%s)", e)
                continue
            except BaseException:
                gen.cancel()
                raise
            assert isinstance(head, Head)
            return head, gen
        raise AssertionError("unreachable")

    async def _forward(self, fwd: Forwarded) -> Response:
        try:
            head, gen = await self._send(fwd)
        except Unavailable as e:
            return error_response(503, str(e), "unavailable_error")
        sse = _is_sse(head)

        async def rest() -> AsyncIterator[bytes]:
            try:
                async for chunk in gen:
                    yield chunk
            except DEAD as e:
                log.warning("replica died mid-response: %s", e)
                if not sse:
                    raise  # the connection drops: the client sees a cut body, not a whole one
                yield _stream_error(503, "unavailable_error", "the replica serving this "
                                    f"request stopped: {type(e).__name__}")
            except Exception as e:
                log.exception("relaying a response failed")
                if not sse:
                    raise
                yield _stream_error(500, "server_error", f"relaying failed: {type(e).__name__}")
            finally:
                gen.cancel()  # a client that left: the replica's app sees the disconnect

        return Relayed(rest(), head)

    async def _call(self, fwd: Forwarded) -> tuple[int, bytes]:
        """A whole small response (figures, /props, a flush), within FIGURES_WAIT_S."""
        async def whole() -> tuple[int, bytes]:
            head, gen = await self._send(fwd)
            try:
                return head.status, b"".join([c async for c in gen])
            finally:
                gen.cancel()

        try:
            return await asyncio.wait_for(whole(), FIGURES_WAIT_S)
        except asyncio.TimeoutError:
            raise Unavailable(f"no answer within {FIGURES_WAIT_S:g} s") from None

    async def _chat_template(self) -> Any:
        """The model's template, from a replica's /props (asked again at most every 10 s until
        one answers): the ingress renders chat prompts with it to route them. Without it a
        chat is routed by its messages' text."""
        from radixserve.text.chat_template import ChatTemplate

        if self.template is None and time.monotonic() - self._template_at > 10:
            self._template_at = time.monotonic()
            auth = ([(b"authorization", f"Bearer {self.cfg.api_key[0]}".encode())]
                    if self.cfg.api_key else [])
            try:
                status, body = await self._call(
                    Forwarded("GET", self.cfg.api_prefix + "/props", headers=auth))
                p = json.loads(body) if status == 200 else {}
                self.template = ChatTemplate(p["chat_template"], p.get("bos_token", ""),
                                             p.get("eos_token", ""))
            except Exception as e:
                log.warning("no chat template to route by yet: %s", e)
        return self.template

    # -- the cluster's own routes -------------------------------------------------------------

    def _router(self) -> Any:
        from radixserve.cluster.replica_router import ROUTERS

        return ROUTERS.get(self.engine_deployment)

    async def replica_ids(self) -> list[str]:
        """The live replicas, as the router in this process knows them."""
        deadline = time.monotonic() + PINNED_WAIT_S
        while True:
            router = self._router()
            ids = router.replica_ids() if router is not None else []
            if ids or time.monotonic() > deadline:
                return ids
            if router is None:  # the handle builds its router on first use
                with contextlib.suppress(asyncio.TimeoutError, *DEAD):
                    await asyncio.wait_for(self.engines.info.remote(Forwarded("GET", "/")),
                                           FIGURES_WAIT_S)
            await asyncio.sleep(0.2)

    async def _each_ok(self, fwd: Forwarded) -> list[bytes] | Response:
        """`fwd` on every replica, one after the other: their bodies; or the response that
        ends the request: a 503 if a replica did not answer, the first answer that is not a
        200 as is (--metrics off, a bad key: as one server says it). Not at once: Ray Serve's
        router matches a routed replica to its request by the id of the HTTP request it came
        from, which concurrent calls made for one request share (one would take the other's
        replica and the other wait forever)."""
        ids = await self.replica_ids()
        if not ids:
            return error_response(503, "no replica is running", "unavailable_error")
        bodies = []
        for rid in ids:
            pinned = Forwarded(fwd.method, fwd.path, fwd.query, fwd.headers, fwd.body,
                               fwd.client, target=rid)
            try:
                status, body = await self._call(pinned)
            except (Unavailable, *DEAD) as e:
                return error_response(503, f"replica {rid} did not answer: {e}",
                                      "unavailable_error")
            if status != 200:
                return Response(body, status_code=status, media_type="application/json")
            bodies.append(body)
        return bodies

    async def _replicas(self) -> Response:
        router = self._router()
        out = []
        for i, rid in enumerate(await self.replica_ids()):
            try:
                info = await asyncio.wait_for(
                    self.engines.info.remote(Forwarded("GET", "/", target=rid)), FIGURES_WAIT_S)
            except (asyncio.TimeoutError, *DEAD) as e:
                info = {"id": rid, "error": type(e).__name__}
            if router is not None:
                info |= router.figures(rid)
            out.append({"index": i, **info})
        rules = router.rules() if router is not None else {}
        return Response(json.dumps({"replicas": out, "retried": self.retried, **rules}),
                        media_type="application/json")

    async def _metrics(self, fwd: Forwarded) -> Response:
        """Every replica's /metrics, summed; a replica that gives none makes the scrape fail
        (503) rather than make the cluster's counters drop and jump back."""
        answers = await self._each_ok(fwd)
        if isinstance(answers, Response):
            return answers
        return Response(aggregate([body.decode() for body in answers]),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _flush(self, fwd: Forwarded) -> Response:
        """A cache flush empties every replica's cache, and so the router's record of them."""
        answers = await self._each_ok(fwd)
        if isinstance(answers, Response):
            return answers
        router = self._router()
        if router is not None:
            router.index.clear()
        flushed: dict[str, int] = {}  # what went, over all replicas
        for body in answers:
            for k, v in json.loads(body).get("flushed", {}).items():
                flushed[k] = flushed.get(k, 0) + v
        return Response(json.dumps({"flushed": flushed}), media_type="application/json")

    def _authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        h = Headers(raw=headers)
        return not self.cfg.api_key or key_ok(request_api_key(h), self.cfg.api_key)

    async def _body(self, request: Request) -> bytes | Response:
        """The body, refused past --max-body-mib as one server refuses it (413), before it is
        read whole or shipped to a replica."""
        cap = self.cfg.max_body_mib << 20
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > cap:
            return too_large(cap)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > cap:
                return too_large(cap)
        return bytes(body)

    @app.api_route("/{path:path}", methods=METHODS)
    async def entry(self, request: Request, path: str) -> Response:
        raw_path, prefix = request.url.path, self.cfg.api_prefix
        # the route under --api-prefix; None outside it (the replica answers that 404)
        route = raw_path if not prefix else (
            raw_path[len(prefix):] if raw_path.startswith(prefix) else None)
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        headers = list(request.scope["headers"])
        client = request.client
        fwd = Forwarded(request.method, raw_path, request.scope.get("query_string", b""),
                        headers, body, (client.host, client.port) if client else None)
        if route == "/metrics" and request.method == "GET":
            return await self._metrics(fwd)  # each replica checks the key
        if route in FLUSH_ROUTES and request.method == "POST":
            return await self._flush(fwd)
        if route == "/replicas" and request.method == "GET":
            if not self._authorized(headers):
                return error_response(401, "Invalid API Key", "authentication_error")
            return await self._replicas()
        m = PINNED.match(route or "")
        if m is not None:  # the replica checks the key of the route it is asked
            ids = await self.replica_ids()
            if int(m.group(1)) >= len(ids):
                return error_response(404, f"no replica {m.group(1)} (there are {len(ids)})",
                                      "not_found_error")
            fwd.path, fwd.target = prefix + m.group(2), ids[int(m.group(1))]
        elif route in keys.PROMPT_PATHS:
            template = await self._chat_template() if route in keys.CHAT_PATHS else None
            fwd.route_key = keys.route_key(route, body, template, self.cfg.chat_template_kwargs)
        return await self._forward(fwd)
