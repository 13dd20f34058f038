"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest

from radixserve.model.loader import Model, load_model


@pytest.fixture(scope="session")
def model() -> Model:
    """The default model in deterministic bf16: cached == uncached to the bit, so every tier's
    answer can be compared token for token (modules testing another model override this).

    Loaded once a session (~10-20 s a load on 2 cores): no engine test changes it (schedulers
    only read it; test_deterministic.py's mode-off model is a copy with its own Transformer
    over the same weights), so every module's fresh schedulers share it."""
    m = load_model("default", "bf16", deterministic="on")
    assert m.deterministic
    return m
