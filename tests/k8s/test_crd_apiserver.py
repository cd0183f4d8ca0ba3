"""The KVCachePool CRD on a real API server: accepted and Established, every example applied, invalid
pools refused by the server itself (schema and CEL) naming the field, the server's defaults equal to
the operator's, and `kubectl get kvp` showing the printer columns with real values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubeharness.controlplane import ControlPlane, get_json
from kubeharness.objects import pool_manifest
from kvtest import REPO

from kvpool_operator.names import redis_name
from kvpool_operator.pool import parse_pool, problems

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
E2E_POOL = REPO / "tests" / "e2e" / "manifests" / "pool.yaml"
NAMESPACE = "crd-tests"


def pool(**spec: Any) -> dict[str, Any]:
    return pool_manifest(NAMESPACE, "p", {"selector": {"matchLabels": {"app": "vllm"}}, **spec})


@pytest.fixture(scope="module")
def cp(crd_installed: ControlPlane) -> ControlPlane:
    crd_installed.kubectl("create", "namespace", NAMESPACE)
    return crd_installed


def dry_run_create(cp: ControlPlane, doc: dict[str, Any]) -> tuple[int, str, dict[str, Any] | None]:
    """`kubectl create --dry-run=server`: the API server validates, defaults and answers, storing nothing."""
    result = cp.kubectl_result("create", "--dry-run=server", "-o", "json", "-f", "-", stdin=json.dumps(doc))
    return result.returncode, result.stderr, json.loads(result.stdout) if result.returncode == 0 else None


def test_crd_is_established_with_its_names(cp: ControlPlane) -> None:
    crd = get_json(cp, "crd", "kvcachepools.kvpool.dev")
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True" and conditions["NamesAccepted"] == "True"
    assert crd["status"]["acceptedNames"]["shortNames"] == ["kvp"]
    assert "kvp" in cp.kubectl("api-resources", "--api-group=kvpool.dev")


@pytest.mark.parametrize("path", [*EXAMPLES, E2E_POOL], ids=lambda p: p.stem)
def test_example_is_applied_and_usable(cp: ControlPlane, path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    namespace = doc["metadata"].get("namespace", NAMESPACE)
    cp.kubectl("create", "namespace", namespace, check=False)
    cp.kubectl("-n", namespace, "apply", "-f", str(path))
    stored = get_json(cp, "-n", namespace, "kvp", doc["metadata"]["name"])
    assert problems(parse_pool(namespace, doc["metadata"]["name"], stored["spec"])) == []


SHARED = {"backend": "redis", "redis": {"mode": "shared"}}

# (case, spec fields, the field the refusal must name)
INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("unknown backend", {"backend": "memcached"}, "spec.backend"),
    ("capacity not a quantity", {"capacity": "lots"}, "spec.capacity"),
    ("capacity negative", {"capacity": "-1Gi"}, "spec.capacity"),
    ("capacity zero bytes as int", {"capacity": 0}, "spec.capacity"),
    ("capacity zero as a string", {"capacity": "0Gi"}, "spec.capacity"),
    ("chunk size too small", {"chunkSize": 8}, "spec.chunkSize"),
    ("chunk size a string", {"chunkSize": "256"}, "spec.chunkSize"),
    ("negative skipLastNTokens", {"skipLastNTokens": -1}, "spec.skipLastNTokens"),
    ("priorityLimit a string", {"priorityLimit": "high"}, "spec.priorityLimit"),
    ("saveDecodeCache a string", {"saveDecodeCache": "yes"}, "spec.saveDecodeCache"),
    ("sidecar port too high", {"sidecar": {"port": 65535}}, "spec.sidecar.port"),
    ("sidecar port privileged", {"sidecar": {"port": 80}}, "spec.sidecar.port"),
    ("bad container name", {"vllmContainer": "VLLM_main"}, "spec.vllmContainer"),
    ("unknown field", {"chunksize": 128}, "spec.chunksize"),
    ("empty selector", {"selector": {}}, "spec.selector"),
    ("selector matchLabels empty", {"selector": {"matchLabels": {}}}, "spec.selector"),
    (
        "selector bad operator",
        {"selector": {"matchExpressions": [{"key": "a", "operator": "Like"}]}},
        "spec.selector.matchExpressions[0].operator",
    ),
    (
        "selector In without values",
        {"selector": {"matchExpressions": [{"key": "a", "operator": "In"}]}},
        "spec.selector.matchExpressions[0]",
    ),
    ("redis backend without redis", {"backend": "redis"}, "spec.redis"),
    ("redis section on cpu backend", {"redis": {"mode": "shared"}}, "spec.redis"),
    ("external without url", {"backend": "redis", "redis": {"mode": "external"}}, "spec.redis.url"),
    (
        "url in shared mode",
        {"backend": "redis", "redis": {"mode": "shared", "url": "redis://r:6379"}},
        "spec.redis.url",
    ),
    (
        "url not redis",
        {"backend": "redis", "redis": {"mode": "external", "url": "http://r:6379"}},
        "spec.redis.url",
    ),
    (
        "password ref in shared mode",
        {"backend": "redis", "redis": {"mode": "shared", "passwordSecretRef": {"name": "s"}}},
        "spec.redis.passwordSecretRef",
    ),
    ("unknown redis mode", {"backend": "redis", "redis": {"mode": "sentinel"}}, "spec.redis.mode"),
    ("prewarm not a quantity", {**SHARED, "redis": {"prewarm": "hot"}}, "spec.redis.prewarm"),
    ("prewarm negative", {**SHARED, "redis": {"prewarm": -1}}, "spec.redis.prewarm"),
    (
        "shards out of range",
        {"backend": "redis", "redis": {"mode": "shared", "replicas": 0}},
        "spec.redis.replicas",
    ),
    (
        "redis memory not a quantity",
        {"backend": "redis", "redis": {"mode": "shared", "memory": "1 GB"}},
        "spec.redis.memory",
    ),
    (
        "redis memory zero",
        {"backend": "redis", "redis": {"mode": "shared", "memory": 0}},
        "spec.redis.memory",
    ),
    (
        "min above max",
        {**SHARED, "scaling": {"minReplicas": 4, "maxReplicas": 2}},
        "spec.scaling.minReplicas",
    ),
    ("scaling without max", {**SHARED, "scaling": {"minReplicas": 1}}, "spec.scaling.maxReplicas"),
    (
        "capacity percent zero",
        {**SHARED, "scaling": {"maxReplicas": 2, "capacityPercent": 0}},
        "spec.scaling.capacityPercent",
    ),
    (
        "size by something else",
        {**SHARED, "scaling": {"maxReplicas": 2, "sizeBy": "requests"}},
        "spec.scaling.sizeBy",
    ),
    ("scaling on cpu backend", {"scaling": {"maxReplicas": 2}}, "spec.scaling"),
    (
        "scaling on external redis",
        {
            "backend": "redis",
            "redis": {"mode": "external", "url": "redis://r:6379"},
            "scaling": {"maxReplicas": 2},
        },
        "spec.scaling",
    ),
]


@pytest.mark.parametrize(("case", "spec", "field"), INVALID, ids=[c for c, _, _ in INVALID])
def test_invalid_pool_is_refused_by_the_api_server_naming_the_field(
    cp: ControlPlane, case: str, spec: dict[str, Any], field: str
) -> None:
    code, message, _ = dry_run_create(cp, pool(**spec))
    assert code != 0, f"{case}: accepted"
    assert field in message, f"{case}: {message!r} does not name {field}"


def test_missing_selector_is_refused(cp: ControlPlane) -> None:
    doc = pool()
    del doc["spec"]["selector"]
    code, message, _ = dry_run_create(cp, doc)
    assert code != 0 and "spec.selector" in message


@pytest.mark.parametrize(
    "spec",
    [
        {**SHARED, "scaling": {"minReplicas": 2, "maxReplicas": 2}},
        {
            "backend": "redis",
            "redis": {"mode": "external", "url": "rediss://r:6380/1", "passwordSecretRef": {"name": "s"}},
        },
        {"selector": {"matchExpressions": [{"key": "a", "operator": "Exists"}]}},
        {"selector": {"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["x"]}]}},
        {
            "capacity": 1073741824,
            "priorityLimit": -3,
            "extraConfig": {"timeout_ms": 200, "anything": {"nested": 1}},
        },
        {"capacity": "0.5Gi"},
    ],
    ids=["scaling", "external", "exists", "notin", "int-capacity", "fractional-capacity"],
)
def test_valid_pool_is_accepted(cp: ControlPlane, spec: dict[str, Any]) -> None:
    code, message, _ = dry_run_create(cp, pool(**spec))
    assert code == 0, message


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"backend": "redis", "redis": {}},
        {"backend": "redis", "redis": {"mode": "shared"}, "scaling": {"maxReplicas": 3}},
        {
            "backend": "redis",
            "redis": {"mode": "external", "url": "redis://r:6379", "passwordSecretRef": {"name": "s"}},
        },
        {"sidecar": {}},
    ],
    ids=["cpu", "redis", "scaling", "external", "sidecar"],
)
def test_server_defaults_equal_the_operators(cp: ControlPlane, spec: dict[str, Any]) -> None:
    """A pool the API server defaulted and one it did not (created before a default existed) read the same."""
    raw = {"selector": {"matchLabels": {"app": "vllm"}}, **spec}
    code, message, created = dry_run_create(cp, pool(**spec))
    assert code == 0 and created is not None, message
    defaulted = created["spec"]
    assert defaulted != raw or spec == {"sidecar": {}}
    assert parse_pool("ns", "p", defaulted) == parse_pool("ns", "p", raw)


def test_kubectl_get_shows_the_printer_columns_with_values(cp: ControlPlane) -> None:
    doc = pool(capacity="2Gi")
    doc["metadata"]["name"] = "columns"
    cp.kubectl("apply", "-f", "-", stdin=json.dumps(doc))
    ready = {"type": "Ready", "status": "False", "reason": "PodsNotReady", "message": "",
             "lastTransitionTime": "2026-11-25T00:00:00Z"}  # fmt: skip
    status = {"status": {"matchedPods": 3, "readyPods": 2, "stats": {"hitRate": 0.75}, "conditions": [ready]}}
    cp.kubectl("-n", NAMESPACE, "patch", "kvp", "columns", "--subresource=status", "--type=merge",
               "-p", json.dumps(status))  # fmt: skip
    header, row = cp.kubectl("-n", NAMESPACE, "get", "kvp", "columns").splitlines()
    assert header.split() == ["NAME", "BACKEND", "CAPACITY", "READY", "REASON", "PODS", "READY-PODS", "HIT",
                              "RATE", "AGE"]  # fmt: skip
    assert row.split()[:8] == ["columns", "cpu", "2Gi", "False", "PodsNotReady", "3", "2", "0.75"]


@pytest.mark.parametrize(
    ("name", "accepted"),
    [("a" * 39, True), ("llama-3-70b", True), ("a" * 40, False), ("7b", False), ("llama.3", False)],
    ids=["39-chars", "dashes-and-digits", "40-chars", "leading-digit", "dot"],
)
def test_pool_names_its_objects_cannot_carry_are_refused(cp: ControlPlane, name: str, accepted: bool) -> None:
    """The shared tier's StatefulSet (<name>-kvpool-redis) puts <StatefulSet>-<10 characters> in a label
    of at most 63, and its Service's name must start with a letter: refused at `kubectl apply`, not later."""
    doc = pool()
    doc["metadata"]["name"] = name
    code, message, _ = dry_run_create(cp, doc)
    assert (code == 0) is accepted, message
    if not accepted:
        assert "metadata.name must be at most 39 characters" in message
    if accepted:  # and the operator's objects named after it fit
        assert len(redis_name(name)) + len("-") + 10 <= 63
