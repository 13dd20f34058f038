"""`radixserve bench soak`: its judgement without a server (classification, plan, probe, RSS
budget, failure reasons), the traffic against fake servers that answer wrongly (the soak must
call that a failure), and a short soak of a real server on the default model."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixserve.bench import soak_traffic
from radixserve.bench.cli import main
from radixserve.bench.soak import log_problems
from radixserve.bench.soak_judge import (
    EXPECTED,
    KINDS,
    SERVER_ERROR,
    UNEXPECTED,
    Item,
    Outcome,
    classify,
    counts,
    error_shape_ok,
    failures,
    make_plan,
    probe_verdict,
    rss_budget,
    rss_figures,
)
from radixserve.bench.soak_traffic import Sizes, Traffic, run_item

SHAPED = json.dumps({"error": {"code": 400, "message": "bad", "type": "invalid_request_error"}})


def outcome(kind: str, status: int | None, response: str = "", **kw: Any) -> Outcome:
    return Outcome(0, kind, "", status=status, response=response, **kw)


@pytest.mark.parametrize(("o", "want"), [
    (outcome("completion", 200), EXPECTED),
    (outcome("completion", 400, SHAPED), UNEXPECTED),  # a valid request refused
    (outcome("completion", 503, SHAPED), SERVER_ERROR),
    (outcome("completion", None, error="ConnectError"), UNEXPECTED),  # not the client's doing
    (outcome("abandon_stream", None, client_left=True), EXPECTED),
    (outcome("abandon_stream", 200, client_left=True, chunks=0), EXPECTED),
    (outcome("abandon_stream", 404, SHAPED, client_left=True), UNEXPECTED),
    (outcome("stream", 200, error="error event in the stream"), UNEXPECTED),
    (outcome("stream", 500, error="error event in the stream"), SERVER_ERROR),
    (outcome("client_timeout", None, client_left=True), EXPECTED),
    (outcome("client_timeout", None, error="ReadError"), UNEXPECTED),
    (outcome("malformed", 400, SHAPED), EXPECTED),
    (outcome("malformed", 404, SHAPED), EXPECTED),
    (outcome("malformed", 400, '{"detail": "bad"}'), UNEXPECTED),  # not OpenAI's error shape
    (outcome("malformed", 200, "{}"), UNEXPECTED),  # garbage accepted
    (outcome("malformed", 500, SHAPED), SERVER_ERROR),
    (outcome("malformed", None, error="RemoteProtocolError"), UNEXPECTED),
    (outcome("oversized", 413, SHAPED), EXPECTED),
    (outcome("oversized", 400, SHAPED), UNEXPECTED),
    (outcome("oversized", None, error="ConnectionResetError"), UNEXPECTED),
    (outcome("slot", 409, SHAPED), EXPECTED),  # busy slot
    (outcome("slot", 409, "busy"), UNEXPECTED),
    (outcome("slot", 400, SHAPED), UNEXPECTED),
    (outcome("slot", 501, SHAPED), SERVER_ERROR),
    (outcome("completion", 409, SHAPED), UNEXPECTED),
    (outcome("flush", 200), EXPECTED),
])
def test_classify(o: Outcome, want: str) -> None:
    assert classify(o) == want


def test_error_shape() -> None:
    assert error_shape_ok(SHAPED)
    code_str = json.dumps({"error": {"code": "400", "message": "m", "type": "t"}})
    for bad in ("", "{}", '{"error": "x"}', code_str, '{"error": {"code": 400, "message": "m"}}'):
        assert not error_shape_ok(bad), bad


def test_plan_is_seeded_and_covers_every_kind() -> None:
    plan = make_plan(120, 3)
    assert plan == make_plan(120, 3) and plan != make_plan(120, 4)
    assert [i.index for i in plan] == list(range(120))
    assert {i.kind for i in plan} == set(KINDS)
    assert {i.kind for i in make_plan(len(KINDS), 0)} == set(KINDS)
    big = [i.kind for i in make_plan(20000, 0)]
    for kind, share in KINDS.items():  # the rest follows the shares
        assert abs(big.count(kind) / len(big) - share) < 0.01, kind


def test_rss_budget() -> None:
    assert rss_budget(300.0, 64, 512.0) == 876.0
    assert rss_budget(300.0, -1, 512.0) is None  # unbounded host cache: nothing to check
    assert rss_budget(None, 64, 512.0) is None
    series = [(0.0, 280.0), (1.0, 900.0), (2.0, 500.0)]
    over = rss_figures(series, 300.0, 64, 512.0)
    assert over["peak_mib"] == 900.0 and over["within_budget"] is False
    assert rss_figures(series, 400.0, 64, 512.0)["within_budget"] is True
    assert rss_figures([], 400.0, 64, 512.0)["within_budget"] is None
    # the kernel's high-water mark saw a spike between two samples
    spike = rss_figures(series, 400.0, 64, 512.0, hwm_mib=1000.0)
    assert spike["peak_mib"] == 1000.0 and spike["peak_sampled_mib"] == 900.0
    assert spike["within_budget"] is False


def probe(tokens: list[int], cached: list[list[int]] | None = None) -> dict[str, Any]:
    return {"uncached": tokens, "cached": cached or [tokens, tokens], "cache_n": [0, 9, 9]}


def test_probe_verdict() -> None:
    a, b = [1, 2, 3], [1, 2, 4]
    assert probe_verdict(probe(a), probe(a), True)["ok"]
    changed = probe_verdict(probe(a), probe(b), True)
    assert not changed["unchanged"] and not changed["ok"]
    cached_off = probe_verdict(probe(a), probe(a, [a, b]), True)
    assert cached_off["unchanged"] and not cached_off["cached_equal"] and not cached_off["ok"]
    # without deterministic mode, cached != uncached is reported, not a failure
    assert probe_verdict(probe(a), probe(a, [a, b]), False)["ok"]
    assert not probe_verdict({"error": "ReadTimeout"}, probe(a), False)["ok"]


def report(outcomes: list[Outcome], **over: Any) -> dict[str, Any]:
    rep = {"counts": counts(outcomes),
           "final": {"idle": True, "waited_s": 0.0, "busy_slots": [],
                     "requests_processing": 0.0, "requests_deferred": 0.0},
           "probe": probe_verdict(probe([1]), probe([1]), True),
           "rss": rss_figures([(0.0, 100.0)], 100.0, 64, 512.0)}
    return rep | over


def test_failures() -> None:
    ok = [outcome("completion", 200, verdict=EXPECTED),
          outcome("abandon_early", None, client_left=True, chunks=0, verdict=EXPECTED)]
    assert failures(report(ok)) == []
    c = report(ok)["counts"]
    assert c["requests"] == 2 and c["zero_chunk_abandons"] == 1
    assert c["per_kind"]["abandon_early"]["client_left"] == 1
    bad = [*ok, outcome("stream", 502, verdict=SERVER_ERROR),
           outcome("malformed", 200, verdict=UNEXPECTED)]
    assert failures(report(bad)) == ["1 unexpected answer(s)", "1 5xx answer(s)"]
    busy = {"idle": False, "waited_s": 30.0, "busy_slots": [2], "requests_processing": 1.0,
            "requests_deferred": 0.0}
    assert failures(report(ok, final=busy))[0].startswith("not idle 30.0 s")
    changed = probe_verdict(probe([1]), probe([2]), True)
    assert failures(report(ok, probe=changed)) == ["probe changed"]
    over = rss_figures([(0.0, 1000.0)], 100.0, 64, 512.0)
    assert failures(report(ok, rss=over))[0].startswith("peak RSS 1000 MiB over")


def test_log_problems(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("2026-12-03 07:46:39,716 INFO radixserve.x: ERRORS fine\n"
                   "2026-12-03 07:46:39,716 ERROR radixserve.http.errors: POST /x failed\n"
                   "WARNING:  Invalid HTTP request received.\n")
    got = log_problems(log, keep=1)
    assert got["error"] == {"n": 1, "first": [
        "2026-12-03 07:46:39,716 ERROR radixserve.http.errors: POST /x failed"]}
    assert got["warning"]["n"] == 1


class FakeServer:
    """A loopback HTTP/1.1 server answering every request with one canned status and body
    (`slots` for GET /slots), after reading its head and declared body: what a broken server
    looks like to the soak."""

    def __init__(self, status: int, body: str, slots: str = "[]") -> None:
        self.status, self.body, self.slots = status, body, slots

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            length = next((int(x.split(":", 1)[1]) for x in head.split("\r\n")
                           if x.lower().startswith("content-length:")), 0)
            await reader.readexactly(length)
            body = self.slots if head.startswith("GET /slots") else self.body
            writer.write(f"HTTP/1.1 {self.status} X\r\ncontent-type: application/json\r\n"
                         f"content-length: {len(body)}\r\nconnection: close\r\n\r\n{body}"
                         .encode())
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def run(self, kinds: list[str]) -> list[Outcome]:
        return await self.send(lambda tr: asyncio.gather(*(
            run_item(tr, Item(i, k, i)) for i, k in enumerate(kinds))))

    async def send(self, items: Callable[[Traffic], Awaitable[Sequence[list[Outcome]]]],
                   ) -> list[Outcome]:
        server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, httpx.AsyncClient() as client:
            tr = Traffic(f"http://127.0.0.1:{port}", client, 2, 1 << 20,
                         Sizes(doc_tokens=16, pressure_tokens=32))
            got = await items(tr)
        return [o for os_ in got for o in os_]


HTTPX_KINDS = ["completion", "chat", "stream", "malformed", "flush", "pressure", "slot"]


def test_fake_server_errors_are_5xx() -> None:
    out = asyncio.run(FakeServer(500, SHAPED.replace("400", "500")).run(HTTPX_KINDS))
    assert {o.kind for o in out} == set(HTTPX_KINDS)
    assert {o.verdict for o in out} == {SERVER_ERROR}, [(o.kind, o.verdict) for o in out]
    assert "5xx answer(s)" in failures(report(out))[0]


def test_fake_server_accepting_everything() -> None:
    """200 to everything: normal requests pass, garbage accepted does not, nothing is a 5xx."""
    out = asyncio.run(FakeServer(200, "{}").run([*HTTPX_KINDS, "abandon_early"]))
    verdicts = {(o.kind, o.variant.split()[0] if o.kind == "slot" else ""): o.verdict
                for o in out}
    assert verdicts[("malformed", "")] == UNEXPECTED
    for kind in ("completion", "chat", "stream", "flush", "pressure", "abandon_early"):
        assert verdicts[(kind, "")] == EXPECTED, kind
    for action in ("list", "save", "restore", "erase"):
        assert verdicts[("slot", action)] == EXPECTED, action
    assert failures(report(out)) == ["1 unexpected answer(s)"]


def test_slot_busy_after_every_client_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """A drained slot cycle finds a slot processing for nobody (a lost cancel): unexpected."""
    monkeypatch.setattr(soak_traffic, "DRAIN_IDLE_S", 0.3)
    busy = json.dumps([{"id": 0, "is_processing": True}, {"id": 1, "is_processing": False}])
    fake = FakeServer(200, "{}", slots=busy)
    out = asyncio.run(fake.send(lambda tr: asyncio.gather(
        soak_traffic._slot_cycle(tr, Item(0, "slot", 0), random.Random(0), drained=True))))
    drain = [o for o in out if o.variant == "drain"]
    assert len(drain) == 1 and drain[0].verdict == UNEXPECTED, drain
    assert drain[0].error == "slots [0] still processing 0.3 s after every client left"
    idle = FakeServer(200, "{}", slots=json.dumps([{"id": 0, "is_processing": False}]))
    out = asyncio.run(idle.send(lambda tr: asyncio.gather(
        soak_traffic._slot_cycle(tr, Item(0, "slot", 0), random.Random(0), drained=True))))
    assert {o.verdict for o in out} == {EXPECTED}


@pytest.mark.model
def test_short_soak_of_a_real_server(tmp_path: Path) -> None:
    """120 items at 8-way with the disk tier, small prompts: nothing unexpected, no 5xx, every
    slot idle at the end, the probe unchanged (cached == uncached too: deterministic mode),
    RSS within its budget; and every kind of traffic really ran."""
    soak_out = tmp_path / "soak"
    # one compute thread: on 2 shared cores, two would contend with the client (4x slower)
    rc = main(["soak", "--requests", "120", "--concurrency", "8", "--disk", "--seed", "1",
               "--out", str(soak_out), "--doc-tokens", "32", "--max-tokens", "8",
               "--pressure-tokens", "256", "--cache-ram", "4", "--cache-disk-mib", "2",
               "--", "-c", "2048", "-t", "1"])
    rep = json.loads((soak_out / "soak.json").read_text())
    assert rc == 0, (rep["failures"], rep["unexpected_failures"], rep["server_errors"])
    c = rep["counts"]
    assert rep["completed"] and rep["items_run"] == 120
    assert c[UNEXPECTED] == 0 and c[SERVER_ERROR] == 0 and c[EXPECTED] == c["requests"] > 120
    assert rep["final"]["idle"] and not any(s["is_processing"] for s in rep["final"]["slots"])
    p = rep["probe"]
    assert p["ok"] and p["unchanged"] and p["cached_equal"] and p["deterministic"]
    assert len(p["start"]["uncached"]) == 32 and p["end"]["cache_n"][-1] > 0
    assert rep["rss"]["within_budget"] and len(rep["rss"]["series"]) > 5
    assert (soak_out / "soak_rss.png").stat().st_size > 0
    assert set(c["per_kind"]) == set(KINDS)
    by = {(o[1], o[2], o[3]) for o in rep["outcomes"]}  # (kind, variant, status)
    for kind in ("abandon_stream", "abandon_early"):  # left mid-stream or before any byte
        assert c["per_kind"][kind]["client_left"] > 0, kind
    assert c["per_kind"]["abandon_early"]["client_left"] == c["per_kind"]["abandon_early"]["n"]
    assert c["zero_chunk_abandons"] > c["per_kind"]["abandon_early"]["n"]  # 0-event streams too
    assert {v for k, v, s in by if k == "oversized" and s == 413} == {"content-length",
                                                                      "chunked"}
    drained = {"save (drained)", "restore (drained)", "erase (drained)"}
    assert {v for k, v, s in by if k == "slot" and s == 200} >= drained
    assert ("flush", "", 200) in by and c["per_kind"]["malformed"][EXPECTED] > 5
    cache = rep["cache"]
    assert cache["ram_evictions"] > 0 and cache["disk_evictions"] > 0  # pressure evicted
