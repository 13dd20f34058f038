"""The soak's traffic (`radixserve bench soak`, see soak.py): how each kind of plan item
(soak_judge.KINDS) is sent, by C workers sharing one plan.

httpx for what a client library sends; raw sockets where one cannot: leaving right after the
request's last byte (FIN or reset) and bodies past the server's size limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from radixserve.bench.scenarios import INSTRUCTION, make_text
from radixserve.bench.soak_judge import Item, Outcome, classify

TENANTS = (None, "tenant-a", "tenant-b")  # cache_salt: no salt, and two tenants
REQUEST_TIMEOUT_S = 300.0  # a normal request slower than this is a hang, not a slow answer
EXCERPT = 300
# a drained slot cycle: how long the slots may stay busy once every client has left (a
# cancel takes one engine step)
DRAIN_IDLE_S = 5.0
# requests the client leaves: long enough that a task nobody cancelled keeps its slot busy
# well past DRAIN_IDLE_S and the final idle wait (costs nothing when the cancel works)
LEFT_N_PREDICT = 1024
COMPLETION_ROUTES = ("/completion", "/v1/completions")
CHAT = "/v1/chat/completions"
JSON_HEADERS = {"content-type": "application/json"}

# (variant, method, path, body): each one wrong in one way only
MALFORMED: tuple[tuple[str, str, str, bytes], ...] = tuple(
    (v, m, p, b if isinstance(b, bytes) else json.dumps(b).encode()) for v, m, p, b in (
        ("invalid-json", "POST", "/completion", b'{"prompt": "hi", '),
        ("invalid-json-chat", "POST", CHAT, b"[1, 2"),
        ("not-utf8", "POST", "/completion", b"\xff\xfe{}"),
        ("empty-body", "POST", CHAT, b""),
        ("prompt-object", "POST", "/completion", {"prompt": {"a": 1}}),
        ("n_predict-string", "POST", "/completion", {"prompt": "hi", "n_predict": "many"}),
        ("n_predict-negative", "POST", "/completion", {"prompt": "hi", "n_predict": -5}),
        ("n_predict-infinite", "POST", "/completion", b'{"prompt": "hi", "n_predict": 1e400}'),
        ("temperature-nan", "POST", "/completion", b'{"prompt": "hi", "temperature": NaN}'),
        ("top_p-minus-infinity", "POST", "/completion", b'{"prompt": "hi", "top_p": -Infinity}'),
        ("n_probs-huge", "POST", "/completion", {"prompt": "hi", "n_probs": 10 ** 21}),
        ("id_slot-huge", "POST", "/completion", {"prompt": "hi", "id_slot": 10 ** 6}),
        ("token-out-of-vocab", "POST", "/completion", {"prompt": [999_999_999]}),
        ("cache_salt-empty", "POST", "/completion", {"prompt": "hi", "cache_salt": ""}),
        ("grammar-invalid", "POST", "/completion", {"prompt": "hi", "grammar": "root ::= ("}),
        ("messages-string", "POST", CHAT, {"messages": "hi"}),
        ("role-unknown", "POST", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}),
        ("max_tokens-negative", "POST", CHAT,
         {"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}),
        ("stream-string", "POST", CHAT,
         {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}),
        ("response_format-enum", "POST", CHAT,
         {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}),
        ("reasoning_format-enum", "POST", CHAT,
         {"messages": [{"role": "user", "content": "x"}], "reasoning_format": "bogus"}),
        ("logprobs-negative", "POST", "/v1/completions", {"prompt": "x", "logprobs": -2}),
        ("unknown-route", "POST", "/v1/nothing", {}),
        ("wrong-method", "GET", "/completion", b""),
        ("slot-id-invalid", "POST", "/slots/abc?action=save", {"filename": "x"}),
        ("slot-action-invalid", "POST", "/slots/0?action=explode", {"filename": "x"}),
        ("slot-filename-escape", "POST", "/slots/0?action=save", {"filename": "../x"}),
    ))


@dataclass(slots=True)
class Sizes:
    """Prompt and answer sizes (tokens of the default model; small in CI)."""

    n_docs: int = 4
    doc_tokens: int = 256
    max_tokens: int = 48  # n_predict of normal requests: 8 .. this
    pressure_tokens: int = 1536  # long unique prompts: half of this .. this


@dataclass(slots=True)
class Traffic:
    """Where and what to send: shared by every worker."""

    url: str  # http://127.0.0.1:PORT
    client: httpx.AsyncClient
    n_slots: int
    max_body_bytes: int
    sizes: Sizes
    docs: list[str] = field(default_factory=list)
    gate: Gate = field(default_factory=lambda: Gate())

    def __post_init__(self) -> None:
        rng = random.Random(0)  # the shared documents are the same in every soak
        self.docs = [INSTRUCTION + "\n\ndocument:\n" + make_text(rng, self.sizes.doc_tokens)
                     for _ in range(self.sizes.n_docs)]


def _body(tr: Traffic, rng: random.Random, route: str, stream: bool,
          n_predict: int | None = None) -> dict[str, Any]:
    """A question on one shared document (prefix reuse), greedy or seeded sampling, and a
    tenant's cache_salt one time in three."""
    doc, q = rng.choice(tr.docs), "question: " + make_text(rng, rng.randint(6, 16)) + "?"
    n = n_predict or rng.randint(8, max(8, tr.sizes.max_tokens))
    body: dict[str, Any] = {"temperature": rng.choice((0.0, 0.8)), "seed": rng.randrange(1000),
                            "stream": stream}
    if route == CHAT:
        body |= {"messages": [{"role": "system", "content": doc},
                              {"role": "user", "content": q}], "max_tokens": n}
    else:
        body |= {"prompt": f"{doc}\n\n{q}\nanswer:",
                 ("n_predict" if route == "/completion" else "max_tokens"): n}
    salt = rng.choice(TENANTS)
    return body | ({"cache_salt": salt} if salt else {})


