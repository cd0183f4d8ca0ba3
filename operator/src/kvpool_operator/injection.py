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
from kvpool_operator.admission_fit import added_by_injection
from kvpool_operator.config_file import ConfigMapRead, config_connector
from kvpool_operator.connector_config import kv_transfer_config, render
from kvpool_operator.injected_parts import digest
from kvpool_operator.pods import opted_out
from kvpool_operator.pool import Pool, problems
from kvpool_operator.quantity import format_mebibytes
from kvpool_operator.resources import arena_files_bytes, guaranteed, sidecar_resources
from kvpool_operator.selector import matches
from kvpool_operator.settings import OperatorSettings
from kvpool_operator.vllm_breaker import skip as vllm_breaker_skip
from kvpool_operator.vllm_target import Skip, strip_ours, target_container

ARENA_HEADROOM_BYTES = 2**20  # beside the arena file: the control socket, page rounding
OUR_CONTAINERS = frozenset({names.SIDECAR_CONTAINER, names.CONNECTOR_CONTAINER})
CONNECTOR_RESOURCES = {"cpu": "50m", "memory": "64Mi"}  # the copy's page cache counts too
CONNECTOR_VOLUME_SIZE = "64Mi"  # the payload is ~17 MB, most of it xxhash for 10 Pythons and machines
# what Pod Security `restricted` asks of every container, and all kvpool's containers need
RESTRICTED: dict[str, Any] = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


@dataclass
class Decision:
    """The pod to admit (None: admit untouched) and why, for warnings and events."""

    pod: dict[str, Any] | None
    pools: list[Pool] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    skip: Skip | None = None  # why a claimed pod is admitted without the cache


@dataclass(frozen=True)
class NamespaceLimits:
    """The pod's namespace's LimitRanges and ResourceQuotas, as the API server lists them."""

    limit_ranges: list[dict[str, Any]] = field(default_factory=list)
    quotas: list[dict[str, Any]] = field(default_factory=list)


def decide(
    pod: Mapping[str, Any],
    namespace: str,
    pools: Iterable[Pool],
    settings: OperatorSettings,
    limits: NamespaceLimits | Skip | None = None,
    config_maps: Mapping[str, ConfigMapRead] | None = None,
) -> Decision:
    """Which pool (if exactly one) claims this pod, and the injected pod; a pod a pool claims but
    kvpool cannot configure, or that the sidecar would push over its namespace's `limits`, is
    admitted without the cache, annotated with the reason. `config_maps` are the ConfigMaps its vLLM
    `--config` files come from, as the webhook read them (config_file.config_maps_to_read)."""
    claiming = claimed_by(pod, namespace, pools)
    if not claiming:
        return Decision(None)
    outcome = _configurable(pod, claiming, config_maps or {})
    if isinstance(outcome, Skip):
        return _skip(pod, claiming, outcome)
    if isinstance(limits, Skip):  # unknown whether the pod fits with the sidecar: never risk a refusal
        return _skip(pod, claiming, limits)
    injected = inject(pod, claiming[0], settings, outcome)
    if limits is not None:
        # checked against the pod as sent, without an earlier injection (a re-admitted pod)
        unfit = added_by_injection(remove_injection(pod), injected, limits.limit_ranges, limits.quotas)
        if unfit is not None:
            return _skip(pod, claiming, Skip(*unfit))
    return Decision(injected, claiming)


def claimed_by(pod: Mapping[str, Any], namespace: str, pools: Iterable[Pool]) -> list[Pool]:
    """The pools whose selector takes the pod (none when the pod opts out)."""
    if opted_out(pod):
        return []
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return [p for p in pools if p.namespace == namespace and matches(p.selector, labels)]


def _skip(pod: Mapping[str, Any], claiming: list[Pool], why: Skip) -> Decision:
    """The pod without the cache, annotated with why."""
    skipped = remove_injection(pod)
    annotations = skipped.setdefault("metadata", {}).setdefault("annotations", {})
    annotations[names.SKIPPED_ANNOTATION] = f"{why.reason}: {why.message}"
    return Decision(skipped, claiming, [f"kvpool: admitted without a cache: {why.message}"], why)


