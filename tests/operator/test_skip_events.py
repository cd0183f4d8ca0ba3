"""Whom a PodNotInjected event names: the pod's controller, else its first owner; a bare pod is its own.
The counting itself runs against the real API server (tests/k8s/test_skip_events_apiserver.py)."""

from __future__ import annotations

from kvpool_operator.skip_events import owner_of


def test_the_owner_is_the_controller_and_a_bare_pod_is_its_own() -> None:
    ref = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "vllm-7d9f8", "controller": True}
    assert owner_of({"metadata": {"generateName": "vllm-7d9f8-", "ownerReferences": [ref]}}) == (
        "ReplicaSet/vllm-7d9f8"
    )
    assert owner_of({"metadata": {"name": "solo"}}) == "Pod/solo"
    assert owner_of({"metadata": {"generateName": "x-"}}) == "Pod/x-"
    two = {
        "metadata": {
            "ownerReferences": [{"kind": "A", "name": "a"}, {"kind": "B", "name": "b", "controller": True}]
        }
    }
    assert owner_of(two) == "B/b"
