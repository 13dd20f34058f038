"""The memory room's import rules, read from the code itself: memory/ imports nothing of
engine/, http/ or model/ (it receives what it needs as data and protocols), and engine/ reaches
the host and disk tiers only through the manager (the contract `tiers/base.py` aside, the type
of a host cache a test injects)."""

from __future__ import annotations

import ast
from pathlib import Path

import radixserve

PKG = Path(radixserve.__file__).parent


def imports(path: Path) -> list[str]:
    """Every module `path` imports, TYPE_CHECKING blocks and function bodies included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def room_imports(room: str) -> dict[str, list[str]]:
    return {str(p.relative_to(PKG)): imports(p) for p in sorted((PKG / room).rglob("*.py"))}


def test_memory_imports_no_engine_http_or_model() -> None:
    found = room_imports("memory")
    assert len(found) >= 20  # the room is there: pool, tiers, the owner, the planner...
    bad = {f: [m for m in mods if m.startswith(("radixserve.engine", "radixserve.http",
                                                   "radixserve.model"))]
           for f, mods in found.items()}
    assert {f: m for f, m in bad.items() if m} == {}


def test_engine_reaches_no_tier_but_through_the_manager() -> None:
    tiers = {f"radixserve.memory.tiers.{p.stem}" for p in (PKG / "memory" / "tiers").glob("*.py")}
    tiers.discard("radixserve.memory.tiers.base")  # the contract: what a host cache is
    tiers.discard("radixserve.memory.tiers.__init__")
    bad = {f: sorted({m for m in mods if m in tiers or m.rsplit(".", 1)[0] in tiers})
           for f, mods in room_imports("engine").items()}
    assert {f: m for f, m in bad.items() if m} == {}


def test_the_rules_see_a_planted_import(tmp_path: Path) -> None:
    """The reader finds imports anywhere in a file (so the two tests above can fail)."""
    f = tmp_path / "x.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                 "    from radixserve.engine.slot import Slot\n"
                 "def g():\n    import radixserve.model.loader\n")
    assert "radixserve.engine.slot" in imports(f)
    assert "radixserve.model.loader" in imports(f)


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
    assert pool_reach(room_imports("engine"), names) == {}
    planted = tmp_path / "x.py"
    planted.write_text("def g():\n    from radixserve.memory.pool.swa import SWAPool\n"
                       "import radixserve.memory.pool.factory\n")
    assert pool_reach({"x.py": imports(planted)}, names) == {"x.py": [
        "radixserve.memory.pool.factory", "radixserve.memory.pool.swa",
        "radixserve.memory.pool.swa.SWAPool"]}
    assert pool_reach({"y.py": ["radixserve.memory.front.KVPool"]}, names) == {
        "y.py": ["radixserve.memory.front.KVPool"]}
