"""Engine tests' fixtures: a tiny model made here (the engine itself: enginekit.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool_demo.tinymodel import TINY, make_model
from kvpool_sidecar.client import SidecarClient


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "tiny-llama", TINY)


@pytest.fixture
def sidecar(sidecar_factory) -> Iterator[tuple[str, SidecarClient]]:
    """A real sidecar process for the scheduler tests: its URL and a client."""
    proc = sidecar_factory("16Mi")
    client = SidecarClient(proc.info["url"], timeout=5)
    yield proc.info["url"], client
    client.close()


@pytest.fixture(autouse=True)
def made_schedulers_shut_down() -> Iterator[None]:
    """The schedulers a test made with schedkit.make_scheduler shut down when it ends."""
    yield
    if (schedkit := sys.modules.get("schedkit")) is not None:
        schedkit.shut_down_made()
