"""llama-server's server flags do what they say: CORS, --api-prefix, --path, --props,
aliases and tags, the body limit (413), --timeout (408), --sse-ping-interval, API keys from the
environment and a file; the seed's command line starts a server; a refused flag stops start-up
naming the feature; a not-applicable flag is logged once."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from radixserve.model.loader import Model
from tests.http.harness import free_port, running_server
from tests.http.test_app import GOOD, PartialResult, assert_error, client, final


def test_cors_default_echoes_the_origin_with_credentials(model: Model) -> None:
    c, _ = client(model)
    r = c.options("/completion", headers={"Origin": "http://app.example",
                                          "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://app.example"
    assert r.headers["access-control-allow-credentials"] == "true"
    r = c.get("/health", headers={"Origin": "http://app.example"})
    assert r.headers["access-control-allow-origin"] == "http://app.example"
    # as llama-server, credentials are allowed on the preflight only: no page reads a
    # credentialed answer (server-http.cpp's pre-routing handler)
    assert "access-control-allow-credentials" not in r.headers


def test_cors_localhost_and_lists(model: Model) -> None:
    c, _ = client(model, cors_origins="localhost")
    assert c.get("/health", headers={"Origin": "http://localhost:3000"}).headers[
        "access-control-allow-origin"] == "http://localhost:3000"
    assert "access-control-allow-origin" not in c.get(
        "/health", headers={"Origin": "http://evil.example"}).headers
    c, _ = client(model, cors_origins="http://a.example", cors_methods="GET",
                  cors_credentials=False)
    r = c.options("/completion", headers={"Origin": "http://a.example",
                                          "Access-Control-Request-Method": "POST"})
    # llama-server answers every preflight 200 with the allowed methods; the browser refuses
    assert r.status_code == 200 and r.headers["access-control-allow-methods"] == "GET"
    assert r.headers["access-control-allow-origin"] == "http://a.example"
    assert "access-control-allow-credentials" not in c.get(
        "/health", headers={"Origin": "http://a.example"}).headers


def test_api_prefix_moves_every_route(model: Model) -> None:
    c, _ = client(model, GOOD, api_prefix="/llm", api_key=["k"])
    assert c.get("/llm/health").status_code == 200  # still exempt from the key
    assert c.get("/health").status_code == 404
    assert c.get("/llm/props").status_code == 401
    r = c.post("/llm/completion", json={"prompt": "hi"}, headers={"Authorization": "Bearer k"})
    assert r.status_code == 200 and r.json()["content"] == "Hello"


def test_path_serves_static_files(model: Model, tmp_path: Path) -> None:
    (tmp_path / "index.html").write_text("<h1>my ui</h1>")
    c, _ = client(model, static_path=str(tmp_path))
    assert c.get("/").text == "<h1>my ui</h1>"
    assert c.get("/health").json() == {"status": "ok"}  # the API comes first


def test_post_props_needs_the_flag(model: Model) -> None:
    c, _ = client(model)
    assert_error(c.post("/props", json={}), 501, "not_supported_error")
    assert c.get("/props").json()["endpoint_props"] is False
    c, _ = client(model, props_endpoint=True)
    assert c.post("/props", json={}).json() == {"success": True}
    assert c.get("/props").json()["endpoint_props"] is True


def test_aliases_and_tags_in_models(model: Model) -> None:
    c, _ = client(model, alias="alpha", aliases=["alpha", "zeta"], tags=["rag"])
    data = c.get("/v1/models").json()["data"][0]
    assert (data["id"], data["aliases"], data["tags"]) == ("alpha", ["alpha", "zeta"], ["rag"])
    assert c.get("/props").json()["model_alias"] == "alpha"


def test_body_limit_is_413_and_the_server_keeps_serving(model: Model) -> None:
    c, engine = client(model, GOOD, max_body_mib=1)
    big = json.dumps({"prompt": "x" * (1 << 20)})
    assert_error(c.post("/completion", content=big), 413, "invalid_request_error")

    def chunks():  # no Content-Length: the limit applies while reading
        for _ in range(3):
            yield b"x" * (600 << 10)

    assert_error(c.post("/completion", content=chunks()), 413, "invalid_request_error")
    assert engine.tasks == []  # nothing reached the engine
    assert c.post("/completion", json={"prompt": "hi"}).status_code == 200


@pytest.mark.parametrize("kwargs", ["yes", [1], {"messages": 1}, {"add_generation_prompt": 0}])
def test_chat_template_kwargs_of_a_wrong_type_is_400(model: Model, kwargs: object) -> None:
    c, engine = client(model, GOOD)
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                             "chat_template_kwargs": kwargs})
    assert_error(r, 400, "invalid_request_error")
    assert "chat_template_kwargs" in r.json()["error"]["message"]
    assert engine.tasks == []


TEMPLATE = ("{{ greeting | default('') }}{% for m in messages %}[{{ m['role'] }}]"
            "{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def test_chat_template_flags(tiny_path: str) -> None:
    """--chat-template replaces the GGUF's; --chat-template-kwargs are defaults a request may
    override; --no-prefill-assistant renders a last assistant turn as a finished message."""
    from radixserve.config import ServerConfig
    from radixserve.http.run import load
    from tests.http.test_app import ScriptedEngine, TestClient, create_app

    cfg = ServerConfig(model=tiny_path, dtype="f32", chat_template=TEMPLATE,
                       chat_template_kwargs={"greeting": "G:"})
    m = load(cfg)
    assert m.chat_template.source == TEMPLATE
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]

    def prompt(cfg: ServerConfig, **body: object) -> str:
        c = TestClient(create_app(ScriptedEngine(m, cfg), cfg))
        return c.post("/apply-template", json={"messages": msgs, **body}).json()["prompt"]

    assert prompt(cfg) == "G:[user]hi[assistant]Sure"  # prefilled: the reply continues it
    assert prompt(cfg, chat_template_kwargs={"greeting": "H:"}).startswith("H:[user]")
    cfg.prefill_assistant = False
    assert prompt(cfg) == "G:[user]hi[assistant]Sure[assistant]"


def test_sse_ping_while_the_engine_is_silent(model: Model) -> None:
    script = [PartialResult("Hel", [10]), 1.7, final()]
    c, _ = client(model, script, sse_ping_interval=1)
    body = c.post("/completion", json={"prompt": "hi", "stream": True}).text
    assert body.count(":\n\n") == 1  # one ping in the 1.7 s of silence, none elsewhere
    c, _ = client(model, script, sse_ping_interval=-1)
    assert ":\n\n" not in c.post("/completion", json={"prompt": "hi", "stream": True}).text
    # the request's own interval wins; several prompts in one stream get pings too
    c, _ = client(model, script, sse_ping_interval=-1)
    body = {"prompt": "hi", "stream": True, "sse_ping_interval": 1}
    assert c.post("/completion", json=body).text.count(":\n\n") == 1
    c, _ = client(model, script, sse_ping_interval=1)
    r = c.post("/completion", json={"prompt": ["a", "b"], "stream": True})
    assert r.text.count(":\n\n") >= 1 and r.text.count('"index":1') >= 1


# ---- real processes -------------------------------------------------------------------------


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "radixserve.cli", *args], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.parametrize("argv, feature", [
    (["--mmproj", "proj.gguf"], "multimodal projectors"),
    (["--lora", "a.gguf"], "LoRA adapters"),
    (["-hf", "ggml-org/x"], "downloading models"),
    (["-ctk", "q5_1"], "cache type q5_1 is not implemented"),
])
def test_refused_flag_stops_startup_naming_the_feature(argv: list[str], feature: str) -> None:
    r = cli("serve", *argv)
    assert r.returncode == 1 and feature in r.stderr and argv[0] in r.stderr


def test_seed_command_line_starts_a_server(tmp_path: Path) -> None:
    """The seed's example (--model M --alias local ... --log-file F), with the API key from
    LLAMA_API_KEY and a key file: both keys work, requests without one get 401, `-ngl 99`
    with the default `--device auto` loads on the CPU of a machine without a CUDA device (as
    llama-server's CPU build), and the log file receives the server's log."""
    keys = tmp_path / "keys"
    keys.write_text("# ops\nfile-key\n")
    log_file = tmp_path / "server.log"
    args = ["--model", "default", "--alias", "local", "--ctx-size", "8192", "--parallel", "4",
            "--kv-unified", "--n-gpu-layers", "99", "--batch-size", "2048", "--ubatch-size",
            "512", "--cache-ram", "4096", "--cache-radix-prompt", "on", "--log-file",
            str(log_file), "--api-key-file", str(keys), "--timeout", "2"]
    with running_server(args, env={"LLAMA_API_KEY": "env-key"}) as srv:
        assert httpx.get(srv.url + "/props").status_code == 401
        for key in ("env-key", "file-key"):
            h = {"Authorization": f"Bearer {key}"}
            props = httpx.get(srv.url + "/props", headers=h).json()
            assert props["model_alias"] == "local" and props["total_slots"] == 4
            assert props["device"] == "cpu"
            # unified KV: any one slot may fill the whole context
            assert props["default_generation_settings"]["n_ctx"] == 8192
        r = httpx.post(srv.url + "/completion", headers=h, timeout=120,
                       json={"prompt": "Hello", "n_predict": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 4

        # --timeout 2: a client that stops sending its body gets 408, others are served
        t0 = time.monotonic()  # before the server's timer can start: the wait is never under
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer env-key"
                      b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pr")
            s.settimeout(30)
            reply = s.recv(4096).decode()
            assert reply.startswith("HTTP/1.1 408") and time.monotonic() - t0 >= 1.5
        assert httpx.get(srv.url + "/health").status_code == 200
    text = log_file.read_text()
    assert "engine ready" in text
    assert "--n-gpu-layers: not applicable" not in text  # honored: it names the layers
    assert re.search(r"loaded \S+ \(llama, 30 layers, .*\) on cpu in", text)


@pytest.mark.parametrize("mode, on, kernels", [("auto", True, "auto"), ("off", False, "avx2")])
def test_deterministic_mode_is_reported_by_props(mode: str, on: bool, kernels: str,
                                                 tmp_path: Path) -> None:
    """The default model in bf16: auto turns the mode on; /props says which, and with it on
    --cache-reuse is reported as 0 (the mode never shifts chunks). /props names the variant of
    our kernels the model runs (RADIXSERVE_KERNELS: auto takes avx512bf16 on this project's
    machines; one forced), and the log says it once at start-up."""
    args = ["-c", "512", "--cache-reuse", "16", "--deterministic", mode]
    log_file = tmp_path / "server.log"
    env = {**os.environ, "RADIXSERVE_KERNELS": kernels}
    with running_server(args, str(log_file), env=env) as srv:
        props = httpx.get(srv.url + "/props", timeout=60).json()  # not 5 s: a loaded machine
    assert props["deterministic"] is on
    assert props["prompt_cache"]["cache_reuse"] == (0 if on else 16)
    variant = "avx512bf16" if kernels == "auto" else kernels
    assert props["kernels"] == variant
    # each layer matrix's route (model/kernel_routes.py): the default model's Q4_1 layers
    route = "q4-tiles"  # every kernel build: the tiles with 8-bit activations
    assert props["kernel_routes"] == {m: {route: 30} for m in ("wqkv", "wo", "w_gate_up",
                                                                "w_down")}
    build = {"avx512bf16": "x86-64-v4 + AVX512-VNNI + AVX512-BF16 build",
             "avx2": "x86-64-v3 build"}[variant]
    assert log_file.read_text().count(f"kernels: {variant} ({build})") == 1


@pytest.mark.parametrize("value, says", [
    ("bogus", ("RADIXSERVE_KERNELS='bogus' is not a kernel variant; allowed values: auto, "
               "avx512bf16, avx512, avxvnni, avx2, generic, 0")),
    ("AVX-512", "RADIXSERVE_KERNELS='AVX-512' is not a kernel variant"),
])
def test_bad_kernel_variant_stops_startup(value: str, says: str) -> None:
    """RADIXSERVE_KERNELS naming no variant (or one this CPU lacks, tests/model/
    test_kernels.py) ends `radixserve serve` before it listens: exit 1 and the message, no
    traceback; `generate` and `perf` too."""
    env = {**os.environ, "RADIXSERVE_KERNELS": value}
    r = cli("serve", "--port", str(free_port()), env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("radixserve serve: error: ") and says in r.stderr
    assert "listening" not in r.stderr
    for cmd in (["generate", "hi"], ["perf"]):
        r = cli(*cmd, env=env)
        assert r.returncode == 1 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_an_unreachable_device_stops_startup() -> None:
    """--device naming a CUDA device torch cannot reach ends `serve` before it listens (exit 1,
    the message naming what torch sees, no traceback); `perf --device` too."""
    r = cli("serve", "--device", "cuda:64", "--port", str(free_port()))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("radixserve serve: error: --device cuda:64: not available "
                               "(torch sees "), r.stderr
    assert "listening" not in r.stderr
    r = cli("perf", "--device", "CUDA64")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("radixserve perf: error: --device cuda:64: not available")


def test_deterministic_on_where_it_cannot_hold_stops_startup() -> None:
    """f32 compute has no batch-invariant path: `on` is an error naming why, not a mode that
    silently is not one; `auto` there means off."""
    r = cli("serve", "--dtype", "f32", "--deterministic", "on", "--port", str(free_port()))
    assert r.returncode == 1 and "--deterministic on needs bf16 compute" in r.stderr
    r = cli("serve", "--deterministic", "sometimes")
    assert r.returncode == 1 and "--deterministic" in r.stderr
