"""The webhook never injects a sidecar that would get the pod refused by its namespace's LimitRanges
or ResourceQuotas (the pure decisions; tests/k8s shows the real API server admits what comes out)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool_operator import names
from kvpool_operator.admission_fit import limit_range_problems, quota_problems
from kvpool_operator.injection import NamespaceLimits, decide
from kvpool_operator.pool import parse_pool
from kvpool_operator.settings import OperatorSettings
from kvpool_operator.vllm_target import Skip


def _pod(**resources: Any) -> dict[str, Any]:
    engine = {"name": "engine", "image": "vllm", "command": ["vllm", "serve", "m"], "resources": resources}
    return {"metadata": {"labels": {"app": "vllm"}}, "spec": {"containers": [engine]}}


def _decide(pod: dict[str, Any], capacity: str = "16Gi", **limits: Any) -> tuple[str | None, dict[str, Any]]:
    """(the skip reason or None, the admitted pod)."""
    pool = parse_pool("ns", "p", {"selector": {"matchLabels": {"app": "vllm"}}, "capacity": capacity})
    admitted = decide(pod, "ns", [pool], OperatorSettings(), NamespaceLimits(**limits)).pod
    assert admitted is not None
    note = admitted["metadata"].get("annotations", {}).get(names.SKIPPED_ANNOTATION)
    return (note.split(":")[0] if note else None), admitted


def _range(*items: dict[str, Any], name: str = "limits") -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"limits": list(items)}}


def _sidecar(pod: dict[str, Any]) -> bool:
    spec = pod["spec"]
    return any(
        c["name"] == names.SIDECAR_CONTAINER for c in spec.get("initContainers", []) + spec["containers"]
    )


def test_a_container_maximum_below_the_sidecars_memory_leaves_the_pod_untouched() -> None:
    """The review's case: max 12Gi per container, a 16Gi pool: every pod was forbidden."""
    reason, admitted = _decide(
        _pod(), limit_ranges=[_range({"type": "Container", "max": {"memory": "12Gi"}})]
    )
    assert reason == "LimitRangeExceeded" and not _sidecar(admitted)
    note = admitted["metadata"]["annotations"][names.SKIPPED_ANNOTATION]
    assert "maximum memory per Container (kvpool-sidecar) is 12288Mi" in note


def test_a_pod_that_fits_with_the_sidecar_gets_it() -> None:
    limits = [_range({"type": "Container", "max": {"memory": "32Gi", "cpu": "8"}, "min": {"memory": "1Mi"}})]
    reason, admitted = _decide(_pod(limits={"memory": "8Gi"}), limit_ranges=limits)
    assert reason is None and _sidecar(admitted)


@pytest.mark.parametrize(
    "item",
    [
        {"type": "Pod", "max": {"memory": "20Gi"}},  # the pod's 8Gi and the sidecar's 16Gi together
        {"type": "Container", "min": {"cpu": "2"}},  # the sidecar asks for less CPU than that
    ],
    ids=["pod-max", "container-min"],
)
def test_other_limits_the_sidecar_would_break(item: dict[str, Any]) -> None:
    resources = {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"cpu": "2", "memory": "8Gi"}}
    reason, admitted = _decide(_pod(**resources), capacity="16Gi", limit_ranges=[_range(item)])
    assert reason == "LimitRangeExceeded" and not _sidecar(admitted)


def test_the_limit_request_ratio() -> None:
    rng = [_range({"type": "Container", "maxLimitRequestRatio": {"memory": "2"}})]
    assert limit_range_problems(_pod(requests={"memory": "1Gi"}, limits={"memory": "2Gi"}), rng) == []
    (problem,) = limit_range_problems(_pod(requests={"memory": "1Gi"}, limits={"memory": "3Gi"}), rng)
    assert "memory limit/request per Container (engine) is at most 2" in problem


def test_a_limit_the_pod_breaks_anyway_is_not_the_sidecars() -> None:
    """The API server refuses this pod with or without the sidecar: kvpool does not hide why."""
    limits = [_range({"type": "Pod", "max": {"memory": "4Gi"}})]
    reason, admitted = _decide(_pod(limits={"memory": "8Gi"}), capacity="1Gi", limit_ranges=limits)
    assert reason is None and _sidecar(admitted)


def test_a_sidecar_counts_in_the_pod_with_the_regular_containers_and_an_init_container_beside_it() -> None:
    sidecar = {"name": "s", "restartPolicy": "Always", "resources": {"limits": {"memory": "2Gi"}}}
    init = {"name": "i", "resources": {"limits": {"memory": "5Gi"}}}
    pod = _pod(limits={"memory": "2Gi"})
    pod["spec"]["initContainers"] = [sidecar, init]
    rng = [_range({"type": "Pod", "max": {"memory": "6Gi"}})]
    assert limit_range_problems(pod, rng) == [
        "LimitRange limits: maximum memory per Pod is 6144Mi, the limit is 7168Mi"
    ]
    pod["spec"]["initContainers"] = [init, sidecar]  # the init container runs before the sidecar starts
    assert limit_range_problems(pod, rng) == []


def test_defaults_apply_before_the_checks() -> None:
    rng = _range({"type": "Container", "default": {"memory": "1Gi"}, "max": {"memory": "2Gi"}})
    assert limit_range_problems(_pod(), [rng]) == []  # no limit of its own: the default, within max


def test_a_quota_the_sidecar_would_exceed_leaves_the_pod_untouched() -> None:
    """The review's case: 40Gi of requests.memory, the fifth 8Gi pod fits only without its sidecar."""
    quota: dict[str, Any] = {
        "metadata": {"name": "mem"},
        "spec": {"hard": {"requests.memory": "40Gi"}},
        "status": {"hard": {"requests.memory": "40Gi"}, "used": {"requests.memory": "32Gi"}},
    }
    pod = _pod(requests={"memory": "8Gi"}, limits={"memory": "8Gi"})
    reason, admitted = _decide(pod, capacity="1Gi", quotas=[quota])
    assert reason == "QuotaExceeded" and not _sidecar(admitted)
    assert "requests.memory would be" in admitted["metadata"]["annotations"][names.SKIPPED_ANNOTATION]
    quota["status"]["used"] = {"requests.memory": "20Gi"}
    assert _decide(pod, capacity="1Gi", quotas=[quota])[0] is None
    assert quota_problems(pod, pod, [quota]) == []


def test_limits_it_cannot_read_give_a_skip_with_the_reason_never_a_broken_pod() -> None:
    reason, admitted = _decide(
        _pod(), limit_ranges=[_range({"type": "Container", "max": {"memory": "12 Gi"}})]
    )
    assert reason == "LimitsUnreadable" and not _sidecar(admitted)
    pool = parse_pool("ns", "p", {"selector": {"matchLabels": {"app": "vllm"}}, "capacity": "1Gi"})
    unread = Skip("LimitsUnreadable", "cannot read the namespace's LimitRanges: 403")
    skipped = decide(_pod(), "ns", [pool], OperatorSettings(), unread).pod
    assert skipped is not None and not _sidecar(skipped)
