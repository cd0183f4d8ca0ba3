"""Checks shared by the API-server tier and the kind suite: what an injected pod must look like."""

from __future__ import annotations

import json
from typing import Any


def sidecar_of(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod's kvpool-sidecar (a native sidecar, or a plain container in legacy mode)."""
    containers = pod["spec"].get("initContainers", []) + pod["spec"]["containers"]
    (sidecar,) = [c for c in containers if c["name"] == "kvpool-sidecar"]
    return sidecar


def connector_config(pod: dict[str, Any], container: str) -> dict[str, Any]:
    (vllm,) = [c for c in pod["spec"]["containers"] if c["name"] == container]
    args = vllm.get("args", [])
    assert "--kv-transfer-config" in args, f"{pod['metadata']['name']}: no --kv-transfer-config in {args}"
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def assert_injected(pod: dict[str, Any], pool: dict[str, Any], container: str) -> None:
    """The pod carries the pool's native sidecar, the shared-memory arena and exactly the published config."""
    name = pool["metadata"]["name"]
    assert pod["metadata"]["labels"]["kvpool.dev/pool"] == name
    sidecar = sidecar_of(pod)
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar: vLLM starts after its cache
    config = connector_config(pod, container)
    published = pool["status"]["connectorConfig"]
    assert config == (json.loads(published) if isinstance(published, str) else published)
    assert config["kv_connector"] == "KVPoolConnector" and config["kv_load_failure_policy"] == "recompute"
    assert config["kv_connector_extra_config"]["pool"] == f"{pool['metadata']['namespace']}/{name}"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["kvpool-arena"]["emptyDir"]["medium"] == "Memory"


def untouched(pod: dict[str, Any]) -> bool:
    containers = pod["spec"]["containers"] + pod["spec"].get("initContainers", [])
    return all(c["name"] != "kvpool-sidecar" for c in containers) and not any(
        "--kv-transfer-config" in c.get("args", []) for c in containers
    )
