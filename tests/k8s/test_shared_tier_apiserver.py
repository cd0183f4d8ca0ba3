"""The shared Redis tier's scaling on the real API server, with real sidecars (review D6, #21 item 3):
sized by what the pool's pods share, not by their arenas; up at once through an hour's cooldown; a
shrink whose sidecars never confirm the drain gives up after the drain timeout, and says why.

Its own release of the chart: an hour's cooldown and a 5 s drain timeout (test_operator_apiserver.py's
has neither)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubeharness.controlplane import ControlPlane, get_json
from kubeharness.objects import pool_manifest
from kubeharness.operatorkit import (
    LocalOperator,
    all_ready,
    apply,
    namespace,
    one_replica_release,
    pods_of,
    pool_status,
    restricted_deployment,
)
from kvtest import Proc, start_sidecar, wait_until

from kvpool_sidecar.client import SidecarClient

TIER = "cache-kvpool-redis"
CHUNK = 4096


@pytest.fixture(scope="module")
def operator(
    crd_installed: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ControlPlane, LocalOperator]]:
    values = ("operator.statsIntervalSeconds=1", "operator.scaleCooldownSeconds=3600",
              "operator.drainTimeoutSeconds=5")  # fmt: skip
    with one_replica_release(crd_installed, tmp_path_factory.mktemp("operator"), *values) as op:
        yield crd_installed, op


def test_the_tier_is_sized_by_what_pods_share_grows_at_once_and_a_drain_gives_up(
    operator: tuple, tmp_path: Path
) -> None:
    cp, _ = operator
    ns = namespace(cp, "shared-sizing")
    spec = {"selector": {"matchLabels": {"app": "vllm"}}, "capacity": "1Gi", "vllmContainer": "vllm",
            "backend": "redis", "redis": {"mode": "shared", "replicas": 1, "memory": "128Mi"},
            "scaling": {"minReplicas": 1, "maxReplicas": 1}}  # fmt: skip
    apply(cp, pool_manifest(ns, "cache", spec))
    apply(cp, restricted_deployment(ns, replicas=2))
    vllm = wait_until(lambda: all_ready(pods_of(cp, ns), 2), 90, "two vLLM pods")
    shared = lambda: pool_status(cp, ns, "cache").get("sharedTier") or {}  # noqa: E731
    sidecars: list[tuple[Proc, Path]] = []
    try:
        # each pod's real sidecar, on its address and status port, reading the shard list from a file
        for pod in vllm:
            urls = tmp_path / pod["metadata"]["name"] / "redis-urls"
            urls.parent.mkdir()
            _kubelet_refresh(cp, ns, urls)
            port = pod["metadata"]["annotations"]["kvpool.dev/status-port"]
            proc = start_sidecar(urls.parent, "16Mi", [], "--status-host", pod["status"]["podIP"],
                                 "--status-port", port, "--redis-urls-file", str(urls))  # fmt: skip
            sidecars.append((proc, urls))
            _serve_one_prompt(proc)  # both pods serve the same 40 chunks

        # 2 pods x 1 GiB would ask 2 GiB (four shards of 89.6 MiB); they share 40 x 4 KiB. (Up to four
        # only once both sidecars answer: until then the operator sizes by the arenas, as it must blind.)
        wait_until(lambda: (pool_status(cp, ns, "cache").get("stats") or {}).get("sidecars") == 2, 60,
                   "both sidecars read")  # fmt: skip
        cp.kubectl(
            "-n", ns, "patch", "kvp", "cache", "--type=merge", "-p", '{"spec":{"scaling":{"maxReplicas":4}}}'
        )
        tier = wait_until(lambda: (s := shared()).get("workingSetBytes") and s, 60, "the working set")
        assert abs(tier["workingSetBytes"] - 40 * CHUNK) < 0.05 * 40 * CHUNK
        assert tier["demandBytes"] == math.ceil(tier["workingSetBytes"] * 1.25)
        assert tier["replicas"] == 1 and _statefulset(cp, ns)["spec"]["replicas"] == 1

        # up at once: sized by the arenas now, a change a moment ago and an hour's cooldown
        _last_scale(cp, ns, "2099-01-01T00:00:00Z")  # in the future: the cooldown holds for ever
        _size_by(cp, ns, "arenas")
        wait_until(lambda: _statefulset(cp, ns)["spec"]["replicas"] == 4, 30, "four shards at once")
        wait_until(lambda: shared().get("publishedShards") == 4, 60, "four shards ready and published")
        for _, urls in sidecars:
            _kubelet_refresh(cp, ns, urls)
        for proc, _ in sidecars:
            wait_until(lambda p=proc: _shards_in_use(p) == 4, 30, "the sidecars on four shards")

        # down, one shard per cooldown: the fourth is unpublished first; the sidecars never read the shorter
        # list (a kubelet that does not refresh the ConfigMap volume), so nothing confirms the drain
        _size_by(cp, ns, "workingSet")
        _last_scale(cp, ns, "2000-01-01T00:00:00Z")  # the cooldown over
        draining = wait_until(lambda: (s := shared()).get("draining") and s, 60, "the shrink draining")
        assert draining["publishedShards"] == 3 and draining["replicas"] == 4 and draining["drainingSince"]
        wait_until(lambda: _statefulset(cp, ns)["spec"]["replicas"] == 3, 30, "the drain to give up")
        gave_up = wait_until(lambda: shared().get("drainGaveUp"), 30, "status.sharedTier.drainGaveUp")
        assert gave_up.startswith("stopped 1 shard(s) after") and "sidecar(s)" in gave_up, gave_up
        said = "shared Redis tier: stopped 1 shard(s) after"  # among the problems Degraded lists
        degraded = wait_until(lambda: _condition(cp, ns, "Degraded", said), 30, "Degraded saying so")
        assert degraded["status"] == "True"
        warnings = get_json(cp, "-n", ns, "events", "--field-selector", "reason=DrainGaveUp")["items"]
        assert warnings and warnings[0]["type"] == "Warning"
    finally:
        for proc, _ in sidecars:
            proc.stop()
    cp.kubectl("-n", ns, "delete", "kvp", "cache", "--wait=true", "--timeout=60s")


def _serve_one_prompt(proc: Proc) -> None:
    client = SidecarClient(proc.info["url"])
    keys = [f"{i:032x}" for i in range(40)]
    for key in keys:
        assert client.put(key, b"x" * CHUNK)
    assert client.lookup(keys) == 40
    client.close()


def _shards_in_use(proc: Proc) -> int:
    return SidecarClient(proc.info["url"]).stats()["tiers"]["redis"]["shards"]


def _statefulset(cp: ControlPlane, ns: str) -> dict[str, Any]:
    return get_json(cp, "-n", ns, "statefulset", TIER)


def _size_by(cp: ControlPlane, ns: str, rule: str) -> None:
    cp.kubectl(
        "-n",
        ns,
        "patch",
        "kvp",
        "cache",
        "--type=merge",
        "-p",
        f'{{"spec":{{"scaling":{{"sizeBy":"{rule}"}}}}}}',
    )


def _last_scale(cp: ControlPlane, ns: str, when: str) -> None:
    cp.kubectl("-n", ns, "annotate", "statefulset", TIER, f"kvpool.dev/last-scale-time={when}", "--overwrite")


def _kubelet_refresh(cp: ControlPlane, ns: str, path: Path) -> None:
    """What the kubelet does for a ConfigMap volume: the pool's shard list, written to the pod's file."""
    path.write_text(get_json(cp, "-n", ns, "configmap", "cache-kvpool")["data"]["redis-urls"])


def _condition(cp: ControlPlane, ns: str, kind: str, saying: str) -> dict[str, Any] | None:
    found = pool_status(cp, ns, "cache").get("conditions") or []
    return next((c for c in found if c["type"] == kind and saying in c.get("message", "")), None)
