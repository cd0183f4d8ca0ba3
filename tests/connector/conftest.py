"""Engine tests' fixtures: a tiny model made here (the engine itself: enginekit.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool_connector.tinymodel import TINY, make_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "tiny-llama", TINY)
