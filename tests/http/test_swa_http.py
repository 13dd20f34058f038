"""Gemma 3 270M (sliding window 512) served end to end: conversations longer than the window,
then a rewind of two of them to an early point of their first prompt (the slot's window has
left it: only a context checkpoint or a host tier has it), slots lost to other conversations
(host tiers), a slot file saved and restored - every answer equals a no-cache server's token
for token, and /slots and /metrics show the checkpoints."""

from __future__ import annotations

import random

import httpx
import pytest

from radixserve.model.default_model import gemma3_model_path
from tests.http.harness import running_server
from tests.http.test_host_cache import complete, metrics

pytestmark = pytest.mark.model
N_PREDICT = 8


@pytest.fixture(scope="module")
def gemma() -> str:
    return gemma3_model_path()


FIRST = (560, 600, 640)  # first prompts; a rewind keeps their first REWIND tokens
REWIND = 100


def schedule() -> list[tuple[int, list[int], bool]]:
    """(conversation, new tokens, rewind) in order: 2 turns of 3 conversations, then
    conversations 0 and 2 rewound to their first REWIND tokens plus new ones."""
    rng = random.Random(16)

    def toks(n: int) -> list[int]:
        return [rng.randrange(1000, 200000) for _ in range(n)]

    steps = [(c, toks(FIRST[c]), False) for c in range(3)]
    steps += [(c, toks(60), False) for c in range(3)]
    return steps + [(0, toks(30), True), (2, toks(30), True)]


def run(url: str, cache_prompt: bool = True) -> list[dict]:
    history: dict[int, list[int]] = {}
    out = []
    for conv, new, rewind in schedule():
        if rewind:
            prompt = history[conv][:REWIND] + new
        else:
            prompt = history.get(conv, []) + new
        res = complete(url, prompt, N_PREDICT, cache_prompt, timeout=900)
        history[conv] = prompt + res["tokens"]
        out.append(res)
    return out


@pytest.fixture(scope="module")
def reference(gemma, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("ref") / "server.log")
    with running_server(["-m", gemma, "-np", "2", "-c", "4096", "--cache-ram", "0"],
                        log) as srv:
        return run(srv.url, cache_prompt=False)


@pytest.mark.parametrize("tier,extra", [
    ("slot", ["--cache-ram", "0", "-np", "3"]),
    ("legacy", ["--cache-radix-prompt", "off"]),
    ("radix", []),
])
def test_gemma3_cached_equals_uncached(gemma, tmp_path, reference, tier, extra):
    args = ["-m", gemma, "-np", "2", "-c", "4096", "--metrics", *extra]
    with running_server(args, str(tmp_path / "server.log")) as srv:
        got = run(srv.url)
        m = metrics(srv.url)
        slots = httpx.get(srv.url + "/slots", timeout=60).json()
        props = httpx.get(srv.url + "/props", timeout=60).json()
    assert [r["tokens"] for r in got] == [r["tokens"] for r in reference]
    assert props["deterministic"] is True
    cache_n = [r["timings"]["cache_n"] for r in got]
    assert cache_n[:3] == [0, 0, 0]
    assert all(n > 500 for n in cache_n[3:6]), cache_n  # every later turn reused its history
    assert m["radixserve:checkpoints_created_total"] >= 6
    assert sum(s.get("n_checkpoints", 0) for s in slots) == m["radixserve:checkpoints"] > 0
    if tier == "slot":
        # the rewinds came back through checkpoints taken n_ubatch + 4 (516) tokens before the
        # end of each first prompt: at 44 for conversation 0 (so 44 reused), at 124 for 2 (so
        # all 100 common tokens reused)
        assert m["radixserve:checkpoints_restored_total"] == 2
        assert cache_n[6:] == [FIRST[0] - 516, REWIND]
    elif tier == "radix":  # the tree kept every layer of the first prompts
        assert cache_n[6:] == [REWIND, REWIND]


def test_gemma3_slot_file_round_trip(gemma, tmp_path, reference):
    save = tmp_path / "slots"
    save.mkdir()
    args = ["-m", gemma, "-np", "3", "-c", "4096", "--cache-ram", "0", "--metrics",
            "--slot-save-path", str(save)]
    with running_server(args, str(tmp_path / "server.log")) as srv:
        got = run(srv.url)
        slot0 = next(s for s in httpx.get(srv.url + "/slots", timeout=60).json()
                     if s.get("n_checkpoints"))
        sid = slot0["id"]
        r = httpx.post(f"{srv.url}/slots/{sid}?action=save", json={"filename": "s.bin"},
                       timeout=60)
        assert r.status_code == 200, r.text
        n_saved = r.json()["n_saved"]
        erase = httpx.post(f"{srv.url}/slots/{sid}?action=erase", timeout=60)
        assert erase.status_code == 200
        r = httpx.post(f"{srv.url}/slots/{sid}?action=restore", json={"filename": "s.bin"},
                       timeout=60)
        assert r.status_code == 200 and r.json()["n_restored"] == n_saved
        after = next(s for s in httpx.get(srv.url + "/slots", timeout=60).json()
                     if s["id"] == sid)
    assert [r["tokens"] for r in got] == [r["tokens"] for r in reference]
    assert after["n_checkpoints"] == slot0["n_checkpoints"] > 0
    assert after["checkpoint_bytes"] == slot0["checkpoint_bytes"]
