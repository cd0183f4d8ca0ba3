"""What the webhook does to a pod, as pure functions on plain dicts (no API calls, no kopf).

`inject` first removes anything kvpool added before and then adds the current parts, so injecting
an injected pod gives the same pod: the webhook is idempotent by construction.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpool_operator import names
from kvpool_operator.connector_config import config_hash, kv_transfer_config, render
from kvpool_operator.pods import opted_out
from kvpool_operator.pool import Pool, problems
from kvpool_operator.quantity import format_mebibytes
from kvpool_operator.selector import matches
from kvpool_operator.settings import OperatorSettings

SIDECAR_OVERHEAD_BYTES = 256 * 2**20  # the sidecar process itself, beside its arena
SIDECAR_CPU_REQUEST = "250m"
ARENA_HEADROOM_BYTES = 2**20  # beside the arena file: the control socket, page rounding
RUN_AS_USER = 65532  # any non-root uid: the files it shares with vLLM belong to names.ARENA_GROUP


@dataclass
class Decision:
    """The pod to admit (None: admit untouched) and why, for warnings and events."""

    pod: dict[str, Any] | None
    pools: list[Pool] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def decide(
    pod: Mapping[str, Any], namespace: str, pools: Iterable[Pool], settings: OperatorSettings
) -> Decision:
    """Which pool (if exactly one) claims this pod, and the injected pod."""
    if opted_out(pod):
        return Decision(None)
    labels = (pod.get("metadata") or {}).get("labels") or {}
    claiming = [p for p in pools if p.namespace == namespace and matches(p.selector, labels)]
    if not claiming:
        return Decision(None)
    if len(claiming) > 1:
        keys = ", ".join(sorted(p.name for p in claiming))
        return Decision(
            None, claiming, [f"kvpool: pod matched by several pools ({keys}); admitted without a cache"]
        )
    pool = claiming[0]
    wrong = problems(pool)
    if wrong:
        return Decision(None, claiming, [f"kvpool: pool {pool.name} is not usable ({'; '.join(wrong)})"])
    if vllm_container_index(pod, pool) is None:
        return Decision(
            None,
            claiming,
            [f"kvpool: pool {pool.name} names container {pool.vllm_container!r}, the pod has none"],
        )
    return Decision(inject(pod, pool, settings), claiming)


def vllm_container_index(pod: Mapping[str, Any], pool: Pool) -> int | None:
    containers = (pod.get("spec") or {}).get("containers") or []
    if pool.vllm_container is None:
        return 0 if containers else None
    return next((i for i, c in enumerate(containers) if c.get("name") == pool.vllm_container), None)


def inject(pod: Mapping[str, Any], pool: Pool, settings: OperatorSettings) -> dict[str, Any]:
    """The pod with kvpool's sidecar, volumes and connector config (replacing any earlier injection)."""
    result = remove_injection(pod)
    spec = result.setdefault("spec", {})
    config_text = render(kv_transfer_config(pool)[0])

    index = vllm_container_index(result, pool)
    assert index is not None, "decide() checks the container exists"
    vllm = spec["containers"][index]
    vllm.setdefault("volumeMounts", []).append({"name": names.ARENA_VOLUME, "mountPath": names.ARENA_DIR})
    vllm["args"] = [*vllm.get("args", []), names.KV_TRANSFER_FLAG, config_text]

    sidecar = sidecar_container(pool, settings)
    if settings.legacy_sidecar:
        spec["containers"].append(sidecar)
    else:
        spec.setdefault("initContainers", []).append(sidecar)
    spec.setdefault("volumes", []).extend(pod_volumes(pool))
    groups = spec.setdefault("securityContext", {}).setdefault("supplementalGroups", [])
    if names.ARENA_GROUP not in groups:  # every container gets it: vLLM can use the 0660 arena
        groups.append(names.ARENA_GROUP)

    meta = result.setdefault("metadata", {})
    meta.setdefault("labels", {})[names.POOL_LABEL] = pool.name
    annotations = meta.setdefault("annotations", {})
    annotations[names.CONFIG_HASH_ANNOTATION] = config_hash(config_text)
    annotations[names.STATUS_PORT_ANNOTATION] = str(pool.status_port)
    return result