def _left_body(tr: Traffic, rng: random.Random, route: str, stream: bool) -> dict[str, Any]:
    """A request the client will leave: long and fixed length (LEFT_N_PREDICT)."""
    return _body(tr, rng, route, stream, n_predict=LEFT_N_PREDICT) | {"ignore_eos": True}


async def _post(tr: Traffic, o: Outcome, path: str, body: dict[str, Any] | None,
                timeout: float = REQUEST_TIMEOUT_S) -> None:
    o.request = json.dumps(body)[:EXCERPT] if body is not None else ""
    r = await tr.client.post(tr.url + path, json=body, timeout=timeout)
    o.status, o.response = r.status_code, r.text[:EXCERPT]
    if r.is_success:
        try:
            r.json()
        except ValueError:
            o.error = "a 2xx whose body is not JSON"


async def _stream(tr: Traffic, o: Outcome, path: str, body: dict[str, Any],
                  stop_after: int | None) -> None:
    """POST a streamed request; read its SSE events, or only `stop_after` of them and close
    (0: close once the headers are in)."""
    o.request = json.dumps(body)[:EXCERPT]
    async with tr.client.stream("POST", tr.url + path, json=body,
                                timeout=REQUEST_TIMEOUT_S) as r:
        o.status, o.chunks = r.status_code, 0
        if r.status_code != 200:
            o.response = (await r.aread()).decode(errors="replace")[:EXCERPT]
            return
        if stop_after == 0:
            o.client_left = True
            return
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            o.chunks += 1
            event = json.loads(line[5:])
            if "error" in event:
                o.error, o.response = "error event in the stream", line[:EXCERPT]
                code = (event["error"] or {}).get("code") if isinstance(event["error"], dict) \
                    else None
                o.status = code if isinstance(code, int) else 500
                return
            if stop_after is not None and o.chunks >= stop_after:
                o.client_left = True
                return


def _raw_request(tr: Traffic, method: str, path: str, headers: dict[str, str],
                 body: bytes = b"") -> bytes:
    host = tr.url.split("//", 1)[1]
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: close",
             *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _raw_open(tr: Traffic) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = tr.url.split("//", 1)[1].rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def _read_response(o: Outcome, reader: asyncio.StreamReader) -> None:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
    lines = head.decode("latin-1").split("\r\n")
    o.status = int(lines[0].split()[1])
    length = next((int(x.split(":", 1)[1]) for x in lines[1:]
                   if x.lower().startswith("content-length:")), 0)
    o.response = (await asyncio.wait_for(reader.readexactly(length), 60)).decode(
        errors="replace")[:EXCERPT]


async def _abandon_early(tr: Traffic, o: Outcome, rng: random.Random) -> None:
    """Send a streamed or plain request and leave before any byte of the answer: a FIN, or a
    reset (SO_LINGER 0, then close)."""
    route = rng.choice((*COMPLETION_ROUTES, CHAT))
    body = _left_body(tr, rng, route, rng.random() < 0.5)
    raw = json.dumps(body).encode()
    o.request = raw[:EXCERPT].decode(errors="replace")
    _, writer = await _raw_open(tr)
    writer.write(_raw_request(tr, "POST", route, JSON_HEADERS | {
        "Content-Length": str(len(raw))}, raw))
    await writer.drain()
    o.variant, o.client_left, o.chunks = rng.choice(("fin", "reset")), True, 0
    if o.variant == "reset":
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                   struct.pack("ii", 1, 0))
    writer.close()


