"""The local control plane keeps its fake node alive as a kubelet would: the node's Lease is renewed
(kwok), so the node lifecycle controller never marks the node, and every pod on it, NotReady while a
test waits on a pod's readiness."""

from __future__ import annotations

from kubeharness.controlplane import NODE_NAME, ControlPlane, get_json
from kvtest import wait_until


def _renewed_at(cp: ControlPlane) -> str | None:
    result = cp.kubectl_result("-n", "kube-node-lease", "get", "lease", NODE_NAME, "-o", "json")
    if result.returncode != 0:
        return None
    return get_json(cp, "-n", "kube-node-lease", "lease", NODE_NAME)["spec"].get("renewTime")


def test_the_node_renews_its_lease_as_a_kubelet_does(control_plane: ControlPlane) -> None:
    first = wait_until(lambda: _renewed_at(control_plane), 30, "the node's Lease")
    wait_until(lambda: _renewed_at(control_plane) not in (None, first), 30, "the Lease renewed")
    node = get_json(control_plane, "node", NODE_NAME)
    assert [c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready"] == ["True"]
