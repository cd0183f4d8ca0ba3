"""kvpool's pods on a real kubelet: the chart's operator image serving the webhook through its
Service, pools injecting real pods whose native sidecar runs from kvpool's image, the shared Redis tier
as real Redis pods reached by their DNS names, a killed sidecar, a rolling update, a namespace under
Pod Security `restricted`, and an uninstall that leaves nothing behind.

The workload is a stand-in for vLLM (manifests/vllm_standin.py) in kvpool's sidecar image: it reports
what the vLLM container sees (its argv, the arena's files and whether it may use them). The tests run
in file order on one cluster; the last one uninstalls.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import pytest
import yaml
from clusterkit import (
    HERE,
    NAMESPACE,
    RELEASE_NAMESPACE,
    Cluster,
    condition,
    container_status,
    container_statuses,
    get_json,
    helm,
    kubectl,
    kubectl_json,
    pods,
    port_forward,
)
from kvtest import wait_until
from podchecks import assert_injected

pytestmark = pytest.mark.e2e

STATUS_PORT = 7071  # the pools' default sidecar port 7070 + 1
# the node has 2 CPUs for every scenario's pods and the vLLM ones (test_vllm.py) after them
SMALL_SIDECAR = {"requests": {"cpu": "20m"}}
RESTRICTED = "kvpool-e2e-restricted"


def apply(manifest: dict[str, Any] | str) -> None:
    kubectl("apply", "-f", "-", stdin=manifest if isinstance(manifest, str) else json.dumps(manifest))


def pool(name: str, namespace: str, selector: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "kvpool.dev/v1alpha1", "kind": "KVCachePool",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": {"matchLabels": {"app": selector}}, "capacity": "64Mi", "chunkSize": 32,
                     "vllmContainer": "vllm", "sidecar": {"resources": SMALL_SIDECAR}, **spec}}  # fmt: skip


def workload(cluster: Cluster, name: str, namespace: str, replicas: int = 2, **env: str) -> None:
    """The stand-in Deployment (manifests/workload.yaml) and the ConfigMap holding its script; `env`
    goes to the stand-in."""
    script = HERE / "manifests" / "vllm_standin.py"
    apply(kubectl("-n", namespace, "create", "configmap", "vllm-standin", f"--from-file={script}",
                  "--dry-run=client", "-o", "json"))  # fmt: skip
    text = (
        (HERE / "manifests" / "workload.yaml").read_text().replace("SIDECAR_IMAGE", cluster.images["sidecar"])
    )
    deployment = yaml.safe_load(text.replace("NAME", name).replace("replicas: 2", f"replicas: {replicas}"))
    (standin,) = deployment["spec"]["template"]["spec"]["containers"]
    standin["env"] = [{"name": k, "value": v} for k, v in env.items()]
    kubectl("-n", namespace, "apply", "-f", "-", stdin=json.dumps(deployment))


def rolled_out(name: str, namespace: str) -> None:
    kubectl("-n", namespace, "rollout", "status", f"deployment/{name}", "--timeout", "180s", timeout=200)


def ready_pods(selector: str, count: int, namespace: str) -> list[dict[str, Any]]:
    def all_ready() -> list[dict[str, Any]] | None:
        found = pods(selector, namespace)
        ok = len(found) == count and all(
            p["status"].get("containerStatuses") and all(s.get("ready") for s in container_statuses(p))
            for p in found
        )
        return found if ok else None

    return wait_until(all_ready, 180, f"{count} pods {selector} in {namespace} with every container ready")


def report(pod: str, namespace: str) -> dict[str, Any]:
    with port_forward(pod, 8000, namespace) as url:
        return get_json(url + "/report")


def served(pod: str) -> dict[str, Any] | None:
    """The stand-in's report once its connector stored a chunk in the sidecar and read it back."""
    seen = report(pod, NAMESPACE)
    return seen if seen["connector"].get("read_back") else None


