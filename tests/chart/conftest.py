"""Fixtures for the chart's checks: the pinned helm (fetched by scripts/get-helm.sh) and rendering."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from chartkit import CHART, HELM, render


@pytest.fixture(scope="session")
def helm() -> Path:
    """The pinned helm binary; scripts/get-helm.sh puts it in .tools/bin when it is missing."""
    if not HELM.exists():
        result = subprocess.run(
            ["bash", "scripts/get-helm.sh"], cwd=CHART.parents[1], capture_output=True, text=True
        )
        if result.returncode != 0:
            pytest.fail(f"scripts/get-helm.sh failed:\n{result.stderr}")
    return HELM


@pytest.fixture(scope="session")
def rendered(helm: Path) -> Callable[..., list[dict]]:
    """render(values_file=None, *--set pairs) -> the chart's objects (CRDs included), cached."""
    cache: dict[tuple, list[dict]] = {}

    def get(values_file: Path | None = None, *sets: str) -> list[dict]:
        key = (values_file, sets)
        if key not in cache:
            cache[key] = render(values_file, *sets)
        return cache[key]

    return get
