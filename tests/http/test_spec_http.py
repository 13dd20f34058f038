"""Speculative decoding served end to end on the default model: the answers equal a server's
without speculation token for token, `timings` report the drafts (`draft_n`,
`draft_n_accepted`), and /slots and /metrics show them as llama-server does."""

from __future__ import annotations

import httpx
import pytest

from radixserve.bench.scenarios import make_text
from tests.http.harness import running_server
from tests.http.test_host_cache import metrics

pytestmark = pytest.mark.model
N_PREDICT = 48


def prompts() -> list[str]:
    import random

    rng = random.Random(5)
    out = []
    for _ in range(2):
        text = make_text(rng, 50)
        out.append(f"Text: {text}\nThe same text, copied exactly: {text[:40]}")
    return out


def ask(url: str, prompt: str, **extra: object) -> dict:
    body = {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0, "ignore_eos": True,
            "return_tokens": True, **extra}
    r = httpx.post(url + "/completion", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[list[int]]:
    log = str(tmp_path_factory.mktemp("ref") / "server.log")
    with running_server(["-np", "2", "-c", "2048"], log) as srv:
        outs = [ask(srv.url, p) for p in prompts()]
    assert all("draft_n" not in o["timings"] for o in outs)
    return [o["tokens"] for o in outs]


@pytest.mark.parametrize("flags", [
    ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
     "--spec-ngram-simple-size-m", "16"],
    ["-md", "default", "--spec-draft-n-max", "4"],
], ids=["ngram-simple", "draft-self"])
def test_speculative_server(reference, tmp_path_factory, flags):
    log = str(tmp_path_factory.mktemp("spec") / "server.log")
    with running_server(["-np", "2", "-c", "2048", "--metrics", *flags], log) as srv:
        outs = [ask(srv.url, p) for p in prompts()]
        assert [o["tokens"] for o in outs] == reference
        drafted = sum(o["timings"]["draft_n"] for o in outs)
        accepted = sum(o["timings"]["draft_n_accepted"] for o in outs)
        assert 0 < accepted <= drafted
        if "-md" in flags:  # the model drafting for itself: every draft is right
            assert accepted == drafted
        m = metrics(srv.url)
        assert m["llamacpp:spec_decode_num_draft_tokens_total"] == drafted
        assert m["llamacpp:spec_decode_num_accepted_tokens_total"] == accepted
        assert m["llamacpp:spec_decode_num_drafts_total"] > 0
        slots = httpx.get(srv.url + "/slots", timeout=30).json()
        assert all(s["speculative"] for s in slots)
        used = [s for s in slots if "params" in s]
        kind = "draft-simple" if "-md" in flags else "ngram-simple"
        assert used and all(s["params"]["speculative.types"] == kind for s in used)
        # a request may turn speculation off: the same tokens, no drafts reported
        off = ask(srv.url, prompts()[0], **{"speculative.type": "none"})
        assert off["tokens"] == reference[0] and "draft_n" not in off["timings"]
        bad = httpx.post(srv.url + "/completion", json={"prompt": "x",
                                                        "speculative.type": "ngram-cache"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
