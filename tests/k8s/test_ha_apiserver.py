"""Two operator replicas on a real API server: exactly one reconciles, the other takes over when the
first is lost, and the webhook injects every pod throughout, including across a rolling update of the
operator. The operator's pods run under tests/k8s/kubelet.py, so readiness is the process's own."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubeharness.controlplane import ControlPlane, get_json
from kubeharness.kubelet import CUSTOM_STATUS, LocalKubelet
from kubeharness.objects import pool_manifest
from kubeharness.operatorkit import apply, forbidden_calls, helm, namespace, pool_ready, restricted_pod_spec
from kvtest import REPO, wait_until
from podchecks import untouched

RELEASE, NAMESPACE, PEERING = "ha", "kvpool-ha", "kvpool-ha"
FULLNAME = f"{RELEASE}-kvpool"
LIFETIME = 5  # seconds a lost leader's peering entry lives
SELECTOR = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/name=kvpool"
WORKLOAD = "ha-workload"


@pytest.fixture(scope="module")
def kubelet(crd_installed: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKubelet]:
    cp = crd_installed
    annotation = ",".join(
        f"podAnnotations.{k.replace('.', chr(92) + '.')}={v}" for k, v in CUSTOM_STATUS.items()
    )
    values = [
        *("--set", f"operator.peering={PEERING}", "--set-string", annotation),
        *("--set", f"operator.peeringLifetimeSeconds={LIFETIME}", "--set", "operator.statsIntervalSeconds=1"),
    ]
    chart = str(REPO / "charts" / "kvpool")
    helm(cp, "install", RELEASE, chart, "--namespace", NAMESPACE, "--create-namespace", *values)
    node = LocalKubelet(cp, NAMESPACE, SELECTOR, tmp_path_factory.mktemp("ha")).start()
    try:
        wait_until(lambda: available(cp) == 2, 120, "two operator replicas ready (their pool index built)")
        namespace(cp, WORKLOAD, {"pod-security.kubernetes.io/enforce": "restricted"})
        yield node
        cp.kubectl("delete", "kvp", "--all", "-n", WORKLOAD, "--wait=true", "--timeout=60s")
    finally:
        node.stop()  # the replicas leave the peering while the chart's RBAC still lets them
        helm(cp, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "1m", check=False)


def available(cp: ControlPlane) -> int:
    status = get_json(cp, "-n", NAMESPACE, "deployment", FULLNAME).get("status", {})
    if status.get("updatedReplicas") != status.get("replicas"):
        return 0  # a rollout under way
    return int(status.get("availableReplicas") or 0)


def pool(name: str) -> dict[str, Any]:
    spec = {"selector": {"matchLabels": {"pool": name}}, "capacity": "64Mi", "vllmContainer": "vllm"}
    return pool_manifest(WORKLOAD, name, spec)


def pod(name: str, pool_name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": WORKLOAD, "labels": {"pool": pool_name}},
        "spec": restricted_pod_spec(args=["/models/llama"]),
    }


def reconciled_by(node: LocalKubelet, name: str) -> list[str]:
    """The replicas whose log shows kopf running the pool's reconcile handler."""
    line = re.compile(rf"\[{WORKLOAD}/{name}\] Handler 'reconcile' succeeded")
    return [p for p in list(node.running) if line.search(node.log(p))]


def acting(node: LocalKubelet) -> list[str]:
    """The replicas kopf's peering lets act now: each starts paused, and logs every resume and pause."""
    out = []
    for name in list(node.running):
        changes = re.findall(
            r"(Resuming operations|Pausing operations|Pausing all operators)", node.log(name)
        )
        if changes and changes[-1] == "Resuming operations":
            out.append(name)
    return out


def create_and_check_pod(kubelet: LocalKubelet, name: str, pool_name: str) -> set[str]:
    """Creates a pod through the API server (and so the webhook); returns the replicas that answered
    (two when the webhook's reinvocation went to another replica)."""
    manifest = json.dumps(pod(name, pool_name))
    created = json.loads(kubelet.cp.kubectl("create", "-o", "json", "-f", "-", stdin=manifest))
    assert not untouched(created), (
        f"{name} was admitted without its cache:\n{_why_untouched(kubelet, created)}"
    )
    line = f"[{WORKLOAD}/{name}] Webhook 'kvpool-inject' succeeded"
    found = wait_until(lambda: {p for p in list(kubelet.ever) if line in kubelet.log(p)}, 10,
                       f"the replica that injected {name} to log it")  # fmt: skip
    return found


def _why_untouched(kubelet: LocalKubelet, pod: dict[str, Any]) -> str:
    """What each side saw of a pod admitted untouched: its annotations (a skip reason), the API server's
    webhook errors (a call that failed open) and every replica's lines about it."""
    name = pod["metadata"]["name"]
    apiserver = kubelet.cp.procs["kube-apiserver"].output().splitlines()
    calls = [line for line in apiserver if "kvpool-inject" in line or "webhook" in line.lower()][-10:]
    replicas = {p: [line for line in kubelet.log(p).splitlines() if name in line] for p in list(kubelet.ever)}
    return (
        f"annotations: {pod['metadata'].get('annotations')}\n"
        f"API server: {chr(10).join(calls) or 'nothing about webhooks'}\n"
        + "\n".join(f"replica {p}: {lines}" for p, lines in replicas.items())
    )


