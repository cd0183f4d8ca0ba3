from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from kubeapi import KubeAPI, MemoryGauge, OperatorThread, listening
from kvtest import REPO, free_port, wait_until

CRD_PATH = REPO / "crds" / "kvcachepool.yaml"
SCALE_COOLDOWN = 3600  # tests move status.sharedTier.lastScaleTime back instead of waiting out a cooldown


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


@dataclass
class Cluster:
    api: KubeAPI
    operator: OperatorThread
    memory: MemoryGauge
    webhook_url: str


@pytest.fixture(scope="session")
def cluster(crd: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """kmock plus one real operator (webhook on plain HTTP) for all the operator's scenario tests."""
    api = KubeAPI(crd)
    api.create(
        "/apis/kopf.dev/v1/clusterkopfpeerings",
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "kvpool"}},
    )
    kubeconfig = api.kubeconfig(tmp_path_factory.mktemp("kube") / "config")
    memory = MemoryGauge()
    port = free_port()
    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(kubeconfig)
    argv = [
        "--webhook-insecure",
        "--webhook-addr",
        "127.0.0.1",
        "--webhook-port",
        str(port),
        "--stats-interval",
        "0.5",
        "--scale-cooldown",
        str(SCALE_COOLDOWN),
        "--sidecar-image",
        "kvpool/sidecar:test",
        "--liveness",
        "",
    ]
    operator = OperatorThread(argv, memory)
    try:
        wait_until(lambda: operator.ready_flag.is_set() or operator.error, 60, "the operator to start")
        assert operator.error is None, operator.error
        wait_until(lambda: listening(port), 30, "the webhook server")
        yield Cluster(api, operator, memory, f"http://127.0.0.1:{port}/kvpool-inject")
    finally:
        operator.stop()
        api.stop()
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old
        assert operator.error is None, operator.error


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    del items  # nothing to reorder: every scenario works in its own namespace
