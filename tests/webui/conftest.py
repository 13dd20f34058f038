"""Headless Chromium for the page's tests: Debian's binary (scripts/setup.sh installs it),
driven by Playwright. If Chromium is missing the tests fail naming why; they never skip."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# screenshots land here (CI keeps the clone's directory); RADIXSERVE_TEST_OUTPUT moves them
OUTPUT = Path(os.environ.get("RADIXSERVE_TEST_OUTPUT", ROOT / "test-output")) / "webui"
# what the machine's probe found Chromium needs here: no sandbox as root, and no background
# connections (the network is closed: they fail by the dozen and slow the start)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        log = ROOT / ".venv" / "chromium-install.log"
        why = (f"the install failed:\n{log.read_text()[-2000:]}" if log.exists() else
               "scripts/setup.sh test installs it with apt-get (root only)")
        pytest.fail(f"Chromium is not installed, so the page cannot be tested: {why}",
                    pytrace=False)
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """Chromium, for one module. Not a session: Playwright's sync API keeps an asyncio loop
    running in this thread while it is open, and every later test that calls asyncio.run()
    (the bench client, the engine, the in-process app) would fail with "cannot be called from
    a running event loop"."""
    from playwright.sync_api import sync_playwright

    path = chromium_path()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="session")
def output_dir() -> Path:
    OUTPUT.mkdir(parents=True, exist_ok=True)
    return OUTPUT
