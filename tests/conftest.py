"""Shared fixtures: the real default model (pulled once into the user cache)."""

from __future__ import annotations

import pytest
from _model_fixture import smollm2_fixture  # noqa: F401  (registers the smollm2_path fixture)


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """The loaded default model, shared by every test that only reads it."""
    from edgekv.llama import Model

    m = Model(smollm2_path)
    yield m
    m.close()
