"""The router's models: where they come from (--models-dir, --models-preset), the command line
each child server gets, and their states (llama-server's server-models.cpp).

Discovery is llama-server's: a `NAME.gguf` file in --models-dir is model NAME; a subdirectory
is a model named after it (its GGUF, the first shard of a split one; `mmproj*` and draft
companions are not models). A preset is an INI file: a `[*]` section for every model, a
`[NAME]` section per model (one that names a --models-dir model configures it; any other needs
a `model = PATH` key). Keys are flags without their dashes (`ctx-size`, `c`, `no-slots`) or
their environment variables (`LLAMA_ARG_CTX_SIZE`); `load-on-startup` and `stop-timeout` are
the preset's own. Precedence, as llama-server: the router's command line, then the model's
section, then `[*]`.

States: `unloaded` (never started, unloaded, or `failed` with the exit code and the reason),
`loading` (the child is starting), `loaded`. `Models` owns them: it loads (spawning a child
through the factory it is given), waits for readiness, unloads, keeps at most --models-max
children by unloading the least recently used idle one, and notices a child that died.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from radixserve.flags.spec import Flag, _normalize, index, parse_bool

log = logging.getLogger(__name__)

# flags the router sets for each child, or keeps for itself: never inherited, never preset
ROUTER_FLAGS = ("--host", "--port", "--reuse-port", "--api-key", "--api-key-file", "-m",
                "--alias", "--models-dir", "--models-preset", "--models-max", "--models-autoload",
                "--ssl-key-file", "--ssl-cert-file")
PRESET_ONLY = ("load-on-startup", "stop-timeout", "dedup-cache-models")
MODEL_KEYS = ("model", "m", "LLAMA_ARG_MODEL")
DEFAULT_STOP_TIMEOUT_S = 10.0


def router_env(flags: Sequence[Flag]) -> tuple[str, ...]:
    """The environment variables of ROUTER_FLAGS, read from the flag table (a negatable flag's
    LLAMA_ARG_NO_ form too): removed from a child's environment."""
    out: list[str] = []
    for f in flags:
        if f.env and any(n in ROUTER_FLAGS for n in f.names):
            out.append(f.env)
            if f.neg:
                out.append(f.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1))
    return tuple(out)


class RouterError(Exception):
    """A request the router refuses: `status` and llama-server's message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


# -- discovery ---------------------------------------------------------------------------
def _is_companion(name: str) -> bool:
    low = name.lower()
    return low.startswith("mmproj") or "draft" in low


def scan_models_dir(models_dir: str) -> dict[str, str]:
    """{model name: GGUF path} of a --models-dir, as llama-server's load_from_models_dir."""
    if not os.path.isdir(models_dir):
        raise ValueError(f"--models-dir: '{models_dir}' does not exist or is not a directory")
    out: dict[str, str] = {}
    for e in sorted(os.scandir(models_dir), key=lambda e: e.name):
        if e.is_dir():
            model = shard = ""
            for f in sorted(os.scandir(e.path), key=lambda f: f.name):
                if not f.name.endswith(".gguf") or _is_companion(f.name):
                    continue
                if "-00001-of-" in f.name:
                    shard = f.path
                else:
                    model = f.path
            if shard or model:
                out[e.name] = shard or model
        elif e.name.endswith(".gguf") and not _is_companion(e.name):
            out[e.name.removesuffix(".gguf")] = e.path
    return out