def test_exactly_one_replica_reconciles_and_every_replica_injects(kubelet: LocalKubelet) -> None:
    cp = kubelet.cp
    # two replicas started together may both act for a moment, until each has seen the other's entry
    (leader,) = wait_until(
        lambda: a if len(a := acting(kubelet)) == 1 else None, 60, "the peering to settle on one"
    )
    (standby,) = set(kubelet.running) - {leader}
    apply(cp, pool("first"))
    wait_until(lambda: pool_ready(cp, WORKLOAD, "first"), 60, "the pool to be Ready")
    wait_until(lambda: reconciled_by(kubelet, "first"), 30, "a reconcile in some replica's log")
    assert reconciled_by(kubelet, "first") == [leader]
    peers = get_json(cp, "clusterkopfpeering", PEERING)["status"]
    assert set(peers) == set(kubelet.running) and len({p["priority"] for p in peers.values()}) == 2
    served = set()
    for i in range(4):
        cp.network.reset()  # the API server's next call opens a new connection: the next pod in turn
        served |= create_and_check_pod(kubelet, f"first-{i}", "first")
    assert served == {leader, standby}  # both replicas answer the webhook, the standby too


def test_the_standby_takes_over_when_the_leader_is_lost(kubelet: LocalKubelet) -> None:
    cp = kubelet.cp
    (leader,) = reconciled_by(kubelet, "first")
    (standby,) = set(kubelet.running) - {leader}
    kubelet.kill(leader)
    # the webhook goes on at once: the other replica is ready and knows the pools
    for i in range(3):
        assert create_and_check_pod(kubelet, f"lost-{i}", "first") == {standby}
    apply(cp, pool("second"))
    wait_until(
        lambda: pool_ready(cp, WORKLOAD, "second"),
        LIFETIME + 60,
        "the former standby to reconcile a new pool",
    )
    assert reconciled_by(kubelet, "second") == [standby]
    assert wait_until(lambda: available(cp) == 2, 120, "the lost replica replaced")


def test_pods_are_injected_throughout_a_rolling_update(kubelet: LocalKubelet) -> None:
    cp = kubelet.cp
    before = {get_json(cp, "-n", NAMESPACE, "pods", name)["metadata"]["uid"] for name in kubelet.running}
    helm(cp, "upgrade", RELEASE, str(REPO / "charts" / "kvpool"), "--namespace", NAMESPACE, "--reuse-values",
         "--set", "operator.statsIntervalSeconds=2")  # fmt: skip
    created = 0

    def rolled_over() -> bool:
        uids = {p["metadata"]["uid"] for p in get_json(cp, "-n", NAMESPACE, "pods", "-l", SELECTOR)["items"]}
        return available(cp) == 2 and not (uids & before)

    deadline = time.monotonic() + 180
    while not rolled_over():  # each pass: one more pod, which must be injected (not a check to retry)
        assert time.monotonic() < deadline, "the rollout did not replace both replicas in 180 s"
        create_and_check_pod(kubelet, f"rolling-{created}", "first")
        created += 1
    assert created >= 2
    wait_until(lambda: len(acting(kubelet)) == 1, 60, "one new replica to lead")
    apply(cp, pool("third"))
    wait_until(lambda: pool_ready(cp, WORKLOAD, "third"), 60, "a new replica to reconcile after the rollout")
    assert len(reconciled_by(kubelet, "third")) == 1


def test_no_replica_was_refused_by_the_api_server(kubelet: LocalKubelet) -> None:
    for name in kubelet.ever:  # the replaced replicas too
        assert forbidden_calls(kubelet.log(name)) == [], name


def test_uninstalled_while_pools_exist_nothing_is_left_stuck(kubelet: LocalKubelet) -> None:
    """Last in this file: helm uninstall with a pool still there, then its namespace deleted: both gone
    within 30 s. The status refresh used to be a kopf timer, which gave every pool kopf's finalizer;
    with no operator left to remove it the pool stayed and its namespace stayed Terminating."""
    cp = kubelet.cp
    ns = namespace(cp, "ha-leftover")
    apply(
        cp, pool_manifest(ns, "stays", {"selector": {"matchLabels": {"pool": "stays"}}, "capacity": "64Mi"})
    )
    handled = wait_until(lambda: pool_ready(cp, ns, "stays"), 60, "the pool reconciled and Ready")
    assert not handled["metadata"].get("finalizers")  # nothing for an operator to come back for
    helm(cp, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "1m")
    wait_until(lambda: not kubelet.running, 60, "the operator replicas to stop")
    cp.kubectl("delete", "namespace", ns, "--wait=false")
    wait_until(
        lambda: cp.kubectl_result("get", "namespace", ns).returncode != 0, 30, f"namespace {ns} to be gone"
    )