def _configurable(
    pod: Mapping[str, Any], claiming: list[Pool], config_maps: Mapping[str, ConfigMapRead]
) -> int | Skip:
    """The vLLM container's index, or why the pod cannot get the cache without breaking it."""
    if len(claiming) > 1:
        keys = ", ".join(sorted(p.name for p in claiming))
        return Skip("SeveralPools", f"the pod is selected by several pools ({keys})")
    pool = claiming[0]
    wrong = problems(pool)
    if wrong:
        return Skip("PoolNotUsable", f"pool {pool.name} is not usable ({'; '.join(wrong)})")
    if pool.sidecar_not_starting:
        return Skip(
            "SidecarNotStarting",
            f"pool {pool.name}'s sidecar does not start in its pods ({pool.sidecar_not_starting}); new pods "
            "start without it until the pool changes",
        )
    if (pod.get("spec") or {}).get("hostNetwork"):
        return Skip(
            "HostNetwork",
            "the pod uses the host's network: its sidecar would share the node's loopback with other pods'",
        )
    found = target_container(pod, pool.vllm_container)
    if isinstance(found, Skip):
        return found
    if stages_connector(pod) and (problem := python_path_problem(pod["spec"]["containers"][found])):
        return problem
    return vllm_breaker_skip(pod, found, pool) or config_connector(pod, found, config_maps) or found


def inject(
    pod: Mapping[str, Any], pool: Pool, settings: OperatorSettings, index: int | None = None
) -> dict[str, Any]:
    """The pod with kvpool's sidecar, volumes and connector config (replacing any earlier injection);
    `index` is the vLLM container's (found here when not given; ValueError when there is none)."""
    if index is None:
        found = target_container(pod, pool.vllm_container)
        if isinstance(found, Skip):
            raise ValueError(found.message)
        index = found
    qos_guaranteed = guaranteed(pod)  # judged before the sidecar joins
    result = remove_injection(pod)
    spec = result.setdefault("spec", {})
    config_text = render(kv_transfer_config(pool)[0])

    vllm = spec["containers"][index]
    vllm.setdefault("volumeMounts", []).append({"name": names.ARENA_VOLUME, "mountPath": names.ARENA_DIR})
    vllm["args"] = [*vllm.get("args", []), names.KV_TRANSFER_FLAG, config_text]
    staged = stages_connector(result)
    if staged:
        mount = {"name": names.CONNECTOR_VOLUME, "mountPath": names.CONNECTOR_DIR, "readOnly": True}
        vllm["volumeMounts"].append(mount)
        _prepend_python_path(vllm)
        # a plain init container, before the sidecar: the payload is in place before vLLM starts
        spec.setdefault("initContainers", []).append(connector_container(pool, settings))

    sidecar = sidecar_container(pool, settings, qos_guaranteed)
    if settings.legacy_sidecar:
        spec["containers"].append(sidecar)
    else:
        spec.setdefault("initContainers", []).append(sidecar)
    spec.setdefault("volumes", []).extend(pod_volumes(pool, staged))
    pulls = spec.setdefault("imagePullSecrets", [])  # the pod's own pull the sidecar too; add the pool's
    pulls += [{"name": n} for n in pool.sidecar_pull_secrets if {"name": n} not in pulls]
    if not pulls:
        del spec["imagePullSecrets"]
    groups = spec.setdefault("securityContext", {}).setdefault("supplementalGroups", [])
    if names.ARENA_GROUP not in groups:  # every container gets it: vLLM can use the 0660 arena
        groups.append(names.ARENA_GROUP)

    meta = result.setdefault("metadata", {})
    meta.setdefault("labels", {})[names.POOL_LABEL] = pool.name
    annotations = meta.setdefault("annotations", {})
    annotations[names.STATUS_PORT_ANNOTATION] = str(pool.status_port)
    # last: a digest of everything added above (and whatever else inject adds), to tell outdated pods
    annotations[names.CONFIG_HASH_ANNOTATION] = digest(remove_injection(result), result)
    return result


