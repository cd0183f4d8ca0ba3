"""The real-control-plane tier (marker `apiserver`): one control plane for the session, the CRD
installed by the chart's own helm install (session fixture `release`), and helpers to read objects."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kubeharness.controlplane import ControlPlane, crd_established, have_binaries, kubectl_binary
from kubeharness.objects import CRD_PATH
from kvtest import need, wait_until


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent == here:
            item.add_marker(pytest.mark.apiserver)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    need(have_binaries(), "the control plane's binaries (bash scripts/get-k8s.sh) and openssl")
    need(kubectl_binary().exists(), "kubectl (bash scripts/get-helm.sh)")
    cp = ControlPlane(tmp_path_factory.mktemp("controlplane")).start()
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def crd_installed(control_plane: ControlPlane) -> ControlPlane:
    """The CRD applied with `kubectl apply -f crds/` and Established."""
    control_plane.kubectl("apply", "-f", str(CRD_PATH))
    wait_until(lambda: crd_established(control_plane), 60, "the KVCachePool CRD to be Established")
    return control_plane