async def _oversized(tr: Traffic, o: Outcome, rng: random.Random) -> None:
    """A body past the server's limit: declared in Content-Length (refused before reading),
    or chunked (refused once the bytes read pass it). The last chunk stops just past the
    limit, so the server has read all we sent when it answers and closes (unread bytes would
    make its close a reset, which can destroy the 413 before we read it)."""
    o.variant = rng.choice(("content-length", "chunked"))
    o.request = f"{o.variant} body of more than {tr.max_body_bytes} bytes"
    reader, writer = await _raw_open(tr)
    try:
        if o.variant == "content-length":
            writer.write(_raw_request(tr, "POST", "/completion", JSON_HEADERS | {
                "Content-Length": str(tr.max_body_bytes + 1)}))
        else:
            start = b'{"prompt": "'
            writer.write(_raw_request(tr, "POST", "/completion", JSON_HEADERS | {
                "Transfer-Encoding": "chunked"}, b"%x\r\n%s\r\n" % (len(start), start)))
            left = tr.max_body_bytes + 1 - len(start)
            while left > 0:
                n = min(left, 1 << 16)
                left -= n
                writer.write(f"{n:x}\r\n".encode() + b"x" * n + (b"\r\n" if left else b""))
                await writer.drain()
        await writer.drain()
        await _read_response(o, reader)
    finally:
        writer.close()


async def _get_slots(tr: Traffic, o: Outcome, into: list[dict[str, Any]]) -> None:
    r = await tr.client.get(tr.url + "/slots", timeout=REQUEST_TIMEOUT_S)
    o.status, o.response = r.status_code, r.text[:EXCERPT]
    into.extend(r.json() if r.is_success else [])


async def _drain_check(tr: Traffic, o: Outcome) -> None:
    """With no exchange in flight, every slot must go idle within DRAIN_IDLE_S: a slot still
    processing then decodes for a client that left (a lost cancel)."""
    t0 = time.monotonic()
    while True:
        slots: list[dict[str, Any]] = []
        await _get_slots(tr, o, slots)
        busy = [s["id"] for s in slots if s.get("is_processing")]
        if o.status != 200 or not busy:
            return
        if time.monotonic() - t0 > DRAIN_IDLE_S:
            o.error = f"slots {busy} still processing {DRAIN_IDLE_S:g} s after every client left"
            return
        await asyncio.sleep(0.1)


async def _slot_cycle(tr: Traffic, item: Item, rng: random.Random, drained: bool,
                      ) -> list[Outcome]:
    """Save an idle slot (the one holding the most tokens) to a file, restore the file into
    an idle slot (all of its tokens must come back), erase an idle slot. `drained`: alone
    (Gate), after `_drain_check`; else amid the traffic, where a slot that turned busy since
    the listing answers 409, which is expected."""
    how = " (drained)" if drained else " (live)"
    out: list[Outcome] = []
    if drained:
        out.append(Outcome(item.index, "slot", "drain"))
        await _timed(out[-1], _drain_check(tr, out[-1]))

    async def act(action: str, pick: Callable[[list[dict[str, Any]]], int],
                  body: dict[str, Any] | None) -> Outcome:
        listing, slots = Outcome(item.index, "slot", "list" + how), list[dict[str, Any]]()
        await _timed(listing, _get_slots(tr, listing, slots))
        idle = [s for s in slots if not s.get("is_processing")] or \
            [{"id": i} for i in range(tr.n_slots)]
        o = Outcome(item.index, "slot", action + how)
        await _timed(o, _post(tr, o, f"/slots/{pick(idle)}?action={action}", body))
        out.extend((listing, o))
        return o

    name = {"filename": f"soak-{item.index}.bin"}
    save = await act("save", lambda idle: max(
        idle, key=lambda s: (s.get("n_prompt_tokens", 0), rng.random()))["id"], name)
    if save.status == 200:
        restore = await act("restore", lambda idle: rng.choice(idle)["id"], name)
        n_saved = json.loads(save.response).get("n_saved")
        if restore.status == 200 and json.loads(restore.response).get("n_restored") != n_saved:
            restore.error = f"restored other than the {n_saved} tokens saved"
            restore.verdict = classify(restore)
    await act("erase", lambda idle: rng.choice(idle)["id"], None)
    return out


