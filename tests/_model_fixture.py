"""Session fixture: the real default model, pulled into the real cache.

Pulling into ``models_dir()`` (not a temp dir) means a developer or CI runner
downloads SmolLM2 once and every later test run reuses it; ``pull`` is
idempotent and verifies the sha256 (cached by a marker) each time.

Use from a test module or conftest with::

    from _model_fixture import smollm2_fixture  # noqa: F401

The fixture is registered under the name ``smollm2_path`` whatever it is
imported as, so test arguments do not shadow the import.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from edgekv.models import DEFAULT_MODEL, pull


@pytest.fixture(scope="session", name="smollm2_path")
def smollm2_fixture() -> Path:
    """Path of the verified SmolLM2-135M Q4_1 GGUF (downloads ~93 MB on first use)."""
    return pull(DEFAULT_MODEL, progress=False)


@pytest.fixture(scope="session", name="gemma3_path")
def gemma3_fixture() -> Path:
    """Path of the verified Gemma 3 270M Q4_K_M GGUF (an iSWA model; ~241 MB on first use)."""
    return pull("gemma3-270m", progress=False)
