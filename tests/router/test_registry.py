"""Router mode without processes: model discovery, presets, the children's command lines, the
flags, and the model states (loads, LRU unloading under --models-max, failures, a child that
dies, autoload off) over fake children."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from radixserve.cli import is_router
from radixserve.flags import ALL_FLAGS, parse_serve
from radixserve.router.registry import (
    ROUTER_FLAGS,
    ModelEntry,
    Models,
    RouterError,
    build_entries,
    parse_ini,
    router_env,
    scan_models_dir,
)


def _touch(p: Path) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"GGUF")
    return p


def test_models_dir_as_llama_server(tmp_path: Path) -> None:
    _touch(tmp_path / "llama-3.2-1b-Q4_K_M.gguf")
    _touch(tmp_path / "mmproj-F16.gguf")  # a companion, not a model
    _touch(tmp_path / "notes.txt")
    _touch(tmp_path / "gemma-3-4b" / "gemma-3-4b-Q8_0.gguf")
    _touch(tmp_path / "gemma-3-4b" / "mmproj-F16.gguf")
    _touch(tmp_path / "kimi" / "kimi-00001-of-00002.gguf")
    _touch(tmp_path / "kimi" / "kimi-00002-of-00002.gguf")
    (tmp_path / "empty").mkdir()
    found = scan_models_dir(str(tmp_path))
    assert found == {
        "gemma-3-4b": str(tmp_path / "gemma-3-4b" / "gemma-3-4b-Q8_0.gguf"),
        "kimi": str(tmp_path / "kimi" / "kimi-00001-of-00002.gguf"),
        "llama-3.2-1b-Q4_K_M": str(tmp_path / "llama-3.2-1b-Q4_K_M.gguf"),
    }
    with pytest.raises(ValueError, match="does not exist or is not a directory"):
        scan_models_dir(str(tmp_path / "nope"))


def test_ini_parsing() -> None:
    text = """version = 1
; a comment
# another
[*]
c = 8192
[ggml-org/MY-MODEL:Q8_0]
chat-template = "chatml"
c = 4096
c = 2048
"""
    assert parse_ini(text) == {"": {"version": "1"}, "*": {"c": "8192"},
                               "ggml-org/MY-MODEL:Q8_0": {"chat-template": "chatml",
                                                          "c": "2048"}}
    with pytest.raises(ValueError, match="expected 'key = value'"):
        parse_ini("[a]\njust words\n")
    with pytest.raises(ValueError, match="bad section header"):
        parse_ini("[a\n")


def test_preset_precedence_and_key_spellings(tmp_path: Path) -> None:
    _touch(tmp_path / "models" / "a.gguf")
    preset = tmp_path / "p.ini"
    preset.write_text("""version = 1
