from __future__ import annotations

import json

from conftest import Cluster
from kubeapi import core_path, pool_path
from kvtest import wait_until


def test_cpu_pool_gets_configmap_and_ready_status(cluster: Cluster) -> None:
    api = cluster.api
    api.create(pool_path("cpu"), {
        "apiVersion": "kvpool.dev/v1alpha1", "kind": "KVCachePool",
        "metadata": {"name": "p", "namespace": "cpu"},
        "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "capacity": "1Gi"},
    })  # fmt: skip
    cm = wait_until(lambda: api.get(core_path("cpu", "configmaps", "p-kvpool")), 30, "the ConfigMap")
    print(json.dumps(cm, indent=1))
    pool = wait_until(
        lambda: (p := api.get(pool_path("cpu", "p"))) and p.get("status", {}).get("connectorConfig") and p,
        30,
        "status",
    )
    print(json.dumps(pool, indent=1))
