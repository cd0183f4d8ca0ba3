"""`helm lint --strict` over the default values and every example values file; the values schema
refuses what the chart cannot render sensibly."""

from __future__ import annotations

from pathlib import Path

import pytest
from chartkit import CHART, EXAMPLE_VALUES, kube_version, run_helm


def test_there_are_example_values() -> None:
    assert len(EXAMPLE_VALUES) >= 3, EXAMPLE_VALUES


@pytest.mark.parametrize("values_file", [None, *EXAMPLE_VALUES], ids=lambda p: p.name if p else "defaults")
def test_lint_strict(helm: Path, values_file: Path | None) -> None:
    args = ["lint", "--strict", str(CHART), *kube_version(values_file)]
    args += ["--values", str(values_file)] if values_file else []
    result = run_helm(*args)
    assert result.returncode == 0, result.stdout + result.stderr


BAD_VALUES = {
    "webhook.failurePolicy=Sometimes": "failurePolicy",
    "webhook.timeoutSeconds=60": "timeoutSeconds",
    "replicaCount=-1": "replicaCount",
    "watch.allNamespaces=false": "namespaces",
    "image.pullPolicy=Often": "pullPolicy",
    "operator.peering=Not_A_Name": "peering",
    "podMonitor.interval=soon": "interval",
    "unknownKey=1": "unknownKey",
}


@pytest.mark.parametrize("setting", BAD_VALUES)
def test_schema_refuses(helm: Path, setting: str) -> None:
    result = run_helm("lint", "--strict", str(CHART), "--set", setting)
    assert result.returncode != 0, f"{setting} was accepted"
    assert BAD_VALUES[setting] in result.stdout + result.stderr
