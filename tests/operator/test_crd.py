"""The KVCachePool CRD's names and columns, and what only the operator can check. The API server's own
verdicts (accepted, examples, invalid pools, defaults) are in tests/k8s/test_crd_apiserver.py."""

from __future__ import annotations

from typing import Any

from kvtest import REPO

from kvpool_operator.pool import parse_pool, problems

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


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
        "Ready",  # the Ready condition, and its reason
        "Reason",
        "Pods",
        "Ready-Pods",
        "Hit rate",
        "Age",
    ]


def test_examples_cover_the_four_cases() -> None:
    kinds = {p.stem for p in EXAMPLES}
    assert {"cpu-only", "shared-redis", "external-redis", "priority-limit"} <= kinds


def test_problems_the_schema_cannot_see_name_the_field() -> None:
    cases: dict[str, dict[str, Any]] = {
        "spec.capacity": {"capacity": "1Mi"},
        "spec.sidecar.resources.limits.memory": {
            "capacity": "4Gi",
            "sidecar": {"resources": {"limits": {"memory": "1Gi"}}},
        },
    }
    for field, spec in cases.items():
        found = problems(parse_pool("ns", "p", {"selector": {"matchLabels": {"a": "b"}}, **spec}))
        assert any(field in p for p in found), (field, found)
