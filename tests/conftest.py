"""Shared fixtures: the real default model (pulled once into the user cache).

``EDGEKV_TEST_NGL`` (default 0) offloads the shared models' layers, their KV caches
included, to a GPU: ``EDGEKV_TEST_NGL=-1`` runs every test that uses them, the native
ops and attention checks among them, with the cache on the device (``bench/gpu.sh``;
``tests/test_gpu.py`` checks the cache really is there)."""

from __future__ import annotations

import os

import pytest
from _model_fixture import gemma3_fixture, smollm2_fixture  # noqa: F401  (registers the *_path fixtures)

NGL = int(os.environ.get("EDGEKV_TEST_NGL", "0"))


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """The loaded default model, shared by every test that only reads it."""
    from edgekv.llama import Model

    m = Model(smollm2_path, n_gpu_layers=NGL)
    yield m
    m.close()


@pytest.fixture(scope="session")
def gemma3(gemma3_path):
    """Gemma 3 270M loaded once: 18 layers, 15 of them sliding-window (an iSWA cache)."""
    from edgekv.llama import Model

    m = Model(gemma3_path, n_gpu_layers=NGL)
    yield m
    m.close()
