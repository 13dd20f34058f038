"""Every repository path the README and docs/ name (in backticks) exists: the map stays true
as code moves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATH = re.compile(r"`((?:radixserve|tests|scripts|docs)/[A-Za-z0-9_./-]*)`")


def named_paths() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for p in PATH.findall(doc.read_text()):
            out.setdefault(p.rstrip("/."), []).append(doc.name)
    return out


def test_docs_name_only_paths_that_exist() -> None:
    named = named_paths()
    assert len(named) > 40  # the architecture map and the README name files
    assert {p: docs for p, docs in named.items() if not (ROOT / p).exists()} == {}