[*]
c = 8192
n-predict = 7
LLAMA_ARG_CACHE_RAM = 0
slots = false
[a]
ctx-size = 4096
load-on-startup = true
stop-timeout = 3
[b]
model = /models/b.gguf
no-slots = false
host = 0.0.0.0
""")
    entries = build_entries(str(tmp_path / "models"), str(preset), ["-np", "2", "-n", "9"],
                            ALL_FLAGS)
    a, b = entries["a"], entries["b"]
    assert (a.path, a.source, b.path, b.source) == (
        str(tmp_path / "models" / "a.gguf"), "models_dir", "/models/b.gguf", "preset")
    # the model's section over [*]; the command line (-n 9) over both; router flags dropped
    assert a.args == ["--ctx-size", "4096", "--cache-ram", "0", "--no-slots", "-np", "2", "-n",
                      "9"]
    assert b.args == ["--ctx-size", "8192", "--cache-ram", "0", "--slots", "-np", "2", "-n",
                      "9"]
    assert (a.load_on_startup, a.stop_timeout_s, b.load_on_startup, b.stop_timeout_s) == (
        True, 3.0, False, 10.0)
    # what each child's command line means, parsed as a child parses it
    cfg = parse_serve([*a.args, "-m", a.path], environ={}).cfg
    assert (cfg.ctx_size, cfg.cache_ram_mib, cfg.slots_endpoint, cfg.n_parallel,
            cfg.n_predict) == (4096, 0, False, 2, 9)


def test_preset_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.ini"
    bad.write_text("[x]\nc = 1\n")
    with pytest.raises(ValueError, match=r"\[x\]: not a model of --models-dir; it needs"):
        build_entries("", str(bad), [], ALL_FLAGS)
    bad.write_text("[x]\nmodel = /m.gguf\nno-such-flag = 1\n")
    with pytest.raises(ValueError, match="unknown key 'no-such-flag'"):
        build_entries("", str(bad), [], ALL_FLAGS)
    bad.write_text("[x]\nmodel = /m.gguf\njinja = maybe\n")
    with pytest.raises(ValueError, match="jinja"):
        build_entries("", str(bad), [], ALL_FLAGS)
    with pytest.raises(ValueError, match="cannot read"):
        build_entries("", str(tmp_path / "missing.ini"), [], ALL_FLAGS)


def test_router_flags_are_not_inherited(tmp_path: Path) -> None:
    _touch(tmp_path / "m.gguf")
    argv = ["--models-dir", str(tmp_path), "--models-max", "2", "--no-models-autoload",
            "--host", "0.0.0.0", "--port", "9", "--api-key", "k", "-c", "512",
            "--cache-disk", "/kv", "--cache-ram", "64"]
    e = build_entries(str(tmp_path), "", argv, ALL_FLAGS)["m"]
    assert e.args == ["-c", "512", "--cache-disk", "/kv", "--cache-ram", "64"]


def test_flags_and_router_mode_selection(tmp_path: Path) -> None:
    p = parse_serve(["--models-dir", str(tmp_path), "--models-max", "1",
                     "--no-models-autoload"], environ={})
    assert (p.cfg.models_dir, p.cfg.models_max, p.cfg.models_autoload) == (
        str(tmp_path), 1, False)
    assert is_router(p)
    assert ServerDefaults.models_max == 4 and ServerDefaults.models_autoload
    env = {"LLAMA_ARG_MODELS_PRESET": "/p.ini", "LLAMA_ARG_MODELS_MAX": "0",
           "LLAMA_ARG_NO_MODELS_AUTOLOAD": "1"}
    p = parse_serve([], environ=env)
    assert (p.cfg.models_preset, p.cfg.models_max, p.cfg.models_autoload) == ("/p.ini", 0,
                                                                              False)
    assert is_router(p)
    assert not is_router(parse_serve(["--models-dir", "d", "-m", "x.gguf"], environ={}))
    assert not is_router(parse_serve([], environ={}))
    with pytest.raises(ValueError, match="must be >= 0"):
        parse_serve(["--models-max", "-1"], environ={})


class ServerDefaults:  # the config's defaults (llama-server's: 4 models, autoload on)
    from radixserve.config import ServerConfig as _C

    models_max = _C().models_max
    models_autoload = _C().models_autoload


# -- the state machine over fake children ----------------------------------------------
class FakeChild:
    def __init__(self, entry: ModelEntry, log: list[str], fail: bool = False) -> None:
        self.name, self.log, self.fail = entry.name, log, fail
        self.url, self.pid = "http://127.0.0.1:1", 1000 + len(log)  # refuses connections
        self.code: int | None = None
        self.started = asyncio.Event()

    def argv(self) -> list[str]:
        return ["radixserve", "serve", "-m", self.name]

    async def start(self) -> None:
        self.log.append(f"start {self.name}")
        await asyncio.sleep(0.01)
        if self.fail:
            self.code = 1
            raise RuntimeError("server exited with 1:\nlog")

    async def stop(self, timeout_s: float) -> None:
        if self.code is None:
            self.code = -2
            self.log.append(f"stop {self.name}")

    def exit_code(self) -> int | None:
        return self.code

    def failure_reason(self) -> str:
        return "ValueError: not a GGUF file" if self.fail else ""

    async def info(self) -> dict[str, Any]:
        return {"id": self.name, "meta": {"n_params": 1}}


def _models(names: list[str], models_max: int, log: list[str],
            failing: tuple[str, ...] = ()) -> Models:
    entries = {n: ModelEntry(name=n, path=f"/{n}.gguf", source="models_dir", args=[])
               for n in names}
    return Models(entries, models_max, lambda e: FakeChild(e, log, e.name in failing),
                  poll_s=0.01)


def test_load_unload_and_lru() -> None:
    async def main() -> None:
        log: list[str] = []
        m = _models(["a", "b", "c"], 2, log)
        m.start()
        a, b, c = (m.entries[n] for n in "abc")
        await m.load("a")
        assert a.status == "loaded" and a.loaded_info == {"id": "a", "meta": {"n_params": 1}}
        await m.load("b")
        m.hold(a)  # a serves a request: the least recently used idle one is b
        m.release(a)
        m.hold(b)
        m.release(b)
        await m.load("c")
        assert (a.status, b.status, c.status) == ("unloaded", "loaded", "loaded")
        assert log == ["start a", "start b", "stop a", "start c"]
        # a model serving a request is never unloaded for room: the load waits
        m.hold(b)
        m.hold(c)
        waiting = m.load("a")
        await asyncio.sleep(0.05)
        assert not waiting.done() and a.status == "loading" and a.child is None
        m.release(c)
        await waiting
        assert (a.status, b.status, c.status) == ("loaded", "loaded", "unloaded")
        m.release(b)
        await m.unload("a")
        assert a.status == "unloaded" and a.child is None and not a.failed
        await m.close()
        assert b.status == "unloaded"

    asyncio.run(main())


def test_failed_load_and_a_child_that_dies() -> None:
    async def main() -> None:
        log: list[str] = []
        m = _models(["ok", "bad"], 0, log, failing=("bad",))
        m.start()
        bad, ok = m.entries["bad"], m.entries["ok"]
        await m.load("bad")
        assert bad.status_json() == {"value": "unloaded", "args": ["radixserve", "serve", "-m",
                                     "bad"], "failed": True, "exit_code": 1,
                                     "reason": "ValueError: not a GGUF file"}
        # a request waits for the (re)load it triggered and fails with the reason
        with pytest.raises(RouterError, match="failed to load: ValueError"):
            await m.ensure_ready(bad, autoload=True)
        await m.ensure_ready(ok, autoload=True)
        assert ok.status == "loaded"
        ok.child.code = -9  # killed behind the router's back
        await asyncio.sleep(0.05)
        assert ok.status_json()["failed"] and ok.exit_code == -9 and ok.child is None
        assert "signal 9" in ok.reason
        await m.ensure_ready(ok, autoload=True)  # a new request loads it again
        assert ok.status == "loaded" and not ok.failed
        await m.close()

    asyncio.run(main())


def test_autoload_off() -> None:
    async def main() -> None:
        m = _models(["a"], 4, [])
        m.start()
        with pytest.raises(RouterError, match="model is not loaded") as e:
            await m.ensure_ready(m.entries["a"], autoload=False)
        assert e.value.status == 400
        m.load("a")
        await m.ensure_ready(m.entries["a"], autoload=False)  # loading: waits for it
        assert m.entries["a"].status == "loaded"
        await m.close()

    asyncio.run(main())


def test_unloading_a_model_that_waits_for_room_evicts_nothing() -> None:
    """--models-max 1: a model unloaded while it waits for room (the loaded one idle, or
    serving a request) stops waiting at once and unloads no other model for it."""
    async def main() -> None:
        log: list[str] = []
        m = _models(["a", "b"], 1, log)
        m.start()
        a, b = m.entries["a"], m.entries["b"]
        await m.load("a")
        m.load("b")
        await m.unload("b")  # right after its load: a stays
        assert (a.status, b.status) == ("loaded", "unloaded") and log == ["start a"]
        m.hold(a)  # a serves a request: b's load waits for room
        m.load("b")
        await asyncio.sleep(0.05)
        await asyncio.wait_for(m.unload("b"), 1.0)  # does not wait for a's request
        m.release(a)
        await asyncio.sleep(0.05)
        assert (a.status, b.status) == ("loaded", "unloaded") and log == ["start a"]
        await m.close()

    asyncio.run(main())


class LateSpawnChild(FakeChild):
    """A child whose process exists only once `start` is well under way (ServerProcess: its
    Popen runs in a thread): a stop before then finds nothing to stop."""

    def __init__(self, entry: ModelEntry, log: list[str]) -> None:
        super().__init__(entry, log)
        self.running = False

    async def start(self) -> None:
        await asyncio.sleep(0.05)
        self.running = True
        self.log.append(f"start {self.name}")

    async def stop(self, timeout_s: float) -> None:
        if self.running:
            self.running, self.code = False, -2
            self.log.append(f"stop {self.name}")


def test_a_child_unloaded_while_it_starts_is_stopped() -> None:
    async def main() -> None:
        log: list[str] = []
        children: list[LateSpawnChild] = []

        def spawn(e: ModelEntry) -> LateSpawnChild:
            children.append(LateSpawnChild(e, log))
            return children[-1]

        m = Models({"a": ModelEntry(name="a", path="/a.gguf", source="models_dir", args=[])},
                   0, spawn, poll_s=0.01)
        m.start()
        m.load("a")
        await asyncio.sleep(0.01)  # spawned, its process not there yet
        await m.unload("a")
        assert m.entries["a"].status == "unloaded" and m.entries["a"].child is None
        assert log == ["start a", "stop a"] and not children[0].running
        await m.close()

    asyncio.run(main())


def test_children_lose_the_environment_of_every_flag_the_router_owns():
    """Read from the flag table: a child inheriting the router's LLAMA_ARG_API_KEY_FILE would
    refuse the router's own unauthenticated calls."""
    spellings = {n for f in ALL_FLAGS for n in f.names}
    assert set(ROUTER_FLAGS) <= spellings  # no misspelt router flag
    env = set(router_env(ALL_FLAGS))
    assert {"LLAMA_ARG_API_KEY_FILE", "LLAMA_ARG_REUSE_PORT", "LLAMA_API_KEY", "LLAMA_ARG_PORT",
            "LLAMA_ARG_MODEL", "LLAMA_ARG_MODELS_AUTOLOAD", "LLAMA_ARG_NO_MODELS_AUTOLOAD",
            "LLAMA_ARG_SSL_KEY_FILE"} <= env
    assert "LLAMA_ARG_CTX_SIZE" not in env  # a child's own flags stay
