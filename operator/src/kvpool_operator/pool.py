"""A KVCachePool's spec as typed values, with the CRD's defaults, and the checks the schema cannot make.

The defaults mirror crds/kvcachepool.yaml (a test keeps them equal): objects created before a
default existed, or served by an API server that skipped defaulting, read the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpool_operator.quantity import parse_quantity
from kvpool_operator.resources import resource_problems

DEFAULT_CAPACITY = "4Gi"
DEFAULT_CHUNK_SIZE = 256
DEFAULT_SIDECAR_PORT = 7070
DEFAULT_REDIS_MEMORY = "1Gi"
DEFAULT_REDIS_IMAGE = "redis:7.4"
DEFAULT_CAPACITY_PERCENT = 100
MIN_CAPACITY_BYTES = 16 * 2**20  # below this an arena holds too few chunks to be worth a sidecar


@dataclass(frozen=True)
class RedisSpec:
    mode: str = "shared"
    url: str | None = None
    password_secret: str | None = None
    password_key: str = "password"
    replicas: int = 1
    memory: str = DEFAULT_REDIS_MEMORY
    image: str = DEFAULT_REDIS_IMAGE
    prewarm: str | None = None  # bytes of the pool's hottest chunks a new sidecar loads at start


@dataclass(frozen=True)
class ScalingSpec:
    min_replicas: int
    max_replicas: int
    capacity_percent: int = DEFAULT_CAPACITY_PERCENT
    size_by: str = "workingSet"  # or "arenas": capacity_percent of the ready pods' arenas alone


@dataclass(frozen=True)
class Pool:
    namespace: str
    name: str
    selector: Mapping[str, Any]
    backend: str = "cpu"
    capacity: str = DEFAULT_CAPACITY
    redis: RedisSpec | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE
    priority_limit: int | None = None
    save_decode_cache: bool = False
    skip_last_n_tokens: int = 0
    discard_partial_chunks: bool = False
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    scaling: ScalingSpec | None = None
    sidecar_image: str | None = None
    sidecar_pull_secrets: tuple[str, ...] = ()  # added to the pod's imagePullSecrets
    sidecar_port: int = DEFAULT_SIDECAR_PORT
    sidecar_resources: Mapping[str, Any] | None = None
    vllm_container: str | None = None
    uid: str | None = None  # the pool object's uid, for events about it
    sidecar_not_starting: str | None = None  # from status: why its pods' sidecars do not start
    vllm_failing: Mapping[str, str] = field(default_factory=dict)  # from status: vLLM image -> why it fails

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def capacity_bytes(self) -> int:
        return parse_quantity(self.capacity)

    @property
    def prewarm_bytes(self) -> int:
        """What a new sidecar pre-warms from the Redis tier: spec.redis.prewarm, at most its CPU tier."""
        if self.redis is None or self.redis.prewarm is None:
            return 0
        return min(parse_quantity(self.redis.prewarm), self.capacity_bytes)

    @property
    def shared_tier(self) -> bool:
        return self.backend == "redis" and self.redis is not None and self.redis.mode == "shared"

    @property
    def status_port(self) -> int:
        return self.sidecar_port + 1


def parse_pool(namespace: str, name: str, spec: Mapping[str, Any], uid: str | None = None) -> Pool:
    """The pool with every default applied. Raises ValueError naming the field on a wrong type."""
    redis = None
    if spec.get("redis") is not None or spec.get("backend") == "redis":
        r = spec.get("redis") or {}
        secret = r.get("passwordSecretRef") or {}
        redis = RedisSpec(
            mode=str(r.get("mode", "shared")),
            url=r.get("url"),
            password_secret=secret.get("name"),
            password_key=str(secret.get("key", "password")),
            replicas=_int(r, "replicas", 1, "spec.redis.replicas"),
            memory=str(r.get("memory", DEFAULT_REDIS_MEMORY)),
            image=str(r.get("image", DEFAULT_REDIS_IMAGE)),
            prewarm=str(r["prewarm"]) if r.get("prewarm") is not None else None,
        )
    scaling = None
    if spec.get("scaling") is not None:
        s = spec["scaling"]
        scaling = ScalingSpec(
            min_replicas=_int(s, "minReplicas", 1, "spec.scaling.minReplicas"),
            max_replicas=_int(s, "maxReplicas", _int(s, "minReplicas", 1, ""), "spec.scaling.maxReplicas"),
            capacity_percent=_int(
                s, "capacityPercent", DEFAULT_CAPACITY_PERCENT, "spec.scaling.capacityPercent"
            ),
            size_by=str(s.get("sizeBy") or "workingSet"),
        )
    sidecar = spec.get("sidecar") or {}
    priority_limit = spec.get("priorityLimit")
    if priority_limit is not None and (
        isinstance(priority_limit, bool) or not isinstance(priority_limit, int)
    ):
        raise ValueError(f"spec.priorityLimit must be an integer, got {priority_limit!r}")
    extra = spec.get("extraConfig") or {}
    if not isinstance(extra, Mapping):
        raise ValueError(f"spec.extraConfig must be an object, got {extra!r}")
    return Pool(
        namespace=namespace,
        name=name,
        selector=spec.get("selector") or {},
        backend=str(spec.get("backend", "cpu")),
        capacity=str(spec.get("capacity", DEFAULT_CAPACITY)),
        redis=redis,
        chunk_size=_int(spec, "chunkSize", DEFAULT_CHUNK_SIZE, "spec.chunkSize"),
        priority_limit=priority_limit,
        save_decode_cache=_bool(spec, "saveDecodeCache", "spec.saveDecodeCache"),
        skip_last_n_tokens=_int(spec, "skipLastNTokens", 0, "spec.skipLastNTokens"),
        discard_partial_chunks=_bool(spec, "discardPartialChunks", "spec.discardPartialChunks"),
        extra_config=dict(extra),
        scaling=scaling,
        sidecar_image=sidecar.get("image"),
        sidecar_pull_secrets=tuple(str(s.get("name")) for s in sidecar.get("imagePullSecrets") or []),
        sidecar_port=_int(sidecar, "port", DEFAULT_SIDECAR_PORT, "spec.sidecar.port"),
        sidecar_resources=sidecar.get("resources"),
        vllm_container=spec.get("vllmContainer"),
        uid=uid,
    )


def problems(pool: Pool) -> list[str]:
    """What is wrong with a pool that the CRD's schema and rules cannot see; each names the field."""
    found: list[str] = []
    try:
        capacity = pool.capacity_bytes
    except ValueError:
        return [f"spec.capacity {pool.capacity!r} is not a quantity"]
    if capacity < MIN_CAPACITY_BYTES:
        found.append(f"spec.capacity {pool.capacity} is below the minimum of 16Mi")
    found += resource_problems(capacity, pool.sidecar_resources)
    if pool.redis is not None and pool.shared_tier:
        try:
            parse_quantity(pool.redis.memory)
        except ValueError:
            found.append(f"spec.redis.memory {pool.redis.memory!r} is not a quantity")
    if pool.redis is not None and pool.redis.prewarm is not None:
        try:
            parse_quantity(pool.redis.prewarm)
        except ValueError:
            found.append(f"spec.redis.prewarm {pool.redis.prewarm!r} is not a quantity")
    if (
        pool.backend == "redis"
        and pool.redis is not None
        and pool.redis.mode == "external"
        and not pool.redis.url
    ):
        found.append("spec.redis.url is required when spec.redis.mode is external")
    if pool.scaling is not None and pool.scaling.min_replicas > pool.scaling.max_replicas:
        found.append("spec.scaling.minReplicas must not exceed spec.scaling.maxReplicas")
    return found


def _int(spec: Mapping[str, Any], key: str, default: int, where: str) -> int:
    value = spec.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where} must be an integer, got {value!r}")
    return value


def _bool(spec: Mapping[str, Any], key: str, where: str) -> bool:
    value = spec.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{where} must be true or false, got {value!r}")
    return value
