"""Clients that leave cost nothing after they left: a real server on the default model, hundreds
of requests whose clients hang up at random moments from 0 ms on (streamed and not, completion
and chat), sent while a long prompt keeps the engine busy in prefill steps (so Submits and
their Cancels pile up in the engine's queue together: the case where a cancel was lost because
the task's id was not assigned yet). Afterwards every slot is idle, nothing waits, no token is
decoded for anyone, and a request sent before and after the storm answers the same."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from radixserve.bench.scenarios import make_text
from tests.http.harness import running_server
from tests.http.test_host_cache import parse_metrics

pytestmark = pytest.mark.model

N_REQUESTS = 240
N_CLIENTS = 16
N_PREDICT = 1500  # an orphan would decode this long: minutes for the whole storm's orphans
ARGS = ["-np", "4", "-c", "8192", "--metrics"]


def raw_request(port: int, path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
            ).encode() + data


def hang_up_after(port: int, payload: bytes, delay_s: float) -> None:
    """Send a whole request, wait `delay_s` (0: not at all), then close without reading."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(payload)
        if delay_s > 0:
            time.sleep(delay_s)


def server_state(url: str) -> tuple[list[bool], dict[str, float]]:
    busy = [s["is_processing"] for s in httpx.get(url + "/slots", timeout=60).json()]
    return busy, parse_metrics(httpx.get(url + "/metrics", timeout=60).text)


def control(url: str) -> list[int]:
    body = {"prompt": "The three primary colors are", "n_predict": 24, "temperature": 0,
            "ignore_eos": True, "return_tokens": True, "cache_prompt": False}
    r = httpx.post(url + "/completion", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_clients_leaving_at_random_moments_leave_every_slot_idle() -> None:
    rng = random.Random(34)
    with running_server(ARGS) as srv:
        before = control(srv.url)
        long_doc = make_text(rng, 2600)  # prefill steps of --batch-size tokens while they leave
        busy_body = {"prompt": long_doc, "n_predict": 4, "temperature": 0, "cache_prompt": False}
        plans = []
        for i in range(N_REQUESTS):
            stream = rng.random() < 0.6
            text = make_text(rng, rng.randint(8, 120))
            if rng.random() < 0.5:
                path, body = "/completion", {"prompt": text}
            else:
                path, body = "/v1/chat/completions", {"messages": [
                    {"role": "user", "content": text}]}
            body |= {"n_predict": N_PREDICT, "max_tokens": N_PREDICT, "ignore_eos": True,
                     "stream": stream, "temperature": 0.8, "seed": i}
            delay = 0.0 if rng.random() < 0.3 else rng.uniform(0.0, 0.4)
            plans.append((raw_request(srv.port, path, body), delay))

        busy = threading.Thread(target=lambda: httpx.post(srv.url + "/completion",
                                                          json=busy_body, timeout=600))
        busy.start()
        time.sleep(0.2)  # the long prompt is being prefilled
        with ThreadPoolExecutor(N_CLIENTS) as ex:
            list(ex.map(lambda p: hang_up_after(srv.port, *p), plans))
        busy.join()

        deadline = time.monotonic() + 30  # a few steps; an orphan would decode for minutes
        while True:
            slots_busy, m = server_state(srv.url)
            idle = not any(slots_busy) and m["llamacpp:requests_processing"] == 0 \
                and m["llamacpp:requests_deferred"] == 0
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert idle, (slots_busy, m["llamacpp:requests_processing"],
                      m["llamacpp:requests_deferred"])
        time.sleep(1.0)
        _, m2 = server_state(srv.url)
        assert m2["llamacpp:tokens_predicted_total"] == m["llamacpp:tokens_predicted_total"]
        assert m2["llamacpp:n_decode_total"] == m["llamacpp:n_decode_total"]
        # the clients left long before N_PREDICT tokens: nobody decoded to the end
        assert m["llamacpp:tokens_predicted_total"] < N_PREDICT * 4
        assert control(srv.url) == before