class Gate:
    """Many exchanges at once, or one slot cycle alone: a drained cycle waits until every
    exchange in flight has ended and holds new ones back (an operator saving slots in a quiet
    moment), so it finds idle slots that still hold KV; a live one meets the traffic."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._active, self._alone = 0, False

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._alone)
            self._active += 1
        try:
            yield
        finally:
            async with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def alone(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._alone)
            self._alone = True
            await self._cond.wait_for(lambda: self._active == 0)
        try:
            yield
        finally:
            async with self._cond:
                self._alone = False
                self._cond.notify_all()


async def _timed(o: Outcome, send: Awaitable[None]) -> None:
    """Run one exchange; a client time-out we chose is the client leaving, any other
    exception an answer that never came. Then the verdict."""
    o.t_start, t0 = time.monotonic(), time.perf_counter()
    try:
        await send
    except httpx.TimeoutException as e:
        if o.kind == "client_timeout":
            o.client_left = True
        else:
            o.error = f"{type(e).__name__}: {e}"[:EXCERPT]
    except Exception as e:  # any failure is one classified answer, never a stuck soak
        o.error = f"{type(e).__name__}: {e}"[:EXCERPT]
    o.elapsed_s = time.perf_counter() - t0
    o.verdict = classify(o)


async def run_item(tr: Traffic, item: Item) -> list[Outcome]:
    """Send one plan item; its outcomes (several for a slot cycle)."""
    rng = random.Random(item.seed)
    if item.kind == "slot":
        drained = rng.random() < 0.5
        async with tr.gate.alone() if drained else tr.gate.shared():
            return await _slot_cycle(tr, item, rng, drained)
    async with tr.gate.shared():
        return await _send(tr, item, rng)


async def _send(tr: Traffic, item: Item, rng: random.Random) -> list[Outcome]:
    o = Outcome(item.index, item.kind, "")
    send: Awaitable[None]
    match item.kind:
        case "completion" | "chat" | "stream":
            route = CHAT if item.kind == "chat" else rng.choice(
                (*COMPLETION_ROUTES, CHAT) if item.kind == "stream" else COMPLETION_ROUTES)
            o.variant = route
            body = _body(tr, rng, route, item.kind == "stream")
            send = _stream(tr, o, route, body, None) if item.kind == "stream" \
                else _post(tr, o, route, body)
        case "abandon_stream":
            route, k = rng.choice((*COMPLETION_ROUTES, CHAT)), rng.randint(0, 6)
            o.variant = f"after {k} chunks"
            body = _left_body(tr, rng, route, True)
            send = _stream(tr, o, route, body, k)
        case "abandon_early":
            send = _abandon_early(tr, o, rng)
        case "client_timeout":
            route, t = rng.choice(COMPLETION_ROUTES), rng.uniform(0.05, 2.0)
            o.variant = route
            body = _left_body(tr, rng, route, False)
            send = _post(tr, o, route, body, timeout=t)
        case "malformed":
            o.variant, method, path, raw = rng.choice(MALFORMED)
            o.request = raw[:EXCERPT].decode(errors="replace")
            send = _raw_http(tr, o, method, path, raw)
        case "oversized":
            send = _oversized(tr, o, rng)
        case "flush":
            send = _post(tr, o, "/flush_cache", None)
        case "pressure":
            n = rng.randint(tr.sizes.pressure_tokens // 2, tr.sizes.pressure_tokens)
            o.variant = "long unique prompt"
            body = {"prompt": make_text(rng, n), "n_predict": 4, "cache_prompt": True}
            send = _post(tr, o, "/completion", body)
        case _:
            raise ValueError(f"unknown soak kind {item.kind!r}")
    await _timed(o, send)
    return [o]


async def _raw_http(tr: Traffic, o: Outcome, method: str, path: str, body: bytes) -> None:
    """A request whose bytes are sent as they are (invalid JSON, NaN), through httpx."""
    r = await tr.client.request(method, tr.url + path, content=body, headers=JSON_HEADERS,
                                timeout=REQUEST_TIMEOUT_S)
    o.status, o.response = r.status_code, r.text[:EXCERPT]


async def run_plan(tr: Traffic, plan: list[Item], concurrency: int, deadline: float,
                   on_done: Callable[[list[Outcome]], None] | None = None,
                   ) -> tuple[list[Outcome], int]:
    """`concurrency` workers take the plan's items in order until it is done or
    `time.monotonic()` passes `deadline` (the safety stop: items in flight finish). Returns
    the outcomes and the number of items that ran."""
    it = iter(plan)
    out: list[Outcome] = []
    ran = 0

    async def worker() -> None:
        nonlocal ran
        for item in it:  # one shared iterator: each item goes to exactly one worker
            if time.monotonic() > deadline:
                return
            got = await run_item(tr, item)
            out.extend(got)
            ran += 1
            if on_done is not None:
                on_done(got)

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    return out, ran
