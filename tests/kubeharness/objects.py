"""What both tiers of the harness read and write: a pool's manifest, API paths, conditions, Secret
values, kubeconfigs, and whether a port accepts connections."""

from __future__ import annotations

import base64
import json
import socket
from pathlib import Path
from typing import Any

from kvtest import REPO

CRD_PATH = REPO / "crds" / "kvcachepool.yaml"  # the KVCachePool CRD both tiers install


def pool_manifest(namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "kvpool.dev/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def pool_path(namespace: str, name: str | None = None) -> str:
    path = f"/apis/kvpool.dev/v1alpha1/namespaces/{namespace}/kvcachepools"
    return f"{path}/{name}" if name else path


def core_path(namespace: str, plural: str, name: str | None = None) -> str:
    path = f"/api/v1/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


def apps_path(namespace: str, plural: str, name: str | None = None) -> str:
    path = f"/apis/apps/v1/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


def condition(obj: dict[str, Any], kind: str) -> str | None:
    """The status ("True", "False", ...) of the object's condition `kind`; None if it has none."""
    for c in obj.get("status", {}).get("conditions", []):
        if c["type"] == kind:
            return c["status"]
    return None


def secret_value(secret: dict[str, Any], key: str) -> str:
    return base64.b64decode(secret["data"][key]).decode()


def write_kubeconfig(path: Path, server: str, user: dict[str, str], ca: str | None = None) -> Path:
    """A kubeconfig for `server` as `user` (a token, or a client certificate and key), trusting `ca`."""
    cluster = {"server": server, **({"certificate-authority": ca} if ca else {})}
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "kvpool-test",
        "clusters": [{"name": "kvpool-test", "cluster": cluster}],
        "users": [{"name": "user", "user": user}],
        "contexts": [{"name": "kvpool-test", "context": {"cluster": "kvpool-test", "user": "user"}}],
    }  # fmt: skip
    path.write_text(json.dumps(config))
    return path


def port_open(host: str, port: int) -> bool:
    """True once something accepts connections on host:port (kopf starts its webhook server after it
    reports ready; a local operator serves on its pod's address)."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False
