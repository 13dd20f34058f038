"""Router mode with real processes: a router over a models dir holding the default model
(SmolLM2) and Gemma 3 270M routes requests to one child server per model, and each answer
equals what a plain single-model server gives for the same request at temperature 0.

Also: each model's prompt cache survives requests to the other, unloading ends the child and
frees its memory (measured), a client that leaves a stream closes the child's request, a child
that dies or a model that cannot load shows as failed while the router stays up, llama-server's
errors for bad requests, a preset with --models-max 1 and autoload off. The figures (memory
before/after unload, first-token times after load, after autoload and warm) are printed
(`-s` shows them).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from radixserve.model.default_model import default_model_path, gemma3_model_path
from tests.http.harness import ServerProcess
from tests.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.model

COMMON = ["-c", "2048", "-np", "2"]
MODELS = ("smollm2", "gemma3")
COMPLETION = {"prompt": "The capital of France is", "n_predict": 12, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 12,
        "temperature": 0}
MIB = 1 << 20
FIGURES = Path(os.environ.get("RADIXSERVE_TEST_OUTPUT", "test-output")) / "router" / "figures.json"


def record(**figures: Any) -> None:
    """Keep measured figures in test-output/router/figures.json (xdist hides prints)."""
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    FIGURES.write_text(json.dumps({**old, **figures}, indent=1) + "\n")


def _paths() -> dict[str, str]:
    try:
        return {"smollm2": default_model_path(), "gemma3": gemma3_model_path()}
    except FileNotFoundError as e:
        pytest.fail(f"a test model is missing: {e}")


def _sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def answers(url: str, model: str | None) -> dict[str, str]:
    """The three requests' texts: /completion, /v1/chat/completions, and the same streamed."""
    extra = {"model": model} if model else {}
    out: dict[str, str] = {}
    with httpx.Client(base_url=url, timeout=600) as c:
        r = c.post("/completion", json={**COMPLETION, **extra})
        assert r.status_code == 200, r.text
        out["completion"] = r.json()["content"]
        r = c.post("/v1/chat/completions", json={**CHAT, **extra})
        assert r.status_code == 200, r.text
        out["chat"] = r.json()["choices"][0]["message"]["content"]
        text = ""
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, **extra, "stream": True}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            for ev in _sse(r.iter_lines()):
                if ev["choices"]:
                    text += ev["choices"][0]["delta"].get("content") or ""
        out["chat_stream"] = text
    return out


def first_token_s(url: str, model: str, content: str) -> float:
    """Seconds from sending a streamed chat request to its first content token."""
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=600) as c, c.stream(
            "POST", "/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": content}],
                "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for ev in _sse(r.iter_lines()):
            if ev["choices"] and ev["choices"][0]["delta"].get("content"):
                return time.perf_counter() - t0
    raise AssertionError("no content token")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("models")
    for name, path in _paths().items():
        os.symlink(path, d / f"{name}.gguf")
    (d / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 64)  # a file that is no model
    return d


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """Each model's answers from a plain single-model server; both servers load at once (the
    small model's load hides under Gemma 3's), then answer one at a time."""
    from concurrent.futures import ThreadPoolExecutor
    logs = tmp_path_factory.mktemp("plain")
    with ExitStack() as stack:
        def start(name: str, path: str) -> ServerProcess:
            return stack.enter_context(ServerProcess([*COMMON, "-m", path],
                                                     logs / f"{name}.log", ready_timeout_s=300))

        with ThreadPoolExecutor(2) as pool:
            servers = {name: pool.submit(start, name, path) for name, path in _paths().items()}
        return {name: answers(srv.result().url, None) for name, srv in servers.items()}


