"""Shared fixtures: the real default model (pulled once into the user cache)."""

from __future__ import annotations

import pytest
from _model_fixture import gemma3_fixture, smollm2_fixture  # noqa: F401  (registers the *_path fixtures)


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """The loaded default model, shared by every test that only reads it."""
    from edgekv.llama import Model

    m = Model(smollm2_path)
    yield m
    m.close()


@pytest.fixture(scope="session")
def gemma3(gemma3_path):
    """Gemma 3 270M loaded once: 18 layers, 15 of them sliding-window (an iSWA cache)."""
    from edgekv.llama import Model

    m = Model(gemma3_path)
    yield m
    m.close()