def test_the_operator_runs_from_its_image_with_two_replicas(cluster: Cluster) -> None:
    deployment = kubectl_json("-n", RELEASE_NAMESPACE, "get", "deployment", "kvpool")
    assert deployment["status"].get("readyReplicas") == 2
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == cluster.images["operator"]
    # the API server reaches the webhook through its Service; the EndpointSlice controller
    # publishes a pod's readiness after the Deployment counts it, so wait for both endpoints
    wait_until(
        lambda: len(webhook_endpoints()) == 2, 60, "both operator replicas behind the webhook's Service"
    )


def webhook_endpoints() -> list[dict[str, Any]]:
    slices = kubectl_json("-n", RELEASE_NAMESPACE, "get", "endpointslices", "-l",
                          "kubernetes.io/service-name=kvpool-webhook")["items"]  # fmt: skip
    return [e for s in slices for e in s.get("endpoints") or [] if e["conditions"].get("ready")]


def test_a_cpu_pool_injects_real_pods_whose_sidecar_serves(cluster: Cluster) -> None:
    apply(pool("cpu", NAMESPACE, "work-cpu"))
    wait_until(lambda: condition("cpu", "Ready") is not None, 60, "the cpu pool's first status")
    workload(cluster, "work-cpu", NAMESPACE)
    rolled_out("work-cpu", NAMESPACE)
    found = ready_pods("app=work-cpu", 2, NAMESPACE)
    published = kubectl_json("-n", NAMESPACE, "get", "kvp", "cpu")
    for p in found:
        assert_injected(p, published, "vllm")
        sidecar = next(c for c in p["spec"]["initContainers"] if c["name"] == "kvpool-sidecar")
        assert sidecar["image"] == cluster.images["sidecar"]
        with port_forward(p["metadata"]["name"], STATUS_PORT) as url:
            stats = get_json(url + "/stats")
            assert stats["capacity_bytes"] == 64 * 2**20
        seen = wait_until(partial(served, p["metadata"]["name"]), 60, "a chunk through the loaded connector")
        assert "--kv-transfer-config" in seen["argv"]
        # the vLLM container (another uid) can use the arena the sidecar made: what the connector needs
        assert seen["arena_files"] and all(seen["arena_rw"].values()), seen
        # a Python with no kvpool and no xxhash loaded the connector from the payload kvpool staged,
        # and its client stored a chunk in the sidecar and read it back
        assert seen["python"] == "/usr/bin/python3"
        connector = seen["connector"]
        assert connector["module"] == "/opt/kvpool-connector/kvpool_connector/__init__.py", connector
        assert connector["xxhash"].startswith("/opt/kvpool-connector/xxhash/"), connector
        assert connector["stored"] and connector["read_back"], connector
        assert all(s["restartCount"] == 0 for s in container_statuses(p)), container_statuses(p)

    def pool_ready() -> dict[str, Any] | None:
        s = kubectl_json("-n", NAMESPACE, "get", "kvp", "cpu").get("status", {})
        return s if s.get("readyPods") == 2 and condition("cpu", "Ready") == "True" else None

    wait_until(pool_ready, 120, "the cpu pool to count two ready pods and say Ready")


def test_the_shared_redis_tier_runs_as_real_redis_pods_reached_by_name(cluster: Cluster) -> None:
    redis = {"mode": "shared", "replicas": 1, "memory": "64Mi", "image": cluster.images["redis"]}
    apply(pool("shared", NAMESPACE, "work-redis", backend="redis", redis=redis))
    workload(cluster, "work-redis", NAMESPACE, replicas=1)
    rolled_out("work-redis", NAMESPACE)
    (p,) = ready_pods("app=work-redis", 1, NAMESPACE)

    def shard_ready() -> bool:  # it starts beside the workload: a pod never waits for its cache
        shard = kubectl_json("-n", NAMESPACE, "get", "statefulset", "shared-kvpool-redis")
        return shard["status"].get("readyReplicas") == 1

    wait_until(shard_ready, 120, "the shared tier's one shard to be ready")
    with port_forward(p["metadata"]["name"], STATUS_PORT) as url:
        # the sidecar found the shard through its Service's DNS name (CoreDNS on the node)
        tier = wait_until(lambda: (t := get_json(url + "/stats")["tiers"]["redis"])["ready"] and t, 120,
                          "the sidecar's Redis tier to be ready")  # fmt: skip
    assert tier["ready"] is True
    wait_until(lambda: condition("shared", "Ready") == "True", 120, "the shared pool to say Ready")


