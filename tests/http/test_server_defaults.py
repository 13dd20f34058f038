"""Server-wide request defaults from flags, on the real engine and the default model: -r stop
strings, --ignore-eos, -sp, and the sampling defaults (--temp ...) a request starts from."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi.testclient import TestClient

from radixserve.config import ServerConfig
from radixserve.engine.engine import Engine
from radixserve.http.app import create_app
from radixserve.model.loader import Model
from radixserve.sampling.chain import SamplingParams

pytestmark = pytest.mark.model

CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "temperature": 0}


@pytest.fixture(scope="module")
def model(default_f32: Model) -> Model:
    """The session's default model in f32 (tests/http/conftest.py): each test starts its own
    engine over it."""
    return default_f32


@contextmanager
def app(model: Model, **cfg: Any) -> Iterator[TestClient]:
    conf = ServerConfig(ctx_size=512, n_parallel=1, cache_ram_mib=0, **cfg)
    engine = Engine.boot(conf, lambda: model)
    try:
        yield TestClient(create_app(engine, conf))
    finally:
        engine.stop()


def test_reverse_prompts_are_default_stop_strings(model: Model) -> None:
    body = {"prompt": "The capital of France is", "n_predict": 16, "temperature": 0}
    with app(model) as c:
        free = c.post("/completion", json=body).json()
    words = free["content"].split()
    assert len(words) >= 3, free["content"]
    stop = words[2]
    with app(model, stop=[stop]) as c:
        cut = c.post("/completion", json=body).json()
        own = c.post("/completion", json={**body, "stop": ["zzz-never"]}).json()
    assert cut["stop_type"] == "word" and cut["stopping_word"] == stop
    assert cut["content"] == free["content"][: free["content"].index(stop)]
    assert own["content"] == free["content"]  # a request's own stop strings replace -r's


def test_ignore_eos_and_special_defaults(model: Model) -> None:
    with app(model) as c:
        plain = c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 64}).json()
    assert plain["choices"][0]["finish_reason"] == "stop"
    n = plain["usage"]["completion_tokens"]
    assert n < 60
    with app(model, ignore_eos=True) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "max_tokens": n + 8}).json()
        own = c.post("/v1/chat/completions",
                     json={**CHAT, "max_tokens": n + 8, "ignore_eos": False}).json()
    assert r["usage"]["completion_tokens"] == n + 8  # generated through the end-of-turn
    assert "<|im_end|>" not in r["choices"][0]["message"]["content"]
    assert own["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    # -sp: control tokens are rendered in the text (forced here with a logit bias)
    im_start = model.tokenizer.encode("<|im_start|>", add_special=False, parse_special=True)
    assert len(im_start) == 1
    body = {"prompt": "Hi", "n_predict": 2, "temperature": 0, "return_tokens": True,
            "logit_bias": [[im_start[0], 100]]}
    with app(model) as c:
        hidden = c.post("/completion", json=body).json()
    with app(model, special=True) as c:
        shown = c.post("/completion", json=body).json()
    assert hidden["tokens"] == shown["tokens"] == im_start * 2
    assert (hidden["content"], shown["content"]) == ("", "<|im_start|>" * 2)


def test_sampling_defaults_come_from_the_flags(model: Model) -> None:
    body = {"prompt": "Once upon a time", "n_predict": 12}
    with app(model, sampling=SamplingParams(temperature=0.0)) as c:
        greedy_default = c.post("/completion", json=body).json()
        props = c.get("/props").json()["default_generation_settings"]["params"]
    with app(model) as c:
        greedy = c.post("/completion", json={**body, "temperature": 0}).json()
    assert greedy_default["content"] == greedy["content"]
    assert greedy_default["generation_settings"]["temperature"] == 0.0
    assert props["temperature"] == 0.0


def test_timings_per_token(model: Model) -> None:
    body = {"prompt": "Once upon a time", "n_predict": 6, "temperature": 0, "stream": True}
    with app(model) as c:
        with_t = c.post("/completion", json={**body, "timings_per_token": True}).text
        without = c.post("/completion", json=body).text
    chunks = [json.loads(line[6:]) for line in with_t.splitlines() if line.startswith("data: ")]
    partial = [ch for ch in chunks if not ch["stop"]]
    assert partial and all("timings" in ch for ch in partial)
    counts = [ch["timings"]["predicted_n"] for ch in partial]
    assert counts == sorted(counts) and counts[-1] >= len(partial)
    plain = [json.loads(line[6:]) for line in without.splitlines() if line.startswith("data: ")]
    assert not any("timings" in ch for ch in plain if not ch["stop"])
