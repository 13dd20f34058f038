"""The shared-prefix workload the cluster tests run, and the clusters they run it on.

Six documents, four questions each, asked one at a time and interleaved (d0 q0, d1 q0, ...,
d5 q0, d0 q1, ...), as chat completions; greedy, batch-invariant (`--deterministic on`) and one
thread per server, so every party's replies must be the same tokens.
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from radixserve.bench.scenarios import make_text
from radixserve.server_proc import ServerProcess

N_DOCS, N_QUESTIONS = 6, 4
# per server (each replica): 2 slots of 2048; one thread, so a lone server and a replica
# compute alike
SERVER_ARGS = ["-c", "4096", "-np", "2", "--metrics", "--deterministic", "on", "-t", "1"]
LOGS = Path("test-output/cluster")


def documents() -> list[str]:
    rng = random.Random(2020)
    return ["Answer from this document.\n\n" + make_text(rng, 220) for _ in range(N_DOCS)]


def chat(doc: str, question: str, n_predict: int = 4, **extra: object) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": doc}, {"role": "user", "content": question}],
            "max_tokens": n_predict, "temperature": 0, **extra}


def requests() -> list[tuple[int, dict[str, object]]]:
    rng = random.Random(7)
    qs = [[f"question {q}: " + make_text(rng, 10) + "?" for q in range(N_QUESTIONS)]
          for _ in range(N_DOCS)]
    docs = documents()
    return [(d, chat(docs[d], qs[d][q])) for q in range(N_QUESTIONS) for d in range(N_DOCS)]


@dataclass
class Answer:
    doc: int
    content: str
    prompt_n: int  # prompt tokens computed
    cache_n: int
    replica: str | None


def run_workload(url: str, headers: dict[str, str] | None = None) -> list[Answer]:
    out = []
    with httpx.Client(timeout=120, headers=headers) as c:
        for doc, body in requests():
            r = c.post(url + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            j = r.json()
            out.append(Answer(doc, j["choices"][0]["message"]["content"],
                              j["timings"]["prompt_n"], j["timings"]["cache_n"],
                              r.headers.get("x-radixserve-replica")))
    return out


RAY = str(Path(sys.executable).with_name("ray"))


def ray_stop() -> None:
    subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)


@contextlib.contextmanager
def cluster(router: str, name: str, *flags: str,
            env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """`radixserve cluster --replicas 2` (on a local Ray instance unless `flags` give
    --address), stopped after."""
    LOGS.mkdir(parents=True, exist_ok=True)
    prefix = flags[flags.index("--api-prefix") + 1] if "--api-prefix" in flags else ""
    srv = ServerProcess(SERVER_ARGS, LOGS / f"{name}.log", ready_timeout_s=240,
                        command=("cluster", "--replicas", "2", "--router", router, *flags),
                        ready_path=prefix + "/health", env=env)
    try:
        srv.__enter__()  # ready: every replica is up (the command says "listening on" then)
        yield srv
    finally:
        if not srv.stop():  # it had to be killed: its local Ray instance may be left
            ray_stop()


def replicas(url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    r = httpx.get(url + "/replicas", timeout=60, headers=headers)
    assert r.status_code == 200, r.text
    return json.loads(r.text)