def test_a_deleted_secret_reaches_the_running_sidecar_through_the_kubelet(cluster: Cluster) -> None:
    """The shared tier's password and the pool key deleted (#21 item 2): the operator makes both again
    with new values, the Redis shard restarts with the new password, and the running sidecar reads both
    from its mounted Secret as the real kubelet updates it: its Redis tier is ready again without a
    restart of the sidecar or of vLLM. (With the values in env, as before, it never was.)"""
    (p,) = ready_pods("app=work-redis", 1, NAMESPACE)
    name = p["metadata"]["name"]
    restarts = {c["name"]: c["restartCount"] for c in container_statuses(p)}
    kubectl("-n", NAMESPACE, "delete", "secret", "shared-kvpool-redis", "shared-kvpool-key")
    wait_until(lambda: kubectl("-n", NAMESPACE, "get", "events", "--field-selector",
                               "reason=CredentialsRecreated", "-o", "name").strip(), 60,
               "the Secrets made again, and said")  # fmt: skip

    def shard_rolled() -> bool:
        shard = kubectl_json("-n", NAMESPACE, "get", "statefulset", "shared-kvpool-redis")
        rolled = shard["status"].get("updateRevision") == shard["status"].get("currentRevision")
        return (
            "kvpool.dev/credentials-checksum" in shard["spec"]["template"]["metadata"].get("annotations", {})
            and rolled
            and shard["status"].get("readyReplicas") == 1
        )

    wait_until(shard_rolled, 120, "the shard restarted with the new password")
    with port_forward(name, STATUS_PORT) as url:
        wait_until(lambda: get_json(url + "/stats")["tiers"]["redis"]["ready"], 120,
                   "the running sidecar on the new password and key")  # fmt: skip
    after = kubectl_json("-n", NAMESPACE, "get", "pod", name)
    assert {c["name"]: c["restartCount"] for c in container_statuses(after)} == restarts


def test_a_killed_sidecar_restarts_and_the_vllm_container_keeps_running(cluster: Cluster) -> None:
    first = pods("app=work-cpu", NAMESPACE)[0]
    name, uid = first["metadata"]["name"], first["metadata"]["uid"]
    before = container_status(first, "kvpool-sidecar")
    vllm_restarts = container_status(first, "vllm")["restartCount"]
    cluster.kill_container(before["containerID"])

    def restarted() -> dict[str, Any] | None:
        p = kubectl_json("-n", NAMESPACE, "get", "pod", name)
        s = container_status(p, "kvpool-sidecar")
        return p if s["restartCount"] > before["restartCount"] and s.get("ready") else None

    after = wait_until(restarted, 120, "the killed sidecar to be restarted and ready again")
    assert after["metadata"]["uid"] == uid  # the same pod: a sidecar restart never replaces it
    assert container_status(after, "vllm")["restartCount"] == vllm_restarts
    # a fresh arena, usable again by the connector vLLM loaded before the kill
    seen = wait_until(lambda: served(name), 60, "a chunk through the connector into the restarted sidecar")
    assert seen["arena_files"] and all(seen["arena_rw"].values()), seen


def test_a_rolling_update_keeps_the_injection(cluster: Cluster) -> None:
    old = {p["metadata"]["name"] for p in pods("app=work-cpu", NAMESPACE)}
    kubectl("-n", NAMESPACE, "patch", "deployment", "work-cpu", "--type", "merge", "-p",
            json.dumps({"spec": {"template": {"metadata": {"annotations": {"e2e/rev": "2"}}}}}))  # fmt: skip
    rolled_out("work-cpu", NAMESPACE)
    found = ready_pods("app=work-cpu", 2, NAMESPACE)
    assert not old & {p["metadata"]["name"] for p in found}
    published = kubectl_json("-n", NAMESPACE, "get", "kvp", "cpu")
    for p in found:
        assert_injected(p, published, "vllm")