def parse_ini(text: str, source: str = "preset") -> dict[str, dict[str, str]]:
    """{section: {key: value}} of llama.cpp's INI presets: `;`/`#` comment lines, `key = value`
    (a later key replaces an earlier one), keys before the first section go to section ""."""
    sections: dict[str, dict[str, str]] = {"": {}}
    cur = ""
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in ";#":
            continue
        if line.startswith("["):
            if not line.endswith("]") or len(line) < 3:
                raise ValueError(f"{source}:{n}: bad section header {line!r}")
            cur = line[1:-1].strip()
            sections.setdefault(cur, {})
            continue
        key, eq, value = line.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{source}:{n}: expected 'key = value', got {line!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        sections[cur][key.strip()] = value
    return sections


def _long(spellings: Sequence[str]) -> str:
    """The first long spelling (`--ctx-size` rather than `-c`): children's command lines read
    as their presets do."""
    return next((n for n in spellings if n.startswith("--")), spellings[0])


class FlagKeys:
    """Preset keys -> flags: `ctx-size`, `c` (spellings without dashes), `no-slots` (a negative
    spelling), `LLAMA_ARG_CTX_SIZE` (the environment variable)."""

    def __init__(self, flags: Sequence[Flag]) -> None:
        self.flags = flags
        self.table = index(flags)
        self.by_env = {f.env: f for f in flags if f.env}

    def lookup(self, key: str) -> tuple[Flag, bool] | None:
        if key in self.by_env:
            return self.by_env[key], True
        for spelling in (f"--{key}", f"-{key}"):
            hit = self.table.get(_normalize(spelling))
            if hit is not None:
                return hit
        return None

    def args(self, key: str, value: str, where: str) -> tuple[Flag, list[str]]:
        """The command-line tokens a preset `key = value` stands for."""
        hit = self.lookup(key)
        if hit is None:
            raise ValueError(f"{where}: unknown key {key!r} (not a flag of `radixserve serve`)")
        f, positive = hit
        if f.hint is None:  # a switch: true/false, its negative spelling for false
            try:
                on = parse_bool(value)
            except ValueError as e:
                raise ValueError(f"{where}: {key}: {e}") from None
            on = on if positive else not on
            if on:
                return f, [_long(f.names)]
            return f, [_long(f.neg)] if f.neg else []
        values = value.split() if f.n_values > 1 else [value]
        return f, [_long(f.names), *values]

    def is_router_flag(self, f: Flag) -> bool:
        return any(n in ROUTER_FLAGS for n in f.names)

    def split_argv(self, argv: Sequence[str]) -> list[tuple[Flag | None, list[str]]]:
        """The router's command line as (flag, its tokens) groups (parsed already, so valid)."""
        out: list[tuple[Flag | None, list[str]]] = []
        i = 0
        while i < len(argv):
            hit = self.table.get(_normalize(argv[i]))
            if hit is None:
                out.append((None, [argv[i]]))
                i += 1
                continue
            f = hit[0]
            n = 1 if f.hint is None else 1 + f.n_values
            out.append((f, list(argv[i:i + n])))
            i += n
        return out


# -- entries -------------------------------------------------------------------------------
@dataclass
class ModelEntry:
    """One model the router can serve, and its child's state."""

    name: str
    path: str
    source: str  # "models_dir" | "preset" (llama-server's names)
    args: list[str]  # the child's flags before -m/--alias/--host/--port
    preset: dict[str, str] = field(default_factory=dict)  # its section, [*] merged in
    load_on_startup: bool = False
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S
    status: str = "unloaded"  # unloaded | loading | loaded
    failed: bool = False
    exit_code: int | None = None
    reason: str = ""  # why it failed (the child's last error line)
    child: Any = None  # the running child (children.Child), None when unloaded
    child_args: list[str] = field(default_factory=list)  # the argv it was started with
    loaded_info: dict[str, Any] = field(default_factory=dict)  # the child's /v1/models entry
    last_used: float = 0.0
    in_flight: int = 0  # requests holding it (never unloaded by LRU while > 0)
    stopping: bool = False
    load_task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self.status in ("loading", "loaded")

    def status_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"value": self.status}
        if self.child_args:
            out["args"] = self.child_args
        if self.preset:
            out["preset"] = "\n".join(f"{k} = {v}" for k, v in self.preset.items())
        if self.failed:
            out["failed"] = True
            out["exit_code"] = self.exit_code
            out["reason"] = self.reason
        return out


