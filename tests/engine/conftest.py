"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest

from radixserve.model.loader import Model, load_model


@pytest.fixture(scope="module")
def model() -> Model:
    """The default model in deterministic bf16: cached == uncached to the bit, so every tier's
    answer can be compared token for token (modules testing another model override this)."""
    m = load_model("default", "bf16", deterministic="on")
    assert m.deterministic
    return m
