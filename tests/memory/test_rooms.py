"""The rooms' import rules, read from the code itself: memory/ imports nothing of engine/,
http/ or model/ (it receives what it needs as data and protocols); engine/ reaches the host and
disk tiers only through the manager (the contract `tiers/base.py` aside, the type of a host
cache a test injects) and the device pool only through the front door (memory/front.py, the
manager); a model family module (model/arch/) imports nothing of engine/ or http/.

The reader sees every import in a file (TYPE_CHECKING blocks and function bodies included),
resolves relative ones against the file's package (`from ..engine import x` in memory/a.py is
`radixserve.engine.x`), and takes `from pkg import name` as importing `pkg.name` (so
`from radixserve.memory import tiers` is `radixserve.memory.tiers`). Each rule is shown firing
on a planted file, so none of them can pass by reading nothing."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import pytest

import radixserve

PKG = Path(radixserve.__file__).parent


class Rule(NamedTuple):
    room: str  # a folder under radixserve/ (its files, recursively)
    forbidden: tuple[str, ...]  # module prefixes its files must not import
    allowed: tuple[str, ...] = ()  # prefixes excepted from those


# a new rule is one line here
RULES = {
    "memory": Rule("memory", ("radixserve.engine", "radixserve.http", "radixserve.model")),
    "engine-tiers": Rule("engine", ("radixserve.memory.tiers",),
                         ("radixserve.memory.tiers.base",)),  # the contract: what a cache is
    "arch": Rule("model/arch", ("radixserve.engine", "radixserve.http")),
    "engine-pool": Rule("engine", ("radixserve.memory.pool",)),  # the front door: memory/front.py
}


def module_name(path: Path, pkg: Path = PKG) -> str:
    """The dotted name of the module at `path`, a file under the package folder `pkg`."""
    parts = [pkg.name, *path.relative_to(pkg).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, module: str) -> list[str]:
    """Every module `path` (the module named `module`) imports, as absolute names: relative
    imports resolved against its package, `from m import a` read as `m.a` (a name imported
    from a module starts with the module's name, so a rule on the module sees it)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                assert node.level - 1 < len(up), f"{path}: import beyond the top package"
                base = ".".join(up[:len(up) - node.level + 1] + ([base] if base else []))
            out += [base if a.name == "*" else f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def room_files(room: str, pkg: Path = PKG) -> list[Path]:
    d = pkg / room
    return sorted(d.rglob("*.py")) if d.is_dir() else []


def breaches(rule: Rule, pkg: Path = PKG) -> dict[str, list[str]]:
    """The files of the rule's room that import what it forbids, with those imports."""
    out = {}
    for p in room_files(rule.room, pkg):
        bad = sorted({m for m in imports(p, module_name(p, pkg))
                      if under(m, rule.forbidden) and not under(m, rule.allowed)})
        if bad:
            out[str(p.relative_to(pkg))] = bad
    return out


def test_memory_imports_no_engine_http_or_model() -> None:
    assert len(room_files("memory")) >= 20  # the room is there: pool, tiers, the owner...
    assert breaches(RULES["memory"]) == {}


def test_engine_reaches_no_tier_but_through_the_manager() -> None:
    assert len(room_files("engine")) >= 5
    assert breaches(RULES["engine-tiers"]) == {}


def test_a_model_family_module_imports_no_engine_or_http() -> None:
    assert len(room_files("model/arch")) >= 4  # the registry, the base and the families
    assert breaches(RULES["arch"]) == {}


@pytest.mark.parametrize("rule, room, text, found", [
    ("memory", "memory/x.py",
     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    from radixserve.engine.slot import Slot\n", "radixserve.engine.slot.Slot"),
    ("memory", "memory/tiers/x.py", "def g():\n    import radixserve.model.loader\n",
     "radixserve.model.loader"),
    ("memory", "memory/tiers/x.py", "from ...engine import slot\n", "radixserve.engine.slot"),
    ("memory", "memory/pool/__init__.py", "from ...http.app import make_app\n",
     "radixserve.http.app.make_app"),
    ("memory", "memory/x.py", "from radixserve import model\n", "radixserve.model"),
    ("engine-tiers", "engine/x.py", "from radixserve.memory import tiers\n",
     "radixserve.memory.tiers"),
    ("engine-tiers", "engine/x.py", "from radixserve.memory.tiers import radix\n",
     "radixserve.memory.tiers.radix"),
    ("engine-tiers", "engine/x.py", "from ..memory.tiers.disk import DiskTier\n",
     "radixserve.memory.tiers.disk.DiskTier"),
    ("engine-pool", "engine/x.py", "from ..memory.pool.swa import SWAPool\n",
     "radixserve.memory.pool.swa.SWAPool"),
    ("engine-pool", "engine/x.py", "from radixserve.memory import pool\n",
     "radixserve.memory.pool"),
    ("arch", "model/arch/x.py", "from ...engine.batch import forward\n",
     "radixserve.engine.batch.forward"),
    ("arch", "model/arch/x.py", "from radixserve import http\n", "radixserve.http"),
    ("arch", "model/arch/x.py", "import radixserve.engine.scheduler as s\n",
     "radixserve.engine.scheduler"),
], ids=["type-checking", "function-body", "relative", "relative-init", "package",
        "tiers-package", "tier-module", "tier-relative", "pool-relative", "pool-package",
        "arch-relative", "arch-package",
        "arch-absolute"])
def test_each_rule_fires_on_a_planted_import(tmp_path: Path, rule: str, room: str, text: str,
                                             found: str) -> None:
    """One planted file per case, in a package tree of its own laid out as radixserve/ is: the
    rule's check reports exactly that file and that import."""
    pkg = tmp_path / "radixserve"
    plant = pkg / room
    plant.parent.mkdir(parents=True)
    plant.write_text(text)
    assert breaches(RULES[rule], pkg) == {room: [found]}


def test_the_exceptions_and_neighbours_pass(tmp_path: Path) -> None:
    """What a rule allows stays allowed (so the plants above fail for their import alone):
    the tiers' contract, a module whose name merely starts like a forbidden one, and a
    relative import that stays inside the room."""
    pkg = tmp_path / "radixserve"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "engine" / "x.py").write_text(
        "from radixserve.memory.tiers.base import PromptCache\n"
        "from ..memory.tiers import base\nfrom radixserve.memory import manager\n")
    (pkg / "memory").mkdir()
    (pkg / "memory" / "x.py").write_text("from .tiers import radix\nimport radixserve.modelx\n")
    assert breaches(RULES["engine-tiers"], pkg) == {}
    assert breaches(RULES["memory"], pkg) == {}
    assert imports(pkg / "memory" / "x.py", "radixserve.memory.x") == [
        "radixserve.memory.tiers.radix", "radixserve.modelx"]


def pool_names() -> set[str]:
    """The names that are the device memory's insides: every class pool/ and layout.py define
    but the exceptions (OutOfCells is what the front door hands the engine to catch)."""
    names = set()
    for p in [*(PKG / "memory" / "pool").glob("*.py"), PKG / "memory" / "layout.py"]:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and not any(
                    getattr(b, "id", "").endswith("Error") for b in node.bases):
                names.add(node.name)
    return names


def pool_reach(found: dict[str, list[str]], names: set[str]) -> dict[str, list[str]]:
    """Per file, the imports that reach into the pool: a module of memory/pool/, or a pool or
    layout class by name from anywhere."""
    bad = {f: sorted({m for m in mods if m.startswith("radixserve.memory.pool")
                      or m.rsplit(".", 1)[-1] in names})
           for f, mods in found.items()}
    return {f: m for f, m in bad.items() if m}


def test_engine_reaches_the_pool_only_through_the_front_door(tmp_path: Path) -> None:
    """engine/ builds, holds and attaches to a pool through memory/front.py and the manager:
    no module of memory/pool/ and no pool or layout class is imported there (so what kind of
    memory a model has is asked of its layout, never tested by class). The rule fires on a
    planted import."""
    names = pool_names()
    assert {"KVPool", "SWAPool", "ConvPool", "DraftRows", "MemoryLayout"} <= names
    assert "OutOfCells" not in names
    engine = {str(p.relative_to(PKG)): imports(p, module_name(p)) for p in room_files("engine")}
    assert len(engine) >= 5 and pool_reach(engine, names) == {}
    assert breaches(RULES["engine-pool"]) == {}
    planted = tmp_path / "x.py"
    planted.write_text("def g():\n    from radixserve.memory.pool.swa import SWAPool\n"
                       "import radixserve.memory.pool.factory\n")
    assert pool_reach({"x.py": imports(planted, "radixserve.engine.x")}, names) == {"x.py": [
        "radixserve.memory.pool.factory", "radixserve.memory.pool.swa.SWAPool"]}
    assert pool_reach({"y.py": ["radixserve.memory.front.KVPool"]}, names) == {
        "y.py": ["radixserve.memory.front.KVPool"]}
