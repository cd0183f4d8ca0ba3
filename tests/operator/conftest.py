from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubeharness.emulator import Cluster, MemoryGauge, operator_on_kmock
from kubeharness.objects import CRD_PATH, port_open
from kvtest import free_port, wait_until

SCALE_COOLDOWN = 3600  # tests move status.sharedTier.lastScaleTime back instead of waiting out a cooldown
DRAIN_TIMEOUT = 3  # seconds a shrink waits on sidecars that never confirm (the default is 10 minutes)


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture(scope="session")
def cluster(crd: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """kmock plus one real operator (webhook on plain HTTP) for all the operator's scenario tests."""
    memory = MemoryGauge()
    port = free_port()
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
        "--drain-timeout",
        str(DRAIN_TIMEOUT),
        "--sidecar-image",
        "kvpool/sidecar:test",
        "--liveness",
        "",
        "--readiness",
        "",
    ]
    with operator_on_kmock(crd, tmp_path_factory.mktemp("kube"), argv, memory) as (api, operator):
        wait_until(lambda: port_open("127.0.0.1", port), 30, "the webhook server")
        yield Cluster(api, operator, memory, f"http://127.0.0.1:{port}/kvpool-inject")