def test_a_restricted_namespace_runs_injected_pods(cluster: Cluster) -> None:
    kubectl("create", "namespace", RESTRICTED, check=False)
    kubectl("label", "namespace", RESTRICTED, "kvpool.dev/injection=enabled",
            "pod-security.kubernetes.io/enforce=restricted", "--overwrite")  # fmt: skip
    apply(pool("cpu", RESTRICTED, "work-restricted"))
    workload(cluster, "work-restricted", RESTRICTED, replicas=1)
    rolled_out("work-restricted", RESTRICTED)
    (p,) = ready_pods("app=work-restricted", 1, RESTRICTED)
    assert_injected(p, kubectl_json("-n", RESTRICTED, "get", "kvp", "cpu"), "vllm")
    seen = report(p["metadata"]["name"], RESTRICTED)
    assert seen["arena_files"] and all(seen["arena_rw"].values()), seen


def test_a_vllm_that_fails_once_injected_opens_the_breaker_and_new_pods_run_without_the_cache(
    cluster: Cluster,
) -> None:
    """A vLLM that cannot run with kvpool's flag (the stand-in told to exit on it): the kubelet's crash
    loop opens the pool's vLLM breaker for that image, the pool says why, and the next pod of the same
    image is admitted untouched and runs."""
    apply(pool("breaker", NAMESPACE, "work-breaker"))
    wait_until(lambda: condition("breaker", "Ready") is not None, 60, "the breaker pool's first status")
    workload(cluster, "work-breaker", NAMESPACE, replicas=1, STANDIN_EXIT_ON_KVPOOL="1")
    image = cluster.images["sidecar"]  # the stand-in's image

    def opened_images() -> list[dict[str, Any]] | None:
        status = kubectl_json("-n", NAMESPACE, "get", "kvp", "breaker").get("status", {})
        return (status.get("vllmFailing") or {}).get("images")

    failing = wait_until(opened_images, 180, "the kubelet's crash loop to open the vLLM breaker")
    (opened,) = failing
    assert opened["image"] == image and opened["reason"].startswith("CrashLoopBackOff, exit code 3"), opened
    status = kubectl_json("-n", NAMESPACE, "get", "kvp", "breaker")["status"]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "VLLMFailing", ready
    events = kubectl_json("-n", NAMESPACE, "get", "events", "--field-selector", "reason=VLLMFailing")["items"]
    assert any(opened["pod"] in e["message"] and image in e["message"] for e in events), events

    kubectl("-n", NAMESPACE, "scale", "deployment", "work-breaker", "--replicas=2")

    def untouched_and_running() -> dict[str, Any] | None:
        for p in pods("app=work-breaker", NAMESPACE):
            skipped = (p["metadata"].get("annotations") or {}).get("kvpool.dev/skipped", "")
            statuses = container_statuses(p)
            if skipped.startswith("VLLMFailing: ") and statuses and all(s.get("ready") for s in statuses):
                return p
        return None

    new = wait_until(untouched_and_running, 120, "a new pod of the image admitted without the cache, running")
    assert [c["name"] for c in new["spec"]["containers"]] == ["vllm"] and "initContainers" not in new["spec"]
    assert container_status(new, "vllm")["restartCount"] == 0
    kubectl("-n", NAMESPACE, "delete", "deployment", "work-breaker", "--wait=false")


def test_uninstall_leaves_nothing(cluster: Cluster) -> None:
    namespaces = (NAMESPACE, RESTRICTED)
    for ns in namespaces:
        kubectl("-n", ns, "delete", "kvp", "--all", "--wait=true", "--timeout=60s", timeout=90)
    helm("uninstall", "kvpool", "--namespace", RELEASE_NAMESPACE, "--wait", "--timeout", "120s", timeout=150)
    kubectl("delete", "namespace", *namespaces, RELEASE_NAMESPACE, "--wait=false")

    def gone() -> bool:
        left = kubectl("get", "namespaces", "-o", "name").split()
        return not {f"namespace/{ns}" for ns in (*namespaces, RELEASE_NAMESPACE)} & set(left)

    wait_until(gone, 120, "the namespaces to be deleted")
    hooks = kubectl("get", "mutatingwebhookconfigurations,validatingwebhookconfigurations", "-o", "name")
    assert "kvpool" not in hooks
    leftovers = kubectl("get", "clusterroles,clusterrolebindings", "-o", "name")
    assert "kvpool" not in leftovers