def build_entries(models_dir: str, preset_path: str, router_argv: Sequence[str],
                  flags: Sequence[Flag]) -> dict[str, ModelEntry]:
    """Every model of --models-dir and --models-preset, with the flags its child gets."""
    keys = FlagKeys(flags)
    found = scan_models_dir(models_dir) if models_dir else {}
    sections: dict[str, dict[str, str]] = {"": {}}
    if preset_path:
        try:
            with open(preset_path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as e:
            raise ValueError(f"--models-preset: cannot read {preset_path!r}: {e}") from None
        sections = parse_ini(text, preset_path)
    glob = sections.get("*", {})
    names = list(found) + [s for s in sections if s not in ("", "*") and s not in found]
    # the router's own flags (the command line wins over any preset key for the same flag)
    router_groups = [(f, toks) for f, toks in keys.split_argv(router_argv)
                     if f is None or not keys.is_router_flag(f)]
    router_flags = {id(f) for f, _ in router_groups if f is not None}
    entries: dict[str, ModelEntry] = {}
    for name in names:
        merged = {**glob, **sections.get(name, {})}
        path = found.get(name, "")
        opts: dict[int, list[str]] = {}  # by flag: later sections replace earlier ones
        extra: dict[str, str] = {}
        for key, value in merged.items():
            where = f"--models-preset [{name if key in sections.get(name, {}) else '*'}]"
            if key in MODEL_KEYS:
                path = value
                continue
            if key in PRESET_ONLY:
                extra[key] = value
                continue
            f, toks = keys.args(key, value, where)
            if keys.is_router_flag(f):
                log.warning("%s: %s is set by the router; ignored", where, key)
                continue
            if id(f) in router_flags:
                continue  # the router's command line wins
            opts[id(f)] = toks
        if not path:
            raise ValueError(f"--models-preset [{name}]: not a model of --models-dir; it needs "
                             f"'model = PATH'")
        try:
            stop_timeout = float(extra.get("stop-timeout", DEFAULT_STOP_TIMEOUT_S))
            load_on_startup = parse_bool(extra.get("load-on-startup", "false"))
        except ValueError as e:
            raise ValueError(f"--models-preset [{name}]: {e}") from None
        args = [t for toks in opts.values() for t in toks]
        args += [t for _, toks in router_groups for t in toks]
        entries[name] = ModelEntry(
            name=name, path=path, source="models_dir" if name in found else "preset",
            args=args, preset=merged if name in sections or glob else {},
            load_on_startup=load_on_startup, stop_timeout_s=stop_timeout)
    return entries


# -- the state machine ---------------------------------------------------------------------
class ChildLike(Protocol):
    url: str
    pid: int

    async def start(self) -> None: ...  # raises when the child does not become ready

    async def stop(self, timeout_s: float) -> None: ...

    def exit_code(self) -> int | None: ...  # None while it runs

    def failure_reason(self) -> str: ...

    def argv(self) -> list[str]: ...

    async def info(self) -> dict[str, Any]: ...  # its /v1/models entry


Spawn = Callable[[ModelEntry], ChildLike]


class Models:
    """The router's models and their children. All methods run on the router's event loop."""

    def __init__(self, entries: dict[str, ModelEntry], models_max: int, spawn: Spawn,
                 poll_s: float = 0.5) -> None:
        self.entries, self.models_max, self.spawn, self.poll_s = entries, models_max, spawn, poll_s
        self._admit = asyncio.Lock()  # one load at a time decides what to unload for room
        self._changed = asyncio.Event()
        self._monitor: asyncio.Task[None] | None = None

    def get(self, name: str) -> ModelEntry | None:
        return self.entries.get(name)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except TimeoutError:
            pass

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start watching children, and load the models marked load-on-startup."""
        self._monitor = asyncio.create_task(self._watch())
        for e in self.entries.values():
            if e.load_on_startup:
                self.load(e.name)

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
        await asyncio.gather(*(self.unload(e.name) for e in self.entries.values() if e.running),
                             return_exceptions=True)

    async def reload(self, fresh: dict[str, ModelEntry]) -> None:
        """`GET /models?reload=1`, as llama-server: a running model that was removed or whose
        path or flags changed is unloaded; models not running are added or updated."""
        for name, e in list(self.entries.items()):
            new = fresh.get(name)
            changed = new is None or (new.path, new.args) != (e.path, e.args)
            if e.running and changed:
                await self.unload(name)
            if new is None and e.in_flight == 0:
                del self.entries[name]
        for name, new in fresh.items():
            e = self.entries.get(name)
            if e is None:
                self.entries[name] = new
            elif not e.running:
                e.path, e.source, e.args, e.preset = new.path, new.source, new.args, new.preset
                e.stop_timeout_s = new.stop_timeout_s
        self._notify()

    # -- loading -------------------------------------------------------------------------
    def load(self, name: str) -> asyncio.Task[None]:
        """Start loading `name` (unloaded -> loading); the task ends once it is loaded or failed."""
        e = self.entries[name]
        if e.load_task is not None and not e.load_task.done():
            return e.load_task
        e.status, e.failed, e.exit_code, e.reason = "loading", False, None, ""
        e.last_used = time.monotonic()
        e.load_task = asyncio.create_task(self._load(e))
        self._notify()
        return e.load_task

    async def _load(self, e: ModelEntry) -> None:
        try:
            async with self._admit:
                await self._make_room(e)
                if e.stopping or e.status != "loading":
                    return
                child = self.spawn(e)
                e.child, e.child_args = child, child.argv()
            log.info("loading model %s: %s", e.name, " ".join(e.child_args))
            t0 = time.perf_counter()
            await child.start()
            if e.stopping:  # unloaded while it started (its stop may have come before Popen)
                await child.stop(e.stop_timeout_s)
                e.status, e.child = "unloaded", None
                return
            try:
                e.loaded_info = await child.info()
            except Exception as ex:  # the listing only misses the child's details
                log.warning("model %s: no /v1/models from its child: %s", e.name, ex)
                e.loaded_info = {}
            e.status = "loaded"
            log.info("model %s loaded in %.2f s (pid %d, %s)", e.name,
                     time.perf_counter() - t0, child.pid, child.url)
        except Exception as ex:
            child = e.child
            if e.stopping:  # unloaded while loading: not a failure
                e.status = "unloaded"
            else:
                e.status, e.failed = "unloaded", True
                e.exit_code = child.exit_code() if child is not None else None
                e.reason = ((child.failure_reason() if child is not None else "")
                            or (str(ex).splitlines() or [type(ex).__name__])[0])
                log.error("model %s failed to load (exit code %s): %s", e.name, e.exit_code,
                          e.reason)
            if child is not None:  # never left running, whatever ended the load
                await child.stop(e.stop_timeout_s)
            e.child = None
        finally:
            self._notify()

    async def _make_room(self, want: ModelEntry) -> None:
        """Unload least recently used idle models until `want` fits under --models-max; wait
        while every loaded model is serving a request."""
        while self.models_max > 0:
            if want.stopping or want.status != "loading":  # unloaded while it waited
                return
            # a model waiting for admission (loading, no child yet) takes no room yet
            running = [e for e in self.entries.values() if e is not want and (
                e.status == "loaded" or (e.status == "loading" and e.child is not None))]
            if len(running) < self.models_max:
                return
            idle = [e for e in running if e.status == "loaded" and e.in_flight == 0
                    and not e.stopping]
            if idle:
                victim = min(idle, key=lambda e: e.last_used)
                log.info("--models-max %d reached: unloading %s (least recently used) for %s",
                         self.models_max, victim.name, want.name)
                await self.unload(victim.name)
            else:
                await self._wait_change(self.poll_s)

    async def ensure_ready(self, e: ModelEntry, autoload: bool) -> None:
        """Wait until `e` is loaded, loading it first if `autoload` (the caller holds it, so
        it is not unloaded for room meanwhile). A load this request waited for and that
        failed is an error; one that failed earlier is tried again, as llama-server does."""
        waited = False
        while True:
            if e.status == "loaded" and not e.stopping:
                return
            if e.status == "unloaded" and not e.stopping:
                if waited and e.failed:
                    raise RouterError(500, f"model name={e.name} failed to load: {e.reason}")
                if not autoload:
                    raise RouterError(400, "model is not loaded")
                self.load(e.name)
            task = e.load_task
            if task is not None and not task.done():
                waited = True
                await asyncio.shield(task)
            else:
                await self._wait_change(self.poll_s)

    # -- unloading -----------------------------------------------------------------------
    async def unload(self, name: str) -> None:
        """Stop `name`'s child (a loading one too) and wait until it has exited."""
        e = self.entries[name]
        if e.stopping:
            while e.stopping:
                await self._wait_change(self.poll_s)
            return
        e.stopping = True
        self._notify()
        try:
            child = e.child
            if child is not None:
                log.info("unloading model %s (pid %d)", name, child.pid)
                await child.stop(e.stop_timeout_s)
            if e.load_task is not None and not e.load_task.done():
                await asyncio.gather(e.load_task, return_exceptions=True)
            e.status, e.child, e.loaded_info = "unloaded", None, {}
        finally:
            e.stopping = False
            self._notify()

    # -- requests ------------------------------------------------------------------------
    def hold(self, e: ModelEntry) -> None:
        e.in_flight += 1
        e.last_used = time.monotonic()

    def release(self, e: ModelEntry) -> None:
        e.in_flight -= 1
        e.last_used = time.monotonic()
        self._notify()

    # -- children that die ---------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            for e in self.entries.values():
                child = e.child
                if e.status != "loaded" or e.stopping or child is None:
                    continue
                code = child.exit_code()
                if code is None:
                    continue
                e.status, e.failed, e.exit_code, e.child, e.loaded_info = (
                    "unloaded", True, code, None, {})
                e.reason = f"the model's server exited with code {code}" + (
                    f" (signal {-code})" if code < 0 else f": {child.failure_reason()}")
                log.error("model %s: its child server (pid %d) exited with code %s", e.name,
                          child.pid, code)
                self._notify()