def remove_injection(pod: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the pod without anything kvpool adds (but the arena group in supplementalGroups,
    which inject() adds only when absent)."""
    result = copy.deepcopy(dict(pod))
    spec = result.get("spec") or {}
    ours = {names.ARENA_VOLUME, names.REDIS_URLS_VOLUME, names.CONNECTOR_VOLUME, names.CREDENTIALS_VOLUME}
    for key in ("containers", "initContainers"):
        if key in spec:
            spec[key] = [c for c in spec[key] if c.get("name") not in OUR_CONTAINERS]
        for container in spec.get(key, []):
            if "volumeMounts" in container:
                container["volumeMounts"] = [
                    m for m in container["volumeMounts"] if m.get("name") not in ours
                ]
            for argv in ("command", "args"):
                if argv in container:
                    container[argv] = strip_ours(container[argv])
            _strip_python_path(container)
    if "initContainers" in spec and not spec["initContainers"]:
        del spec["initContainers"]
    if "volumes" in spec:
        spec["volumes"] = [v for v in spec["volumes"] if v.get("name") not in ours]
    annotations = (result.get("metadata") or {}).get("annotations") or {}
    annotations.pop(names.SKIPPED_ANNOTATION, None)
    return result


def stages_connector(pod: Mapping[str, Any]) -> bool:
    """Whether the pod gets the connector payload: always, unless it says its image has the connector."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return annotations.get(names.CONNECTOR_ANNOTATION) != "image"


def python_path_problem(container: Mapping[str, Any]) -> Skip | None:
    """A PYTHONPATH kvpool cannot put the payload in front of: one set from a Secret or ConfigMap."""
    for env in container.get("env") or []:
        if env.get("name") == "PYTHONPATH" and "valueFrom" in env:
            return Skip(
                "PythonPathNotPlain",
                f"container {container.get('name', '?')} takes PYTHONPATH from a reference, which kvpool "
                "cannot prepend its connector to: set it as a plain value, or annotate the pod "
                f'{names.CONNECTOR_ANNOTATION}: "image" if the image has the connector',
            )
    return None


def _prepend_python_path(container: dict[str, Any]) -> None:
    env = container.setdefault("env", [])
    for entry in env:
        if entry.get("name") == "PYTHONPATH":
            given = str(entry.get("value") or "")
            entry["value"] = f"{names.CONNECTOR_DIR}:{given}" if given else names.CONNECTOR_DIR
            return
    env.append({"name": "PYTHONPATH", "value": names.CONNECTOR_DIR})


def _strip_python_path(container: dict[str, Any]) -> None:
    """The container's PYTHONPATH as it was before _prepend_python_path."""
    env = container.get("env") or []
    for entry in env:
        value = entry.get("value")
        if entry.get("name") != "PYTHONPATH" or not isinstance(value, str):
            continue
        if value == names.CONNECTOR_DIR:
            env.remove(entry)
        elif value.startswith(names.CONNECTOR_DIR + ":"):
            entry["value"] = value[len(names.CONNECTOR_DIR) + 1 :]
        break
    if "env" in container and not env:
        del container["env"]


def connector_container(pool: Pool, settings: OperatorSettings) -> dict[str, Any]:
    """Copies the connector payload from the sidecar's image into the pod (one image for both: the
    payload is always the sidecar's own version, and there is no second image to mirror)."""
    return {
        "name": names.CONNECTOR_CONTAINER,
        "image": sidecar_image(pool, settings),
        "command": ["cp", "-R", f"{names.CONNECTOR_DIR}/.", names.CONNECTOR_STAGING_DIR],
        "volumeMounts": [{"name": names.CONNECTOR_VOLUME, "mountPath": names.CONNECTOR_STAGING_DIR}],
        # requests equal limits: a Guaranteed pod stays Guaranteed
        "resources": {"requests": dict(CONNECTOR_RESOURCES), "limits": dict(CONNECTOR_RESOURCES)},
        "securityContext": copy.deepcopy(RESTRICTED),
    }


def sidecar_container(pool: Pool, settings: OperatorSettings, qos_guaranteed: bool = False) -> dict[str, Any]:
    args = [
        "--host", "127.0.0.1",
        "--port", str(pool.sidecar_port),
        "--status-port", str(pool.status_port),
        "--capacity", str(pool.capacity_bytes),  # plain bytes: no quantity dialect to disagree on
        "--arena-dir", names.ARENA_DIR,
        "--shared-group",  # the pod gives every container the sidecar's group: files are 0660
        "--keep-arena",  # a restarted sidecar reuses the emptyDir's file: its memory is not held twice
    ]  # fmt: skip
    mounts: list[dict[str, Any]] = [{"name": names.ARENA_VOLUME, "mountPath": names.ARENA_DIR}]
    if pool.redis is not None:
        args += ["--redis-urls-file", f"{names.REDIS_URLS_DIR}/{names.REDIS_URLS_KEY}", "--pool-key-required",
                 "--pool-key-file", f"{names.CREDENTIALS_DIR}/{names.POOL_KEY_FILE}"]  # fmt: skip
        if password_secret(pool) is not None:
            args += ["--redis-password-file", f"{names.CREDENTIALS_DIR}/{names.REDIS_PASSWORD_FILE}"]
        if pool.prewarm_bytes:
            args += ["--prewarm-bytes", str(pool.prewarm_bytes)]
        mounts.append({"name": names.REDIS_URLS_VOLUME, "mountPath": names.REDIS_URLS_DIR, "readOnly": True})
        mounts.append(
            {"name": names.CREDENTIALS_VOLUME, "mountPath": names.CREDENTIALS_DIR, "readOnly": True}
        )
    probe_port = pool.status_port
    container: dict[str, Any] = {
        "name": names.SIDECAR_CONTAINER,
        "image": sidecar_image(pool, settings),
        "args": args,
        "ports": [{"name": "kvpool-status", "containerPort": probe_port, "protocol": "TCP"}],
        "volumeMounts": mounts,
        "resources": sidecar_resources(pool.capacity_bytes, pool.sidecar_resources, qos_guaranteed),
        # No startup probe: a native sidecar's holds vLLM back until it passes, so a sidecar that cannot
        # start would keep vLLM from ever starting. vLLM starts once the sidecar's process runs; a cache
        # not answering yet is a miss. No readiness probe: a sidecar's readiness is the pod's, and a
        # Redis outage must stay a cache miss, never take vLLM out of its Service.
        "livenessProbe": _probe("/healthz", probe_port, period=10, failures=6),
        "securityContext": {**copy.deepcopy(RESTRICTED), "runAsGroup": names.ARENA_GROUP},
    }
    if not settings.legacy_sidecar:
        container["restartPolicy"] = "Always"
    return container


def sidecar_image(pool: Pool, settings: OperatorSettings) -> str:
    """The image the pool's sidecars run: the pool's own, else the operator's."""
    return pool.sidecar_image or settings.sidecar_image


def password_secret(pool: Pool) -> tuple[str, str] | None:
    """(Secret name, key) holding the Redis password, if the pool has one."""
    if pool.redis is None:
        return None
    if pool.redis.mode == "shared":
        return names.redis_name(pool.name), names.PASSWORD_KEY
    if pool.redis.password_secret:
        return pool.redis.password_secret, pool.redis.password_key
    return None


def pod_volumes(pool: Pool, staged: bool = True) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        {"name": names.ARENA_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": arena_size_limit(pool)}}
    ]
    if staged:
        volumes.append({"name": names.CONNECTOR_VOLUME, "emptyDir": {"sizeLimit": CONNECTOR_VOLUME_SIZE}})
    if pool.redis is not None:
        volumes.append(
            {
                "name": names.REDIS_URLS_VOLUME,
                "configMap": {  # optional: without it the sidecar runs with no Redis shards
                    "name": names.config_map_name(pool.name),
                    "optional": True,
                    "items": [{"key": names.REDIS_URLS_KEY, "path": names.REDIS_URLS_KEY}],
                },
            }
        )
        volumes.append({"name": names.CREDENTIALS_VOLUME, "projected": {"sources": credential_sources(pool)}})
    return volumes


def credential_sources(pool: Pool) -> list[dict[str, Any]]:
    """The pool key and the Redis password as files. Optional, both: a pod admitted before the
    operator made the key's Secret still starts, with its Redis tier off until the file appears (the
    kubelet adds it), and a missing password Secret turns the Redis tier off, not the pod."""
    wanted = [(names.pool_key_secret(pool.name), names.POOL_KEY_KEY, names.POOL_KEY_FILE)]
    if (secret := password_secret(pool)) is not None:
        wanted.append((*secret, names.REDIS_PASSWORD_FILE))
    return [
        {"secret": {"name": name, "optional": True, "items": [{"key": key, "path": path}]}}
        for name, key, path in wanted
    ]


def arena_size_limit(pool: Pool) -> str:
    """The arena and its journal in whole MiB plus 1 MiB: tmpfs counts whole pages (a 1G arena fills
    1536 bytes more than 10^9), and the kubelet evicts the whole pod, vLLM included, past the limit."""
    return format_mebibytes(arena_files_bytes(pool.capacity_bytes) + ARENA_HEADROOM_BYTES)


def _probe(path: str, port: int, *, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }
