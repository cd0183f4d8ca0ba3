"""The operator and its webhook on a real API server, installed by the chart with the real helm.

The operator runs as the chart's own pod (operatorkit): the pod's args, its ServiceAccount's token, so
the API server enforces the chart's RBAC, and the chart's webhook certificate, which the API server
checks against the chart's caBundle when it calls the webhook through the chart's Service.

Tests run in file order on one release; each works in its own namespace. The last one stops the
operator (fail-open).
"""

from __future__ import annotations

import base64
import json
import secrets
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_py
from controlplane import ControlPlane, condition, get_json
from kvtest import REPO, Proc, redis_with, start_sidecar, wait_until
from operatorkit import (
    RELEASE,
    RELEASE_NAMESPACE,
    LocalOperator,
    apply,
    forbidden_calls,
    helm,
    namespace,
    operator_pods,
    pool_ready,
    pool_status,
    restricted_pod_spec,
    running,
    start_operator_as,
    webhook_routed,
)
from podchecks import assert_injected, untouched

from kvpool_operator.kube import RBAC
from kvpool_operator.names import REDIS_PORT

E2E = REPO / "tests" / "e2e" / "manifests"


@pytest.fixture(scope="module")
def operator(
    crd_installed: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ControlPlane, LocalOperator]]:
    cp = crd_installed
    # one replica, played by one local process (two replicas: test_ha_apiserver.py)
    helm(cp, "install", RELEASE, str(REPO / "charts" / "kvpool"), "--namespace", RELEASE_NAMESPACE,
         "--create-namespace", "--wait", "--timeout", "3m",
         "--set", "operator.statsIntervalSeconds=1", "--set", "operator.scaleCooldownSeconds=0",
         "--set", "replicaCount=1")  # fmt: skip
    (pod,) = wait_until(lambda: [p for p in operator_pods(cp) if running(p)], 60, "the operator's pod to run")
    op = start_operator_as(cp, pod, tmp_path_factory.mktemp("operator"))
    wait_until(lambda: webhook_routed(cp), 60, "the API server's route to the webhook")
    try:
        yield cp, op
    finally:
        op.proc.stop()
        helm(
            cp,
            "uninstall",
            RELEASE,
            "--namespace",
            RELEASE_NAMESPACE,
            "--wait",
            "--timeout",
            "1m",
            check=False,
        )


def cpu_pool(ns: str, name: str = "llama", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvpool.dev/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "selector": {"matchLabels": {"app": "vllm"}},
            "capacity": "64Mi",
            "chunkSize": 32,
            "vllmContainer": "vllm",
            **spec,
        },
    }


def restricted_deployment(ns: str, replicas: int = 2, name: str = "vllm") -> dict[str, Any]:
    """A vLLM Deployment that Pod Security `restricted` admits."""
    resources = {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"memory": "8Gi"}}
    spec = restricted_pod_spec(
        command=["vllm", "serve"], args=["/models/llama", "--port", "8000"], resources=resources
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "vllm"}},
            "template": {"metadata": {"labels": {"app": "vllm"}}, "spec": spec},
        },
    }


def pods_of(cp: ControlPlane, ns: str, selector: str = "app=vllm") -> list[dict[str, Any]]:
    items = get_json(cp, "-n", ns, "pods", "-l", selector)["items"]
    return sorted(
        (p for p in items if not p["metadata"].get("deletionTimestamp")), key=lambda p: p["metadata"]["name"]
    )


def all_ready(pods: list[dict[str, Any]], n: int) -> list[dict[str, Any]] | None:
    ready = [p for p in pods if running(p) and condition(p, "Ready") == "True"]
    return ready if len(ready) == n else None


# --- RBAC ------------------------------------------------------------------------------------------


def test_the_service_account_may_make_every_call_the_operator_needs(operator: tuple) -> None:
    cp, op = operator
    denied = []
    for (group, resource), verbs in sorted(RBAC.items()):
        if resource in ("kopfpeerings", "namespaces"):
            continue  # only for an operator that watches some namespaces (the chart's other mode)
        for verb in sorted(verbs):
            target = f"{resource.split('/')[0]}.{group}" if group else resource.split("/")[0]
            if resource == "clusterkopfpeerings" and verb == "patch":
                target += "/kvpool"  # granted by name only: the chart's own peering object
            sub = ["--subresource", resource.split("/")[1]] if "/" in resource else []
            answer = cp.kubectl_result("auth", "can-i", verb, target, *sub, "-A", kubeconfig=op.kubeconfig)
            if answer.stdout.strip() != "yes":
                denied.append(f"{verb} {resource}")
    assert denied == []


@pytest.mark.parametrize(
    "call",
    [
        ["delete", "pods"],
        ["create", "pods"],
        ["list", "secrets"],
        ["patch", "deployments.apps"],
        ["update", "kvcachepools.kvpool.dev"],
        ["create", "clusterrolebindings.rbac.authorization.k8s.io"],
        ["delete", "statefulsets.apps"],
        ["patch", "mutatingwebhookconfigurations.admissionregistration.k8s.io"],
    ],
    ids=lambda c: " ".join(c),
)
def test_the_service_account_is_refused_what_the_operator_never_does(
    operator: tuple, call: list[str]
) -> None:
    cp, op = operator
    answer = cp.kubectl_result("auth", "can-i", *call, "-A", kubeconfig=op.kubeconfig)
    assert answer.stdout.strip() == "no", answer.stdout + answer.stderr


# --- the webhook, called by the API server ---------------------------------------------------------


def test_pods_of_a_restricted_namespace_are_injected_and_admitted(operator: tuple) -> None:
    cp, _ = operator
    ns = namespace(cp, "vllm-restricted", {"pod-security.kubernetes.io/enforce": "restricted"})
    apply(cp, cpu_pool(ns))
    pool = wait_until(lambda: pool_ready(cp, ns, "llama"), 60, "the pool to be Ready")
    before = len(cp.network.connects)
    apply(cp, restricted_deployment(ns))
    pods = wait_until(lambda: all_ready(pods_of(cp, ns), 2), 90, "two injected pods Running and Ready")
    for pod in pods:
        assert_injected(pod, pool, "vllm")
        assert pod["spec"]["containers"][0]["args"][:3] == ["/models/llama", "--port", "8000"]
    service = get_json(cp, "-n", RELEASE_NAMESPACE, "service", f"{RELEASE}-webhook")
    assert f"{service['spec']['clusterIP']}:443" in cp.network.connects[before:]  # the API server called it
    events = cp.kubectl("-n", ns, "get", "events", "--field-selector", "reason=FailedCreate")
    assert "violates PodSecurity" not in events


def test_pool_status_counts_pods_and_reads_their_real_sidecars(operator: tuple, tmp_path: Path) -> None:
    cp, _ = operator
    ns = "vllm-restricted"
    pods = pods_of(cp, ns)
    pool = get_json(cp, "-n", ns, "kvp", "llama")
    status_port = int(pods[0]["metadata"]["annotations"]["kvpool.dev/status-port"])
    sidecars: list[Proc] = []
    try:
        for pod in pods:  # each pod's sidecar: the real process, on the pod's address
            address = ["--status-host", pod["status"]["podIP"], "--status-port", str(status_port)]
            sidecars.append(start_sidecar(tmp_path / pod["metadata"]["name"], "64Mi", [], *address))
        key = "ab" * 16
        _put_and_get(sidecars[0].info["url"], key)

        def counted() -> dict[str, Any] | None:
            s = pool_status(cp, ns, "llama")
            stats = s.get("stats") or {}
            return s if stats.get("sidecars") == 2 and stats.get("hits", 0) >= 1 else None

        status = wait_until(counted, 60, "the pool's status to aggregate both sidecars")
        assert status["matchedPods"] == 2 and status["readyPods"] == 2 and status["outdatedPods"] == 0
        assert status["stats"]["capacityBytes"] == 2 * 64 * 2**20
        assert status["stats"]["hitRate"] > 0
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "True" and ready["observedGeneration"] == pool["metadata"]["generation"]
        assert status["observedGeneration"] == pool["metadata"]["generation"]
        _, row = cp.kubectl("-n", ns, "get", "kvp", "llama").splitlines()
        assert row.split()[1:5] == ["cpu", "64Mi", "2", "2"]
    finally:
        for proc in sidecars:
            proc.stop()


def _put_and_get(url: str, key: str) -> None:
    request = urllib.request.Request(f"{url}/v1/chunks/{key}", data=b"x" * 4096, method="PUT",
                                     headers={"Content-Type": "application/octet-stream"})  # fmt: skip
    urllib.request.urlopen(request, timeout=5).close()
    with urllib.request.urlopen(f"{url}/v1/chunks/{key}", timeout=5) as r:
        assert r.read() == b"x" * 4096


