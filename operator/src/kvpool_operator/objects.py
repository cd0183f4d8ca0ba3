"""The objects a pool owns, as manifests (pure functions): its ConfigMap and, for a shared Redis
tier, the password Secret, the headless Service and the StatefulSet of shards.

All carry an ownerReference to the pool (controller, blockOwnerDeletion), so deleting the pool
deletes them through the API server's garbage collector.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Mapping
from typing import Any

from kvpool_operator import names
from kvpool_operator.pool import Pool
from kvpool_operator.quantity import parse_quantity

# Redis's memory beyond maxmemory: allocator fragmentation under kvpool's write pattern (chunks of 64 KiB
# to 5 MiB, evicted and rewritten) measured 1.18-1.28, plus the query buffer of the HSET being written.
# At 0.9 a shard peaked at 1.13x its limit (OOM-killed); at 0.7, 0.84x (tests/operator/test_redis_memory.py).
REDIS_MAXMEMORY_FRACTION = 0.7
REDIS_UID = 999  # the uid of the redis user in the official image


def owner_reference(pool_body: Mapping[str, Any]) -> dict[str, Any]:
    meta = pool_body["metadata"]
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(name: str, pool: Pool, component: str, owner: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": pool.namespace,
        "labels": names.owned_labels(pool.name, component),
        "ownerReferences": [dict(owner)],
    }


def config_map(
    pool: Pool, owner: Mapping[str, Any], config_text: str, shard_urls: list[str] | None
) -> dict[str, Any]:
    data = {names.CONFIG_KEY: config_text}
    if shard_urls is not None:
        data[names.REDIS_URLS_KEY] = redis_urls_text(shard_urls)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(names.config_map_name(pool.name), pool, "config", owner),
        "data": data,
    }


def redis_urls_text(urls: list[str]) -> str:
    return "".join(f"{u}\n" for u in urls)


def published_shards(cm: Mapping[str, Any] | None) -> int | None:
    """How many shard URLs the pool's ConfigMap tells the sidecars (None: no ConfigMap or no key)."""
    text = ((cm or {}).get("data") or {}).get(names.REDIS_URLS_KEY)
    return None if text is None else len([line for line in text.splitlines() if line.strip()])


def shard_urls(pool: Pool, count: int) -> list[str]:
    """Stable per-shard DNS names through the headless Service; the password is not in the URL."""
    svc = names.redis_name(pool.name)
    return [f"redis://{svc}-{i}.{svc}.{pool.namespace}.svc:{names.REDIS_PORT}/0" for i in range(count)]


def _generated_secret(
    name: str, key: str, pool: Pool, component: str, owner: Mapping[str, Any]
) -> dict[str, Any]:
    value = secrets.token_urlsafe(32)  # created once, never rotated (Kube.create_once)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(name, pool, component, owner),
        "type": "Opaque",
        "data": {key: base64.b64encode(value.encode()).decode()},
    }


def password_secret(pool: Pool, owner: Mapping[str, Any]) -> dict[str, Any]:
    return _generated_secret(names.redis_name(pool.name), names.PASSWORD_KEY, pool, "redis", owner)


def pool_key_secret(pool: Pool, owner: Mapping[str, Any]) -> dict[str, Any]:
    """The pool's own secret: its sidecars MAC every chunk they write to Redis and check it on reads."""
    return _generated_secret(names.pool_key_secret(pool.name), names.POOL_KEY_KEY, pool, "key", owner)


def redis_selector(pool: Pool) -> dict[str, str]:
    return names.owned_labels(pool.name, "redis")


def redis_service(pool: Pool, owner: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(names.redis_name(pool.name), pool, "redis", owner),
        "spec": {
            "clusterIP": "None",
            "selector": redis_selector(pool),
            "ports": [{"name": "redis", "port": names.REDIS_PORT, "targetPort": "redis"}],
        },
    }


def shard_maxmemory(pool: Pool) -> int:
    """The bytes of chunks one shard holds (its maxmemory)."""
    assert pool.redis is not None
    return int(parse_quantity(pool.redis.memory) * REDIS_MAXMEMORY_FRACTION)


def redis_statefulset(pool: Pool, owner: Mapping[str, Any], replicas: int) -> dict[str, Any]:
    assert pool.redis is not None
    name = names.redis_name(pool.name)
    labels = redis_selector(pool)
    container = {
        "name": "redis",
        "image": pool.redis.image,
        "command": ["redis-server"],
        "args": [
            "--port",
            str(names.REDIS_PORT),
            "--requirepass",
            "$(REDIS_PASSWORD)",
            "--maxmemory",
            str(shard_maxmemory(pool)),
            "--maxmemory-policy",
            "allkeys-lru",  # a cache: evict, never refuse writes
            "--user",  # the operator's: INFO and PING, no password, no data
            names.MONITOR_USER,
            "on",
            "nopass",
            "+info",
            "+ping",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        "env": [
            {
                "name": "REDIS_PASSWORD",
                "valueFrom": {"secretKeyRef": {"name": name, "key": names.PASSWORD_KEY}},
            }
        ],
        "ports": [{"name": "redis", "containerPort": names.REDIS_PORT, "protocol": "TCP"}],
        "resources": {
            "requests": {"cpu": "250m", "memory": pool.redis.memory},
            "limits": {"memory": pool.redis.memory},
        },
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10, "failureThreshold": 6},
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(name, pool, "redis", owner),
        "spec": {
            "serviceName": name,
            "replicas": replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {
                    # the webhook's objectSelector skips this label; the annotation is the pod-level opt-out
                    "labels": {**labels, names.INJECT_ANNOTATION: "false"},
                    "annotations": {names.INJECT_ANNOTATION: "false"},
                },
                "spec": {
                    "automountServiceAccountToken": False,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": REDIS_UID,
                        "fsGroup": REDIS_UID,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [container],
                    "volumes": [{"name": "data", "emptyDir": {}}],
                },
            },
        },
    }
