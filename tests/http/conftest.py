"""The tiny model the in-process HTTP tests run their app over (tests/http/test_app.py)."""

from __future__ import annotations

import pytest

from radixserve.model.loader import Model, load_model


@pytest.fixture(scope="module")
def model(tiny_path: str) -> Model:
    return load_model(tiny_path, dtype="f32")
