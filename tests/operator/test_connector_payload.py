"""The connector reaches a stock vLLM image by itself: the init container that copies the payload from
the sidecar's image, the read-only mount and PYTHONPATH in the vLLM container, and what the webhook
does when it cannot put the payload first. The payload's contents and its imports on several Pythons
are the image test's (tests/chart/test_image.py); a pod importing it on a real kubelet is the node's
(tests/e2e/test_scenarios.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool_operator.admission_fit import added_by_injection
from kvpool_operator.injection import decide, remove_injection
from kvpool_operator.pods import sidecar_stuck
from kvpool_operator.pool import parse_pool
from kvpool_operator.resources import guaranteed
from kvpool_operator.settings import OperatorSettings

SETTINGS = OperatorSettings(sidecar_image="kvpool/sidecar:test")
POOL = parse_pool("ns", "p", {"selector": {"matchLabels": {"app": "vllm"}}, "capacity": "1Gi"})


def vllm_pod(**container: Any) -> dict[str, Any]:
    engine = {"name": "vllm", "image": "vllm/vllm-openai:v0.33.0", "args": ["--model", "m"], **container}
    return {"metadata": {"labels": {"app": "vllm"}}, "spec": {"containers": [engine]}}


def injected(pod: dict[str, Any]) -> dict[str, Any]:
    decision = decide(pod, "ns", [POOL], SETTINGS)
    assert decision.pod is not None
    return decision.pod


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    return {
        e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0].get("env", [])
    }


def test_the_payload_is_copied_before_the_sidecar_and_found_first_by_vllm() -> None:
    pod = injected(vllm_pod())
    payload, sidecar = pod["spec"]["initContainers"]
    assert payload["name"] == "kvpool-connector" and "restartPolicy" not in payload  # runs to completion
    assert payload["image"] == sidecar["image"] == "kvpool/sidecar:test"
    assert payload["volumeMounts"] == [{"name": "kvpool-connector", "mountPath": "/mnt/kvpool-connector"}]
    mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["kvpool-connector"] == {
        "name": "kvpool-connector",
        "mountPath": "/opt/kvpool-connector",
        "readOnly": True,
    }
    assert env_of(pod) == {"PYTHONPATH": "/opt/kvpool-connector"}


def test_the_users_pythonpath_follows_the_payload_and_comes_back_whole() -> None:
    pod = injected(
        vllm_pod(env=[{"name": "HF_HOME", "value": "/data"}, {"name": "PYTHONPATH", "value": "/app"}])
    )
    assert env_of(pod) == {"HF_HOME": "/data", "PYTHONPATH": "/opt/kvpool-connector:/app"}
    assert injected(pod) == pod  # re-injection: the same pod, the payload not added twice
    assert remove_injection(pod)["spec"]["containers"][0]["env"] == [
        {"name": "HF_HOME", "value": "/data"},
        {"name": "PYTHONPATH", "value": "/app"},
    ]
    assert "env" not in remove_injection(injected(vllm_pod()))["spec"]["containers"][0]


def test_an_image_that_brings_the_connector_gets_no_payload() -> None:
    pod = vllm_pod()
    pod["metadata"]["annotations"] = {"kvpool.dev/connector": "image"}
    result = injected(pod)
    assert [c["name"] for c in result["spec"]["initContainers"]] == ["kvpool-sidecar"]
    assert "env" not in result["spec"]["containers"][0]
    assert "kvpool-connector" not in {v["name"] for v in result["spec"]["volumes"]}


def test_a_pythonpath_from_a_reference_leaves_the_pod_untouched_with_a_reason() -> None:
    ref = {"configMapKeyRef": {"name": "paths", "key": "pythonpath"}}
    pod = vllm_pod(env=[{"name": "PYTHONPATH", "valueFrom": ref}])
    result = injected(pod)
    reason = result["metadata"].pop("annotations")["kvpool.dev/skipped"]
    assert result == pod
    assert reason.startswith("PythonPathNotPlain: container vllm takes PYTHONPATH from a reference")


def test_a_guaranteed_pod_stays_guaranteed_with_the_payload() -> None:
    resources = {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"cpu": "2", "memory": "8Gi"}}
    pod = injected(vllm_pod(resources=resources))
    assert guaranteed(pod)


@pytest.mark.parametrize(
    ("minimum", "unfit"),
    [({"cpu": "10m", "memory": "16Mi"}, None), ({"cpu": "100m"}, "LimitRangeExceeded")],
    ids=["fits", "min-above-the-payload"],
)
def test_the_payload_container_is_checked_against_the_namespaces_limit_ranges(
    minimum: dict[str, str], unfit: str | None
) -> None:
    """A copy of ~17 MB asks 50m and 64Mi; a namespace whose per-container minimum is above that would
    refuse the pod, so the webhook admits it untouched instead."""
    limits = [{"metadata": {"name": "lr"}, "spec": {"limits": [{"type": "Container", "min": minimum}]}}]
    resources = {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"cpu": "1", "memory": "4Gi"}}
    pod = vllm_pod(resources=resources)
    found = added_by_injection(pod, injected(pod), limits, [])
    assert (found[0] if found else None) == unfit


def test_a_payload_container_that_cannot_start_opens_the_sidecar_breaker() -> None:
    """Same image as the sidecar: an image that does not pull, or a copy that fails, holds vLLM back."""
    waiting = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off restarting"}}
    pod = {"status": {"initContainerStatuses": [{"name": "kvpool-connector", "state": waiting}]}}
    assert sidecar_stuck(pod) == "CrashLoopBackOff: back-off restarting"