@pytest.fixture(scope="module")
def router(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("router") / "router.log"
    with ServerProcess(["--models-dir", str(models_dir), *COMMON], log) as srv:
        yield srv
    assert not psutil.pid_exists(srv.pid) or psutil.Process(srv.pid).status() == "zombie"


def status(url: str, model: str) -> dict[str, Any]:
    r = httpx.get(url + "/models", timeout=30)
    assert r.status_code == 200
    by_id = {m["id"]: m for m in r.json()["data"]}
    return by_id[model]["status"]


def wait_status(url: str, model: str, value: str, timeout_s: float = 300) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = status(url, model)
        if st["value"] == value:
            return st
        time.sleep(0.1)
    raise AssertionError(f"{model} did not become {value}: {st}")


def children(pid: int) -> dict[int, int]:
    """{pid: RSS bytes} of a router's child servers."""
    out = {}
    for p in psutil.Process(pid).children(recursive=True):
        try:
            out[p.pid] = p.memory_info().rss
        except psutil.Error:
            pass
    return out


def child_pid(url: str, model: str) -> int:
    args = status(url, model)["args"]
    port = args[args.index("--port") + 1]
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "--port" in cmd and cmd[cmd.index("--port") + 1] == port and "-m" in cmd:
            return int(p.info["pid"])
    raise AssertionError(f"no child process for {model}")


def test_lists_every_model_unloaded(router: ServerProcess, models_dir: Path) -> None:
    for path in ("/models", "/v1/models"):
        r = httpx.get(router.url + path)
        assert r.status_code == 200 and r.json()["object"] == "list"
        data = {m["id"]: m for m in r.json()["data"]}
        assert set(data) == {"smollm2", "gemma3", "broken"}
        for name in MODELS:
            m = data[name]
            assert m["status"] == {"value": "unloaded"} and m["source"] == "models_dir"
            assert m["path"] == str(models_dir / f"{name}.gguf") and m["object"] == "model"
    props = httpx.get(router.url + "/props").json()
    assert (props["role"], props["max_instances"], props["models_autoload"]) == (
        "router", 4, True)
    assert httpx.get(router.url + "/health").json() == {"status": "ok"}
    assert children(router.pid) == {}


def test_bad_requests_get_llama_server_errors(router: ServerProcess) -> None:
    def err(r: httpx.Response) -> tuple[int, str, str]:
        e = r.json()["error"]
        return r.status_code, e["type"], e["message"]

    u = router.url
    inv = "invalid_request_error"
    assert err(httpx.post(u + "/completion", json={"prompt": "x"})) == (
        400, inv, "model name is missing from the request")
    assert err(httpx.post(u + "/v1/chat/completions", json={"model": "nope", "messages": []})) \
        == (400, inv, "model 'nope' not found")
    assert err(httpx.post(u + "/completion", json={"model": 7, "prompt": "x"}))[2] == \
        "model name is missing from the request"
    assert err(httpx.get(u + "/slots"))[2] == "model name is missing from the request"
    assert err(httpx.get(u + "/metrics?model=nope"))[2] == "model 'nope' not found"
    assert err(httpx.post(u + "/models/load", json={"model": "nope"})) == (
        404, "not_found_error", "model is not found")
    assert err(httpx.post(u + "/models/unload", json={"model": "nope"})) == (
        400, inv, "model is not found")
    assert err(httpx.post(u + "/models/unload", json={"model": "gemma3"})) == (
        400, inv, "model is not running")
    r = httpx.post(u + "/completion", content=b"{not json")
    assert r.status_code == 400 and "Invalid JSON" in r.json()["error"]["message"]
    assert httpx.get(u + "/health").status_code == 200


def test_load_route_and_answers_equal_a_plain_server(
        router: ServerProcess, plain: dict[str, dict[str, str]]) -> None:
    u = router.url
    r = httpx.post(u + "/models/load", json={"model": "smollm2"})
    assert r.status_code == 200 and r.json() == {"success": True}
    assert status(u, "smollm2")["value"] in ("loading", "loaded")
    r = httpx.post(u + "/models/load", json={"model": "smollm2"})
    assert r.json()["error"]["message"] == "model is already running"
    st = wait_status(u, "smollm2", "loaded")
    assert st["args"][-4:] == ["-m", st["args"][st["args"].index("-m") + 1], "--alias",
                               "smollm2"]
    assert st["args"][st["args"].index("--port") + 2:][:4] == COMMON
    ttft_loaded = first_token_s(u, "smollm2", "Tell me a story.")
    ttft_warm = first_token_s(u, "smollm2", "Tell me a joke.")
    # gemma3 is not loaded: the request loads it (autoload) and waits
    ttft_autoload = first_token_s(u, "gemma3", "Tell me a story.")
    ttft_warm_g = first_token_s(u, "gemma3", "Tell me a joke.")
    print(f"\nfirst token: smollm2 first request after /models/load {ttft_loaded * 1000:.0f} ms,"
          f" warm {ttft_warm * 1000:.0f} ms; gemma3 first request with autoload (load "
          f"included) {ttft_autoload:.2f} s, warm {ttft_warm_g * 1000:.0f} ms")
    record(ttft_ms={"smollm2_after_load": ttft_loaded * 1000, "smollm2_warm": ttft_warm * 1000,
                    "gemma3_autoload_incl_load": ttft_autoload * 1000,
                    "gemma3_warm": ttft_warm_g * 1000})
    assert ttft_autoload > ttft_warm_g
    for name in MODELS:
        got = answers(u, name)
        assert got == plain[name], name
        assert got["chat"] == got["chat_stream"]
    listing = {m["id"]: m for m in httpx.get(u + "/v1/models").json()["data"]}
    for name in MODELS:  # the child's own /v1/models details, merged in
        assert listing[name]["status"]["value"] == "loaded"
        assert "meta" in listing[name] and listing[name]["owned_by"] == "llamacpp"
    # GET routes go by ?model=
    slots = httpx.get(u + "/slots", params={"model": "gemma3"})
    assert slots.status_code == 200 and len(slots.json()) == 2
    props = httpx.get(u + "/props", params={"model": "smollm2"}).json()
    assert props["model_alias"] == "smollm2"


def test_each_models_prompt_cache_survives_the_other(router: ServerProcess) -> None:
    u = router.url
    body = {"prompt": "A list of the planets of the solar system, in order:", "n_predict": 4,
            "temperature": 0}

    def timings(model: str) -> dict[str, Any]:
        r = httpx.post(u + "/completion", json={**body, "model": model}, timeout=300)
        assert r.status_code == 200 and r.json()["model"] == model
        return r.json()["timings"]

    first = {m: timings(m) for m in MODELS}
    n_prompt = {m: first[m]["cache_n"] + first[m]["prompt_n"] for m in MODELS}
    for m in MODELS:  # new text (at most the BOS came from an earlier prompt)
        assert first[m]["prompt_n"] > 5 and first[m]["cache_n"] <= 1
    for a, b in (("smollm2", "gemma3"), ("gemma3", "smollm2")):
        other = httpx.post(u + "/v1/chat/completions", json={**CHAT, "model": b}, timeout=300)
        assert other.status_code == 200
        again = timings(a)
        # every prompt token but the last (which is computed for its logits) comes from cache
        assert (again["cache_n"], again["prompt_n"]) == (n_prompt[a] - 1, 1), a


def test_client_disconnect_closes_the_childs_request(router: ServerProcess) -> None:
    u = router.url
    with httpx.Client(base_url=u, timeout=300) as c, c.stream(
            "POST", "/v1/chat/completions", json={
                **CHAT, "model": "smollm2", "max_tokens": 2000, "stream": True,
                "ignore_eos": True}) as r:
        for ev in _sse(r.iter_lines()):
            if ev["choices"] and ev["choices"][0]["delta"].get("content"):
                break  # leave after the first token
    # 1,000 more tokens (the slot's context) would take the child over 10 s on 2 cores
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        slots = httpx.get(u + "/slots", params={"model": "smollm2"}).json()
        if not any(s["is_processing"] for s in slots):
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the child kept generating for a client that left")


def test_unload_ends_the_child_and_frees_its_memory(router: ServerProcess) -> None:
    u = router.url
    before = children(router.pid)
    pid = child_pid(u, "gemma3")
    assert pid in before and len(before) == 2
    r = httpx.post(u + "/models/unload", json={"model": "gemma3"}, timeout=60)
    assert r.status_code == 200 and r.json() == {"success": True}
    assert status(u, "gemma3")["value"] == "unloaded"
    assert not psutil.pid_exists(pid)
    after = children(router.pid)
    assert set(after) == set(before) - {pid}
    freed = sum(before.values()) - sum(after.values())
    print(f"\nchildren RSS: {sum(before.values()) / MIB:.0f} MiB with both models loaded, "
          f"{sum(after.values()) / MIB:.0f} MiB after unloading gemma3 (freed "
          f"{freed / MIB:.0f} MiB; its child had {before[pid] / MIB:.0f} MiB)")
    record(children_rss_mib={"both_loaded": sum(before.values()) / MIB,
                             "after_unloading_gemma3": sum(after.values()) / MIB,
                             "gemma3_child": before[pid] / MIB, "freed": freed / MIB})
    assert freed >= before[pid] * 0.95  # the other child may have grown a little
    assert status(u, "smollm2")["value"] == "loaded"


def test_a_child_that_dies_and_a_model_that_cannot_load(router: ServerProcess) -> None:
    u = router.url
    pid = child_pid(u, "smollm2")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while status(u, "smollm2").get("failed") is not True and time.monotonic() < deadline:
        time.sleep(0.1)
    st = status(u, "smollm2")
    assert (st["value"], st["failed"], st["exit_code"]) == ("unloaded", True, -9)
    assert "signal 9" in st["reason"]
    # the next request loads it again
    r = httpx.post(u + "/completion", json={**COMPLETION, "model": "smollm2"}, timeout=300)
    assert r.status_code == 200 and status(u, "smollm2") == {
        "value": "loaded", "args": status(u, "smollm2")["args"]}
    # a file that is no model: the request fails with the reason, the router stays up
    r = httpx.post(u + "/completion", json={**COMPLETION, "model": "broken"}, timeout=300)
    assert r.status_code == 500
    assert r.json()["error"]["message"].startswith("model name=broken failed to load: ")
    st = status(u, "broken")
    assert (st["value"], st["failed"], st["exit_code"]) == ("unloaded", True, 1)
    assert st["reason"] and st["reason"] in r.json()["error"]["message"]
    assert httpx.get(u + "/health").status_code == 200
    r = httpx.post(u + "/completion", json={**COMPLETION, "model": "smollm2"}, timeout=300)
    assert r.status_code == 200


def test_preset_models_max_1_and_no_autoload(tmp_path: Path) -> None:
    """The second model is a tiny test GGUF (its identity plays no part here: what is tested
    is the preset reaching each child and --models-max evicting; a second Gemma 3 load would
    add ~15 s)."""
    paths = {"smollm2": _paths()["smollm2"],
             "tiny": write_tiny_gguf(str(tmp_path / "tiny.gguf"), n_ctx_train=4096)}
    preset = tmp_path / "models.ini"
    preset.write_text(f"""version = 1
[*]
c = 1024
np = 1

[small]
model = {paths["smollm2"]}
n-predict = 3

[tiny]
model = {paths["tiny"]}
LLAMA_ARG_CTX_SIZE = 512
""")
    with ServerProcess(["--models-preset", str(preset), "--models-max", "1",
                        "--no-models-autoload"], tmp_path / "router.log") as srv:
        u = srv.url
        props = httpx.get(u + "/props").json()
        assert (props["max_instances"], props["models_autoload"]) == (1, False)
        body = {"model": "small", "prompt": "The capital of France is", "temperature": 0}
        r = httpx.post(u + "/completion", json=body)
        assert (r.status_code, r.json()["error"]["message"]) == (400, "model is not loaded")
        # ?autoload=true overrides --no-models-autoload for one request
        r = httpx.post(u + "/completion?autoload=true", json=body, timeout=300)
        assert r.status_code == 200 and r.json()["timings"]["predicted_n"] == 3  # preset -n
        assert r.json()["generation_settings"]["n_ctx"] == 1024  # [*] c, one slot
        st = status(u, "small")
        assert "preset" in st and "c = 1024" in st["preset"]
        assert httpx.post(u + "/models/load", json={"model": "tiny"}).status_code == 200
        wait_status(u, "tiny", "loaded")
        assert status(u, "small")["value"] == "unloaded"  # --models-max 1: evicted
        assert len(children(srv.pid)) == 1
        r = httpx.post(u + "/completion", json={**body, "model": "tiny"}, timeout=300)
        assert r.status_code == 200 and r.json()["generation_settings"]["n_ctx"] == 512
