"""What `kubectl explain kvp.spec...` says matches what the operator does: every defaulted field states
its default, and the numbers a description gives are the code's (the server's defaults themselves are
held equal to the operator's by tests/k8s/test_crd_apiserver.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvpool_operator import objects, resources, scaling
from kvpool_operator.pool import (
    DEFAULT_CAPACITY,
    DEFAULT_CAPACITY_PERCENT,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_REDIS_IMAGE,
    DEFAULT_REDIS_MEMORY,
    DEFAULT_SIDECAR_PORT,
    MIN_CAPACITY_BYTES,
    Pool,
    RedisSpec,
    ScalingSpec,
)
from kvpool_operator.settings import OperatorSettings
from kvpool_sidecar.working_set import WINDOW_SECONDS


def fields(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    for name, sub in (schema.get("properties") or {}).items():
        where = f"{path}.{name}" if path else name
        yield where, sub
        yield from fields(sub, where)


@pytest.fixture(scope="module")
def schema(crd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    (version,) = crd["spec"]["versions"]
    return dict(fields(version["schema"]["openAPIV3Schema"]))


def text(schema: dict[str, dict[str, Any]], path: str) -> str:
    return " ".join(schema[path].get("description", "").split())


def shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_every_defaulted_field_states_its_default(schema: dict[str, dict[str, Any]]) -> None:
    missing = [
        f"{path} (default {shown(s['default'])})"
        for path, s in schema.items()
        if "default" in s
        and f"default {shown(s['default'])}" not in text(schema, path)
        and f"{shown(s['default'])} (default" not in text(schema, path)
    ]
    assert missing == []


def test_the_stated_defaults_are_the_operators(schema: dict[str, dict[str, Any]]) -> None:
    """The operator reads a pool the API server did not default (created before a default existed) with
    these: the schema's defaults, and so the descriptions above, must be the same values."""
    spec = Pool("ns", "p", {})
    redis, scale = RedisSpec(), ScalingSpec(min_replicas=1, max_replicas=2)
    expected = {
        "spec.backend": spec.backend,
        "spec.capacity": DEFAULT_CAPACITY,
        "spec.chunkSize": DEFAULT_CHUNK_SIZE,
        "spec.saveDecodeCache": spec.save_decode_cache,
        "spec.skipLastNTokens": spec.skip_last_n_tokens,
        "spec.discardPartialChunks": spec.discard_partial_chunks,
        "spec.redis.mode": redis.mode,
        "spec.redis.replicas": redis.replicas,
        "spec.redis.memory": DEFAULT_REDIS_MEMORY,
        "spec.redis.image": DEFAULT_REDIS_IMAGE,
        "spec.redis.passwordSecretRef.key": redis.password_key,
        "spec.scaling.minReplicas": 1,
        "spec.scaling.capacityPercent": DEFAULT_CAPACITY_PERCENT,
        "spec.scaling.sizeBy": scale.size_by,
        "spec.sidecar.port": DEFAULT_SIDECAR_PORT,
    }
    assert {path: schema[path].get("default") for path in expected} == expected
    assert sorted(p for p, s in schema.items() if "default" in s) == sorted(expected)


def test_the_numbers_in_the_descriptions_are_the_codes(schema: dict[str, dict[str, Any]]) -> None:
    assert f"maxmemory is {objects.REDIS_MAXMEMORY_FRACTION:.0%} of it" in text(schema, "spec.redis.memory")
    assert f"at least {MIN_CAPACITY_BYTES // 2**20}Mi" in text(schema, "spec.capacity")
    assert f"a CPU request of {resources.SIDECAR_CPU_REQUEST}" in text(schema, "spec.sidecar.resources")
    assert "port + 1" in text(schema, "spec.sidecar.port")
    assert Pool("ns", "p", {}, sidecar_port=9000).status_port == 9001
    minutes = OperatorSettings().drain_timeout / 60
    drain = text(schema, "status.sharedTier.drainingSince")
    assert f"--drain-timeout (default {minutes:.0f} minutes)" in drain
    size_by = text(schema, "spec.scaling.sizeBy")
    assert f"with {scaling.WORKING_SET_HEADROOM - 1:.0%} headroom" in size_by
    assert f"last {WINDOW_SECONDS / 60:.0f}-{2 * WINDOW_SECONDS / 60:.0f} minutes" in size_by


def test_the_vllm_container_is_found_by_what_it_runs(schema: dict[str, dict[str, Any]]) -> None:
    described = text(schema, "spec.vllmContainer")
    assert "first container" not in described
    assert "runs vllm" in described
