"""Router mode's figures (docs/PERFORMANCE.md, "Router mode"): a model's load time, the first
token of its first request after /models/load and after autoload against warm requests (and a
plain single-model server's), and the children's RSS before and after an unload.

Run from the repository root, with nothing else loading the machine:
    .venv/bin/python scripts/router-figures.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from radixserve.model.default_model import default_model_path, gemma3_model_path  # noqa: E402
from tests.http.harness import ServerProcess  # noqa: E402
from tests.router.test_router_e2e import (child_pid, children, first_token_s,  # noqa: E402
                                          wait_status)

COMMON = ["-c", "2048", "-np", "2"]
PROMPTS = ["Tell me a joke.", "Tell me a fact.", "Tell me a poem.", "Tell me a riddle.",
           "Tell me a tale."]


def warm(url: str, name: str) -> float:
    return statistics.median(first_token_s(url, name, p) for p in PROMPTS) * 1000


def main() -> None:
    out: dict[str, float] = {}
    paths = {"smollm2": default_model_path(), "gemma3": gemma3_model_path()}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "models"
        d.mkdir()
        for name, path in paths.items():
            (d / f"{name}.gguf").symlink_to(path)
        with ServerProcess(["--models-dir", str(d), *COMMON], Path(tmp) / "router.log") as r:
            u = r.url
            t0 = time.perf_counter()
            httpx.post(u + "/models/load", json={"model": "smollm2"})
            wait_status(u, "smollm2", "loaded")
            out["smollm2: /models/load until loaded, s"] = time.perf_counter() - t0
            out["smollm2: first token, first request after load, ms"] = first_token_s(
                u, "smollm2", "Tell me a story.") * 1000
            out["smollm2: first token, warm (median of 5), ms"] = warm(u, "smollm2")
            out["gemma3: first token, first request (autoload), ms"] = first_token_s(
                u, "gemma3", "Tell me a story.") * 1000
            out["gemma3: first token, warm (median of 5), ms"] = warm(u, "gemma3")
            before = children(r.pid)
            child_pid(u, "gemma3")
            httpx.post(u + "/models/unload", json={"model": "gemma3"}, timeout=60)
            wait_status(u, "gemma3", "unloaded")
            after = children(r.pid)
            out["children RSS, both loaded, MiB"] = sum(before.values()) / 2**20
            out["children RSS after unloading gemma3, MiB"] = sum(after.values()) / 2**20
            out["router process RSS, MiB"] = psutil.Process(r.pid).memory_info().rss / 2**20
        for name, path in paths.items():
            with ServerProcess([*COMMON, "-m", path, "--alias", name],
                               Path(tmp) / f"{name}.log") as s:
                first_token_s(s.url, name, "Tell me a story.")
                out[f"{name}: plain server, first token, warm (median of 5), ms"] = warm(
                    s.url, name)
    for k, v in out.items():
        print(f"{k}: {v:,.1f}")


if __name__ == "__main__":
    main()
