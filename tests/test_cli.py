"""The command line: `generate` prints a completion and a speed line; `serve --help` lists
llama-server's flags with their defaults."""

from __future__ import annotations

import subprocess
import sys


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "radixserve.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_is_greedy_and_reports_speed(tiny_path):
    a = cli("generate", "-m", tiny_path, "--dtype", "f32", "--temp", "0", "-n", "12", "Hello")
    b = cli("generate", "-m", tiny_path, "--dtype", "f32", "--temp", "0", "-n", "12", "Hello")
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.strip()
    assert "prompt:" in a.stderr and "generation: 12 tokens" in a.stderr


def test_generate_reports_a_missing_model():
    r = cli("generate", "-m", "/nonexistent.gguf", "hi")
    assert r.returncode == 1 and "not found" in r.stderr


def test_serve_help_lists_llama_server_flags():
    out = cli("serve", "--help").stdout
    for flag in ("--ctx-size", "--parallel", "--kv-unified", "--kv-unified-per-slot",
                 "--batch-size", "--ubatch-size", "--slot-prompt-similarity", "--cache-reuse",
                 "--threads", "--api-key", "--no-slots", "--metrics", "--alias", "--cache-ram",
                 "--cache-radix-prompt", "--slot-save-path", "--log-verbosity"):
        assert flag in out, flag
    assert "(default: 0.1)" in out and "(default: 8080)" in out
