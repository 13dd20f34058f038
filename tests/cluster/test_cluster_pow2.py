"""The baseline the prefix router is measured against: Ray Serve's default power-of-two
choices (`--router pow2`). With no regard for prefixes it sends a document's questions to
both replicas, which both compute it: far more prompt tokens than one server, the same
replies.

This cluster also joins a Ray instance started beforehand (`ray start --head`, as on a
multi-node cluster's head) with `--address` and leaves it running on exit, and serves under
`--api-prefix` with `--api-key`: the cluster's own routes follow both, and a cache flush
reaches every replica."""

from __future__ import annotations

import os
import secrets
import subprocess
from typing import Any

import httpx
import pytest

from radixserve.server_proc import free_port
from tests.cluster.workload import (RAY, Answer, chat, cluster, documents, ray_stop, replicas,
                                    run_workload)

pytestmark = pytest.mark.model
KEY = {"Authorization": "Bearer k3y"}


def flush_and_check(url: str) -> dict[str, Any]:
    """/flush_cache empties both replicas' caches and the router's record; the prefix and
    key apply to every route the cluster adds."""
    with httpx.Client(timeout=120) as c:
        assert c.get(url + "/replicas").status_code == 401
        assert c.get(url + "/metrics").status_code == 401  # each replica checks the key
        assert c.get(url + "/replicas/1/health").json() == {"status": "ok"}  # public, as /health
        assert c.get(url.removesuffix("/p") + "/replicas", headers=KEY).status_code == 404
        def reused(question: str) -> list[int]:  # document 0 asked of each replica
            body = chat(documents()[0], question)
            return [c.post(f"{url}/replicas/{i}/v1/chat/completions", json=body,
                           headers=KEY).json()["timings"]["cache_n"] for i in range(2)]

        reused("Before the flush?")
        held = reused("Still there?")
        before = replicas(url, KEY)
        flushed = c.post(url + "/flush_cache", headers=KEY)
        assert flushed.status_code == 200, flushed.text
        assert flushed.json()["flushed"], flushed.text
        gone = reused("After the flush?")
        after = replicas(url, KEY)
    assert min(held) > 200, held  # both replicas held the document
    # each replica was sent documents (a replica Ray Serve replaced mid-run would show here as
    # an id no answer came from)
    assert all(r["index_blocks"] > 0 for r in before["replicas"]), before
    assert gone == [0, 0]  # neither kept it
    assert [r["index_blocks"] for r in after["replicas"]] == [0, 0]
    return before


def test_default_router_scatters_documents_and_recomputes_them(
        single_server_answers: list[Answer]) -> None:
    port = free_port()
    # a cluster with token authentication, as Ray 2.60 sets up by default: its clients (this
    # command) need the token too
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env = {**os.environ, **auth}
    head = subprocess.run([RAY, "start", "--head", "--port", str(port), "--num-cpus", "2",
                           "--include-dashboard=false", "--disable-usage-stats"],
                          capture_output=True, text=True, timeout=180, env=env)
    assert head.returncode == 0, head.stdout + head.stderr
    try:
        flags = ("--address", f"127.0.0.1:{port}", "--imbalance", "7",
                 "--max-ongoing-requests", "9", "--replica-cpus", "0.5",
                 "--api-prefix", "/p", "--api-key", "k3y")
        with cluster("pow2", "pow2", *flags, env=auth) as srv:
            got = run_workload(srv.url + "/p", KEY)
            info = flush_and_check(srv.url + "/p")
        # the command left the Ray instance it joined running
        status = subprocess.run([RAY, "status", "--address", f"127.0.0.1:{port}"],
                                capture_output=True, text=True, timeout=120, env=env)
        assert status.returncode == 0, status.stdout + status.stderr
    finally:
        ray_stop()
    assert [a.content for a in got] == [a.content for a in single_server_answers]
    assert info["policy"] == "pow2" and "prefix" not in info["decisions"]
    assert info["imbalance"] == 7
    assert [(r["max_ongoing_requests"], r["cpus"]) for r in info["replicas"]] == [(9, 0.5)] * 2
    homes: dict[int, set[str | None]] = {}
    for a in got:
        homes.setdefault(a.doc, set()).add(a.replica)
    assert sum(len(h) == 2 for h in homes.values()) >= 2, homes
    computed = sum(a.prompt_n for a in got)
    alone = sum(a.prompt_n for a in single_server_answers)
    assert computed >= 1.1 * alone, (computed, alone)  # a split document is recomputed
