"""The disk tier over HTTP, real servers on the default model: two servers on one directory,
serving at the same time, restore each other's prefixes; a restarted server restores what the
earlier process wrote; every answer equals a no-cache server's; the flush is behind the API key
and empties the directory; /metrics has the per-tier figures."""

from __future__ import annotations

import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from radixserve.bench.scenarios import make_text
from radixserve.memory.tiers.disk_block import SUFFIX
from radixserve.memory.tiers.prefix import common_prefix
from tests.http.harness import running_server
from tests.http.test_host_cache import parse_metrics

B = 32
BASE = ["-np", "2", "-c", "4096", "--metrics", "--deterministic", "on"]
KEY = "tenant-admin-key"


def docs_and_questions() -> list[str]:
    rng = random.Random(11)
    out = []
    for _ in range(2):
        doc = make_text(rng, 320)
        out += [f"{doc}\n\nQuestion: what is this about?\nAnswer:",
                f"{doc}\n\nQuestion: give it a title.\nAnswer:"]
    return out


def complete(url: str, prompt: str, headers: dict | None = None, **kw) -> dict:
    body = {"prompt": prompt, "n_predict": 8, "temperature": 0, "ignore_eos": True,
            "return_tokens": True, **kw}
    r = httpx.post(url + "/completion", json=body, headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def tokens(url: str, text: str, headers: dict | None = None) -> list[int]:
    r = httpx.post(url + "/tokenize", json={"content": text, "add_special": True},
                   headers=headers, timeout=60)
    return r.json()["tokens"]


def disk_figures(url: str, headers: dict | None = None) -> dict[str, float]:
    m = parse_metrics(httpx.get(url + "/metrics", headers=headers, timeout=60).text)
    out = {}
    for k, v in m.items():
        if k.startswith("radixserve:cache_tier_") and 'tier="disk"' in k:
            out[k.split("{")[0].removeprefix("radixserve:cache_tier_")] = v
    return out


def wait_written(url: str, n_blocks: int, headers: dict | None = None) -> None:
    """Writes are in the background: wait until this server wrote `n_blocks` blocks."""
    deadline = time.monotonic() + 60
    while disk_figures(url, headers).get("writes_total", 0) < n_blocks:
        assert time.monotonic() < deadline, disk_figures(url, headers)
        time.sleep(0.2)


def expected_reuse(url: str, first: str, prompt: str) -> int:
    a, b = tokens(url, first), tokens(url, prompt)
    return min(common_prefix(a, b), len(b) - 1) // B * B


def n_files(d) -> int:
    """Block files under `d` (not the weights digest kept beside them)."""
    return sum(f.endswith(SUFFIX) for _, _, fs in os.walk(d) for f in fs)


def test_two_servers_share_a_directory_and_a_restart_reuses_it(tmp_path):
    p = docs_and_questions()
    with running_server([*BASE, "--cache-ram", "0"], str(tmp_path / "ref.log")) as ref:
        expect = [complete(ref.url, q, cache_prompt=False)["tokens"] for q in p]
    disk = ["--cache-disk", str(tmp_path / "kv"), "--cache-disk-block", str(B)]
    with running_server([*BASE, *disk], str(tmp_path / "a.log")) as a, \
            running_server([*BASE, *disk], str(tmp_path / "b.log")) as b:
        with ThreadPoolExecutor(2) as pool:  # both serve at once, each a different document
            r0, r2 = pool.map(lambda args: complete(*args), [(a.url, p[0]), (b.url, p[2])])
        assert (r0["tokens"], r2["tokens"]) == (expect[0], expect[2])
        assert r0["timings"]["cache_n"] == r2["timings"]["cache_n"] == 0
        wait_written(a.url, len(tokens(a.url, p[0])) // B)
        wait_written(b.url, len(tokens(b.url, p[2])) // B)
        with ThreadPoolExecutor(2) as pool:  # each now asks about the other's document
            r1, r3 = pool.map(lambda args: complete(*args), [(b.url, p[1]), (a.url, p[3])])
        assert (r1["tokens"], r3["tokens"]) == (expect[1], expect[3])
        assert r1["timings"]["cache_n"] == expected_reuse(b.url, p[0], p[1]) > 250
        assert r3["timings"]["cache_n"] == expected_reuse(a.url, p[2], p[3]) > 250
        for srv in (a, b):
            fig = disk_figures(srv.url)
            assert fig["hits_total"] == 1 and fig["bad_files_total"] == 0
            assert fig["tokens"] >= 320 + 256  # its own document's and the blocks it read
            per_token = fig["bytes"] / fig["tokens"]  # every layer's K and V, bf16, + headers
            assert 30 * 2 * 3 * 64 * 2 < per_token < 30 * 2 * 3 * 64 * 2 * 1.05
    on_disk = n_files(tmp_path / "kv")
    assert on_disk >= 2 * 320 // B  # two documents (the questions add a block or none)
    guarded = [*BASE, *disk, "--api-key", KEY]
    auth = {"Authorization": f"Bearer {KEY}"}
    with running_server(guarded, str(tmp_path / "a2.log")) as a2:  # a restart
        again = [complete(a2.url, q, auth) for q in (p[0], p[3])]
        assert [r["tokens"] for r in again] == [expect[0], expect[3]]
        n0 = len(tokens(a2.url, p[0], auth))
        assert again[0]["timings"]["cache_n"] == (n0 - 1) // B * B
        assert again[1]["timings"]["cache_n"] > 250
        ram = parse_metrics(httpx.get(a2.url + "/metrics", headers=auth).text)
        assert ram['radixserve:cache_tier_bytes{tier="ram"}'] > 0
        # the page's cache view shows the same tiers (GET /cache)
        view = httpx.get(a2.url + "/cache", headers=auth, timeout=60).json()
        assert view["ram"]["bytes"] == ram['radixserve:cache_tier_bytes{tier="ram"}']
        assert view["disk"]["bytes"] == ram['radixserve:cache_tier_bytes{tier="disk"}'] > 0
        assert view["disk"]["hits"] == ram['radixserve:cache_tier_hits_total{tier="disk"}'] >= 2
        assert view["disk"]["tokens"] == ram['radixserve:cache_tier_tokens{tier="disk"}'] > 0
        assert httpx.post(a2.url + "/flush_cache").status_code == 401
        r = httpx.post(a2.url + "/flush_cache", headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        flushed = r.json()["flushed"]
        assert flushed["disk_files"] == on_disk and flushed["ram_bytes"] > 0
        assert n_files(tmp_path / "kv") == 0
        ram = parse_metrics(httpx.get(a2.url + "/metrics", headers=auth).text)
        assert ram['radixserve:cache_tier_bytes{tier="ram"}'] == 0
        assert ram['radixserve:cache_tier_bytes{tier="disk"}'] == 0
        after = complete(a2.url, p[0], auth)  # nothing left in any tier
        assert after["timings"]["cache_n"] == 0 and after["tokens"] == expect[0]
        r = httpx.post(a2.url + "/reset_prefix_cache", headers=auth, timeout=60)
        assert r.status_code == 200 and "flushed" in r.json()
