"""The command line: `generate` prints a completion and a speed line; `serve` takes
llama-server's command line (exit codes and messages here; every flag in test_flags.py)."""

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


def test_serve_help_and_bad_command_lines():
    """`serve --help` exits 0 with the defaults; a bad command line exits 1 naming the flag
    (what each flag does is tested in test_flags.py, from llama-server's own help)."""
    r = cli("serve", "--help")
    assert r.returncode == 0 and "(default: 0.1)" in r.stdout and "(default: 8080)" in r.stdout
    r = cli("serve", "-n", "gl")
    assert r.returncode == 1 and "-n: expected an integer, got 'gl'" in r.stderr
    r = cli("serve", "--ctx", "512")
    assert r.returncode == 1 and "invalid argument: --ctx" in r.stderr


def test_weights_choices_are_the_loaders_modes():
    """--weights (config.WEIGHTS) offers exactly what the loader takes (the loader reads no
    settings module: model/ sits below config.py)."""
    from radixserve.config import WEIGHTS
    from radixserve.model.loader import WEIGHT_MODES

    assert WEIGHTS == WEIGHT_MODES
