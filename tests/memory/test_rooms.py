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