def remove_injection(pod: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the pod without anything kvpool adds (but the arena group in supplementalGroups,
    which inject() adds only when absent)."""
    result = copy.deepcopy(dict(pod))
    spec = result.get("spec") or {}
    ours = {names.ARENA_VOLUME, names.REDIS_URLS_VOLUME}
    for key in ("containers", "initContainers"):
        if key in spec:
            spec[key] = [c for c in spec[key] if c.get("name") != names.SIDECAR_CONTAINER]
        for container in spec.get(key, []):
            if "volumeMounts" in container:
                container["volumeMounts"] = [
                    m for m in container["volumeMounts"] if m.get("name") not in ours
                ]
            for argv in ("command", "args"):
                if argv in container:
                    container[argv] = strip_flag(container[argv], names.KV_TRANSFER_FLAG)
    if "initContainers" in spec and not spec["initContainers"]:
        del spec["initContainers"]
    if "volumes" in spec:
        spec["volumes"] = [v for v in spec["volumes"] if v.get("name") not in ours]
    return result


def strip_flag(argv: list[str], flag: str) -> list[str]:
    """argv without `flag value` and `flag=value`."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def sidecar_container(pool: Pool, settings: OperatorSettings) -> dict[str, Any]:
    args = [
        "--host", "127.0.0.1",
        "--port", str(pool.sidecar_port),
        "--status-port", str(pool.status_port),
        "--capacity", str(pool.capacity_bytes),  # plain bytes: no quantity dialect to disagree on
        "--arena-dir", names.ARENA_DIR,
        "--shared-group",  # the pod gives every container the sidecar's group: files are 0660
    ]  # fmt: skip
    mounts = [{"name": names.ARENA_VOLUME, "mountPath": names.ARENA_DIR}]
    env: list[dict[str, Any]] = []
    if pool.redis is not None:
        args += ["--redis-urls-file", f"{names.REDIS_URLS_DIR}/{names.REDIS_URLS_KEY}", "--pool-key-required"]
        # optional: a pod admitted before the operator made the Secret still starts (its Redis tier
        # stays off, and /readyz says why) rather than waiting on a cache
        key_ref = {"name": names.pool_key_secret(pool.name), "key": names.POOL_KEY_KEY, "optional": True}
        env.append({"name": "KVPOOL_POOL_KEY", "valueFrom": {"secretKeyRef": key_ref}})
        mounts.append({"name": names.REDIS_URLS_VOLUME, "mountPath": names.REDIS_URLS_DIR, "readOnly": True})
        secret = password_secret(pool)
        if secret is not None:
            env.append(
                {
                    "name": "KVPOOL_REDIS_PASSWORD",
                    "valueFrom": {"secretKeyRef": {"name": secret[0], "key": secret[1]}},
                }
            )
    probe_port = pool.status_port
    container: dict[str, Any] = {
        "name": names.SIDECAR_CONTAINER,
        "image": pool.sidecar_image or settings.sidecar_image,
        "args": args,
        "ports": [{"name": "kvpool-status", "containerPort": probe_port, "protocol": "TCP"}],
        "volumeMounts": mounts,
        "resources": sidecar_resources(pool),
        # vLLM starts once its cache's CPU tier answers (native sidecar); a slow start is not a failure,
        # and a Redis outage (which /readyz alone reports) must not hold vLLM back.
        # No readiness probe: a sidecar's readiness is the pod's, and a Redis outage must stay a
        # cache miss, never take vLLM out of its Service.
        "startupProbe": _probe("/readyz?tier=cpu", probe_port, period=2, failures=150),
        "livenessProbe": _probe("/healthz", probe_port, period=10, failures=6),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": names.ARENA_GROUP,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if env:
        container["env"] = env
    if not settings.legacy_sidecar:
        container["restartPolicy"] = "Always"
    return container


def password_secret(pool: Pool) -> tuple[str, str] | None:
    """(Secret name, key) holding the Redis password, if the pool has one."""
    if pool.redis is None:
        return None
    if pool.redis.mode == "shared":
        return names.redis_name(pool.name), names.PASSWORD_KEY
    if pool.redis.password_secret:
        return pool.redis.password_secret, pool.redis.password_key
    return None


def sidecar_resources(pool: Pool) -> dict[str, Any]:
    """Memory covering the arena plus the process; the pool's own values win key by key."""
    memory = format_mebibytes(pool.capacity_bytes + SIDECAR_OVERHEAD_BYTES)
    given = pool.sidecar_resources or {}
    return {
        "requests": {"cpu": SIDECAR_CPU_REQUEST, "memory": memory, **(given.get("requests") or {})},
        "limits": {"memory": memory, **(given.get("limits") or {})},
    }


def pod_volumes(pool: Pool) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        {"name": names.ARENA_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": arena_size_limit(pool)}}
    ]
    if pool.redis is not None:
        volumes.append(
            {
                "name": names.REDIS_URLS_VOLUME,
                "configMap": {
                    "name": names.config_map_name(pool.name),
                    "items": [{"key": names.REDIS_URLS_KEY, "path": names.REDIS_URLS_KEY}],
                },
            }
        )
    return volumes


def arena_size_limit(pool: Pool) -> str:
    """The capacity in whole MiB plus 1 MiB: tmpfs counts whole pages (a 1G arena fills 1536 bytes
    more than 10^9), and the kubelet evicts the whole pod, vLLM included, past the limit."""
    return format_mebibytes(pool.capacity_bytes + ARENA_HEADROOM_BYTES)


def _probe(path: str, port: int, *, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }
