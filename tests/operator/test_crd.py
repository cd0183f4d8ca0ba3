"""The KVCachePool CRD: valid for Kubernetes, examples valid, bad pools refused naming the field,
CEL rules evaluated with cel-python, defaults equal to the operator's."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import CRD_PATH
from crdschema import apply_defaults, validate, version_schema
from kvtest import REPO, need

from kvpool_operator.pool import parse_pool, problems

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def kubernetes_validate() -> str:
    found = shutil.which("kubernetes-validate") or str(Path(sys.executable).parent / "kubernetes-validate")
    need(Path(found).exists(), "kubernetes-validate (pip)")
    return found


def test_crd_passes_kubernetes_validate_strict() -> None:
    result = subprocess.run(
        [kubernetes_validate(), "--strict", str(CRD_PATH)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed" in result.stdout


def test_crd_names_columns_and_status(crd: dict[str, Any]) -> None:
    spec = crd["spec"]
    assert (spec["group"], spec["names"]["kind"], spec["names"]["plural"]) == (
        "kvpool.dev",
        "KVCachePool",
        "kvcachepools",
    )
    assert spec["names"]["shortNames"] == ["kvp"] and spec["scope"] == "Namespaced"
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Backend",
        "Capacity",
        "Pods",
        "Ready",
        "Hit rate",
        "Age",
    ]


def test_examples_cover_the_four_cases() -> None:
    kinds = {p.stem for p in EXAMPLES}
    assert {"cpu-only", "shared-redis", "external-redis", "priority-limit"} <= kinds


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_is_valid_and_usable(crd: dict[str, Any], path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    assert validate(crd, doc) == []
    defaulted = apply_defaults(version_schema(crd), doc)
    pool = parse_pool("default", doc["metadata"]["name"], defaulted["spec"])
    assert problems(pool) == []


def pool(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvpool.dev/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"selector": {"matchLabels": {"app": "vllm"}}, **spec},
    }


SHARED = {"backend": "redis", "redis": {"mode": "shared"}}

# (case, spec fields, the field the refusal must name)
INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("unknown backend", {"backend": "memcached"}, "spec.backend"),
    ("capacity not a quantity", {"capacity": "lots"}, "spec.capacity"),
    ("capacity negative", {"capacity": "-1Gi"}, "spec.capacity"),
    ("capacity zero bytes as int", {"capacity": 0}, "spec.capacity"),
    ("chunk size too small", {"chunkSize": 8}, "spec.chunkSize"),
    ("chunk size a string", {"chunkSize": "256"}, "spec.chunkSize"),
    ("negative skipLastNTokens", {"skipLastNTokens": -1}, "spec.skipLastNTokens"),
    ("priorityLimit a string", {"priorityLimit": "high"}, "spec.priorityLimit"),
    ("saveDecodeCache a string", {"saveDecodeCache": "yes"}, "spec.saveDecodeCache"),
    ("sidecar port too high", {"sidecar": {"port": 65535}}, "spec.sidecar.port"),
    ("sidecar port privileged", {"sidecar": {"port": 80}}, "spec.sidecar.port"),
    ("bad container name", {"vllmContainer": "VLLM_main"}, "spec.vllmContainer"),
    ("unknown field", {"chunksize": 128}, "spec"),
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
        "spec.selector.matchExpressions[].values",
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
        "min above max",
        {**SHARED, "scaling": {"minReplicas": 4, "maxReplicas": 2}},
        "spec.scaling.minReplicas",
    ),
    ("scaling without max", {**SHARED, "scaling": {"minReplicas": 1}}, "spec.scaling.maxReplicas"),
    (
        "target above 100",
        {**SHARED, "scaling": {"maxReplicas": 2, "targetMemoryUtilization": 120}},
        "spec.scaling.targetMemoryUtilization",
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
def test_invalid_pool_is_refused_naming_the_field(
    crd: dict[str, Any], case: str, spec: dict[str, Any], field: str
) -> None:
    errors = validate(crd, pool(**spec))
    assert errors, f"{case}: accepted"
    assert any(field in e for e in errors), f"{case}: {errors} does not name {field}"


def test_missing_selector_is_refused(crd: dict[str, Any]) -> None:
    doc = pool()
    del doc["spec"]["selector"]
    assert any("selector" in e for e in validate(crd, doc))


def test_cel_rules_accept_what_they_should(crd: dict[str, Any]) -> None:
    accepted = [
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
    ]
    for spec in accepted:
        assert validate(crd, pool(**spec)) == [], spec


def test_problems_the_schema_cannot_see_name_the_field() -> None:
    cases = {
        "spec.capacity": {"capacity": "1Mi"},
        "spec.sidecar.resources.limits.memory": {
            "capacity": "4Gi",
            "sidecar": {"resources": {"limits": {"memory": "1Gi"}}},
        },
    }
    for field, spec in cases.items():
        found = problems(parse_pool("ns", "p", {"selector": {"matchLabels": {"a": "b"}}, **spec}))
        assert any(field in p for p in found), (field, found)


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
def test_crd_defaults_equal_the_operators(crd: dict[str, Any], spec: dict[str, Any]) -> None:
    """A pool the API server defaulted and one it did not (created before a default existed) read the same."""
    raw = {"selector": {"matchLabels": {"app": "vllm"}}, **spec}
    defaulted = apply_defaults(version_schema(crd), {"spec": raw})["spec"]
    assert defaulted != raw or spec == {"sidecar": {}}
    assert parse_pool("ns", "p", defaulted) == parse_pool("ns", "p", raw)