def test_a_changed_pool_marks_running_pods_outdated_with_an_event(operator: tuple) -> None:
    cp, _ = operator
    ns = "vllm-restricted"
    cp.kubectl(
        "-n", ns, "patch", "kvp", "llama", "--type=merge", "-p", json.dumps({"spec": {"chunkSize": 64}})
    )
    status = wait_until(lambda: (s := pool_status(cp, ns, "llama")).get("outdatedPods") == 2 and s, 60,
                        "both running pods counted outdated")  # fmt: skip
    assert json.loads(status["connectorConfig"])["kv_connector_extra_config"]["chunk_size"] == 64
    events = get_json(cp, "-n", ns, "events", "--field-selector", "involvedObject.kind=KVCachePool")["items"]
    assert any(e["involvedObject"]["name"] == "llama" for e in events), events


# --- the shared Redis tier -------------------------------------------------------------------------


def test_shared_tier_objects_scaling_and_garbage_collection(operator: tuple) -> None:
    cp, _ = operator
    ns = namespace(cp, "shared-tier")
    tier = "cache-kvpool-redis"
    redis = {"mode": "shared", "replicas": 1, "memory": "32Mi"}
    scaling = {"minReplicas": 1, "maxReplicas": 2, "targetMemoryUtilization": 50}
    apply(cp, cpu_pool(ns, "cache", backend="redis", redis=redis, scaling=scaling))
    wait_until(
        lambda: cp.kubectl_result("-n", ns, "get", "statefulset", tier).returncode == 0, 60, "the StatefulSet"
    )
    for kind, name in (
        ("service", tier),
        ("secret", tier),
        ("secret", "cache-kvpool-key"),
        ("configmap", "cache-kvpool"),
    ):
        owner = get_json(cp, "-n", ns, kind, name)["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["controller"]) == ("KVCachePool", "cache", True)
    shard = wait_until(lambda: all_ready(pods_of(cp, ns, "kvpool.dev/pool=cache"), 1), 90, "the first shard")[
        0
    ]
    password = _secret_password(cp, ns, tier)
    ip = shard["status"]["podIP"]
    # the real redis-server as the shard pod: on its address and port, with its password and maxmemory
    maxmemory = ("--maxmemory", str(int(32 * 2**20 * 0.9)), "--maxmemory-policy", "allkeys-lru")
    with redis_with(*maxmemory, password=password, port=REDIS_PORT, host=ip):
        shared = lambda: pool_status(cp, ns, "cache").get("sharedTier") or {}  # noqa: E731
        wait_until(lambda: shared().get("readyReplicas") == 1, 60, "the shard counted ready")
        _fill(ip, password, 24 * 2**20)  # 24 of 28.8 MiB maxmemory: ~83% against a 50% target
        # a deadline for a loaded CI machine: the operator polls the shard's memory on its refresh timer
        wait_until(lambda: get_json(cp, "-n", ns, "statefulset", tier)["spec"]["replicas"] == 2, 150,
                   "the operator to scale the tier to two shards")  # fmt: skip
    cp.kubectl("-n", ns, "delete", "kvp", "cache", "--wait=true", "--timeout=60s")

    def collected() -> bool:  # by the controller manager's garbage collector, from the ownerReferences
        out = cp.kubectl("-n", ns, "get", f"statefulset/{tier}", f"service/{tier}", f"secret/{tier}",
                         "secret/cache-kvpool-key", "configmap/cache-kvpool",
                         "--ignore-not-found", "-o", "name")  # fmt: skip
        return out.strip() == ""

    wait_until(collected, 90, "the pool's objects to be garbage-collected")


def _secret_password(cp: ControlPlane, ns: str, name: str) -> str:
    return base64.b64decode(get_json(cp, "-n", ns, "secret", name)["data"]["password"]).decode()


def _fill(ip: str, password: str, nbytes: int) -> None:
    value = secrets.token_bytes(64 * 1024)
    with (
        redis_py.Redis(host=ip, port=REDIS_PORT, password=password) as client,
        client.pipeline(transaction=False) as pipe,
    ):
        for i in range(nbytes // len(value)):
            pipe.set(f"fill:{i}", value)
        pipe.execute()


# --- RBAC, again, and fail-open (last: it stops the operator) ---------------------------------------


def test_the_api_server_never_refused_the_operator(operator: tuple) -> None:
    _, op = operator
    assert forbidden_calls(op.proc.output()) == []


def test_pods_created_while_the_operator_is_down_are_admitted_untouched(operator: tuple) -> None:
    cp, op = operator
    ns = namespace(cp, "operator-down", {"pod-security.kubernetes.io/enforce": "restricted"})
    apply(cp, cpu_pool(ns))
    wait_until(lambda: pool_ready(cp, ns, "llama"), 60, "the pool to be Ready")
    op.proc.stop()
    apply(cp, restricted_deployment(ns, replicas=1))
    (pod,) = wait_until(lambda: all_ready(pods_of(cp, ns), 1), 90, "the pod, created without the webhook")
    assert untouched(pod)
