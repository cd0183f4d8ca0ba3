"""The operator and its webhook on a real API server, installed by the chart with the real helm.

The operator runs as the chart's own pod (operatorkit): the pod's args, its ServiceAccount's token, so
the API server enforces the chart's RBAC, and the chart's webhook certificate, which the API server
checks against the chart's caBundle when it calls the webhook through the chart's Service.

Tests run in file order on one release; each works in its own namespace. The last one stops the
operator (fail-open).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from kubeharness.controlplane import ControlPlane, get_json, kubectl_binary
from kubeharness.kubelet import CUSTOM_STATUS
from kubeharness.objects import condition, pool_manifest, secret_value
from kubeharness.operatorkit import (
    RELEASE,
    RELEASE_NAMESPACE,
    LocalOperator,
    all_ready,
    apply,
    forbidden_calls,
    namespace,
    one_replica_release,
    operator_pods,
    pods_of,
    pool_ready,
    pool_status,
    restricted_deployment,
)
from kvtest import REPO, Proc, free_port, redis_with, start_sidecar, wait_until, write_auth
from podchecks import assert_injected, sidecar_of, untouched

from kvpool_operator.credentials import checksum
from kvpool_operator.kube import RBAC
from kvpool_operator.names import CREDENTIALS_CHECKSUM_ANNOTATION as CHECKSUM
from kvpool_operator.names import REDIS_PORT
from kvpool_sidecar.client import SidecarClient

E2E = REPO / "tests" / "e2e" / "manifests"


@pytest.fixture(scope="module")
def operator(
    crd_installed: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ControlPlane, LocalOperator]]:
    cp = crd_installed
    # one replica, played by one local process (two replicas: test_ha_apiserver.py)
    values = ("operator.statsIntervalSeconds=1", "operator.scaleCooldownSeconds=0")
    with one_replica_release(cp, tmp_path_factory.mktemp("operator"), *values) as op:
        yield cp, op


def cpu_pool(ns: str, name: str = "llama", **spec: Any) -> dict[str, Any]:
    base = {
        "selector": {"matchLabels": {"app": "vllm"}},
        "capacity": "64Mi",
        "chunkSize": 32,
        "vllmContainer": "vllm",
    }
    return pool_manifest(ns, name, {**base, **spec})


# The namespaces whose pool "llama" a test below left broken, for kubectl wait to time out on
BROKEN: list[str] = []


def not_ready_for(cp: ControlPlane, ns: str, reason: str, name: str = "llama") -> dict[str, Any] | None:
    """The pool's Ready condition once it is False for `reason`."""
    found = [c for c in pool_status(cp, ns, name).get("conditions", []) if c["type"] == "Ready"]
    return found[0] if found and found[0]["status"] == "False" and found[0]["reason"] == reason else None


@pytest.fixture(scope="module")
def kept() -> Iterator[contextlib.ExitStack]:
    """Processes (sidecars, Redis) that stay up until the module ends: kubectl wait runs on them."""
    with contextlib.ExitStack() as stack:
        yield stack


# --- RBAC ------------------------------------------------------------------------------------------


def test_the_service_account_may_make_every_call_the_operator_needs(operator: tuple) -> None:
    cp, op = operator
    denied = []
    for (group, resource), verbs in sorted(RBAC.items()):
        if resource in ("kopfpeerings", "namespaces"):
            continue  # only for an operator that watches some namespaces (the chart's other mode)
        for verb in sorted(verbs):
            target = f"{resource.split('/')[0]}.{group}" if group else resource.split("/")[0]
            if resource == "clusterkopfpeerings" and verb in ("get", "patch"):
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
        ["get", "secrets"],  # it creates its Secrets and never reads one back
        ["watch", "secrets"],
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
        _put_and_get(sidecars[0], key)

        def counted() -> dict[str, Any] | None:
            s = pool_status(cp, ns, "llama")
            stats = s.get("stats") or {}
            return s if stats.get("sidecars") == 2 and stats.get("hits", 0) >= 1 else None

        status = wait_until(counted, 60, "the pool's status to aggregate both sidecars")
        assert status["matchedPods"] == 2 and status["readyPods"] == 2 and status["outdatedPods"] == 0
        assert status["stats"]["capacityBytes"] == 2 * 64 * 2**20
        assert status["stats"]["hitRate"] > 0
        # sizing from data: the API server kept the curve (the CRD's schema declares it); one lookup
        # is too few for a sampled estimate to say more than that it is a rate
        assert list(status["stats"]["hitRateAt"]) == ["0.25x", "0.5x", "1x", "2x", "4x"]
        assert 0 <= status["stats"]["hitRateCeiling"] <= 1
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "True" and ready["observedGeneration"] == pool["metadata"]["generation"]
        assert status["observedGeneration"] == pool["metadata"]["generation"]
        assert ready["reason"] == "Serving"
        header, row = cp.kubectl("-n", ns, "get", "kvp", "llama").splitlines()
        assert header.split()[:7] == ["NAME", "BACKEND", "CAPACITY", "READY", "REASON", "PODS", "READY-PODS"]
        assert row.split()[1:7] == ["cpu", "64Mi", "True", "Serving", "2", "2"]
    finally:
        for proc in sidecars:
            proc.stop()


def _put_and_get(proc: Proc, key: str) -> None:
    url = proc.info["url"]
    headers = {"Content-Type": "application/octet-stream", **write_auth(proc.info["arena_dir"])}
    request = urllib.request.Request(
        f"{url}/v1/chunks/{key}", data=b"x" * 4096, method="PUT", headers=headers
    )
    urllib.request.urlopen(request, timeout=5).close()
    with urllib.request.urlopen(f"{url}/v1/chunks/{key}", timeout=5) as r:
        assert r.read() == b"x" * 4096
    lookup = json.dumps({"keys": [key]}).encode()  # a lookup, as the connector's: the curve follows these
    headers = {"Content-Type": "application/json"}
    with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/lookup", lookup, headers), timeout=5) as r:
        assert json.load(r)["hits"] == 1


def test_a_changed_pool_marks_running_pods_outdated_with_an_event(operator: tuple) -> None:
    """A new capacity and sidecar image leave the connector config as it was; the running pods still
    carry the old sidecar, so they are outdated (they were counted current before: only the connector
    config's hash was compared)."""
    cp, _ = operator
    ns = "vllm-restricted"
    change = {"spec": {"capacity": "128Mi", "sidecar": {"image": "kvpool/sidecar:newer"}}}
    cp.kubectl("-n", ns, "patch", "kvp", "llama", "--type=merge", "-p", json.dumps(change))
    wait_until(lambda: pool_status(cp, ns, "llama").get("outdatedPods") == 2, 60,
               "both running pods counted outdated")  # fmt: skip

    def told() -> list[str]:
        found = get_json(cp, "-n", ns, "events", "--field-selector", "reason=ConfigUpdated")["items"]
        return [e["message"] for e in found if "2 of 2 running pod(s) are outdated" in e["message"]]

    wait_until(told, 30, "a ConfigUpdated event counting the outdated pods")


def bare_pod(ns: str, name: str, *containers: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": "vllm"}},
        "spec": {"containers": list(containers), **spec},
    }


def container(name: str, image: str = "vllm/vllm-openai:v0.32.0", **fields: Any) -> dict[str, Any]:
    return {"name": name, "image": image, **fields}


VLLM: dict[str, Any] = {"command": ["vllm", "serve"], "args": ["/models/llama"]}
UNCONFIGURABLE = {  # pod -> (the reason counted, what its event says)
    "shell": ("StartedThroughShell", "through a shell"),
    "own-connector": ("OwnConnector", "never replaces a user's connector"),
    "host-network": ("HostNetwork", "the host's network"),
    "not-vllm": ("NoVLLMContainer", "no container runs vllm"),
}


def test_pods_kvpool_cannot_configure_are_admitted_untouched_told_and_counted(operator: tuple) -> None:
    """The pool names no container: vLLM's is found by what it runs, after another injector's proxy.
    Pods it cannot configure without breaking them start as they are, with the reason on the pod, in an
    event on the pool and counted in its status."""
    cp, _ = operator
    ns = namespace(cp, "vllm-odd")
    pool = cpu_pool(ns)
    del pool["spec"]["vllmContainer"]
    apply(cp, pool)
    published = wait_until(lambda: pool_ready(cp, ns, "llama"), 60, "the pool to be Ready")
    theirs = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
    proxy = container("proxy", "envoyproxy/envoy:v1.31", args=["-c", "/etc/envoy.yaml"])
    sent = {
        "shell": bare_pod(ns, "shell", container("vllm", command=["sh", "-c", "vllm serve /models/llama"])),
        "own-connector": bare_pod(
            ns,
            "own-connector",
            container(
                "vllm", command=["vllm", "serve"], args=["/models/llama", "--kv-transfer-config", theirs]
            ),
        ),
        "host-network": bare_pod(ns, "host-network", container("vllm", **VLLM), hostNetwork=True),
        "not-vllm": bare_pod(ns, "not-vllm", container("web", "nginx:1.27")),
    }
    apply(cp, bare_pod(ns, "proxy-first", proxy, container("engine", **VLLM)), *sent.values())
    injected = get_json(cp, "-n", ns, "pod", "proxy-first")
    assert_injected(injected, published, "engine")
    first = injected["spec"]["containers"][0]
    assert {k: first.get(k) for k in proxy} == proxy
    assert all(m["name"] != "kvpool-arena" for m in first.get("volumeMounts", []))
    for name, (reason, _) in UNCONFIGURABLE.items():
        pod = get_json(cp, "-n", ns, "pod", name)
        assert "initContainers" not in pod["spec"], name
        as_sent = [(c.get("command"), c.get("args")) for c in sent[name]["spec"]["containers"]]
        assert [(c.get("command"), c.get("args")) for c in pod["spec"]["containers"]] == as_sent, name
        assert pod["metadata"]["annotations"]["kvpool.dev/skipped"].startswith(f"{reason}: "), name

    def counted() -> dict[str, Any] | None:
        s = pool_status(cp, ns, "llama")
        return s if s.get("skippedPods") == len(UNCONFIGURABLE) else None

    status = wait_until(counted, 60, "the pool's status to count the skipped pods")
    assert status["injectedPods"] == 1 and status["matchedPods"] == 5 and status["outdatedPods"] == 0
    assert status["skipReasons"] == {reason: 1 for reason, _ in UNCONFIGURABLE.values()}

    def told() -> list[str] | None:
        found = get_json(cp, "-n", ns, "events", "--field-selector", "reason=PodNotInjected")["items"]
        messages = [e["message"] for e in found if e["involvedObject"]["name"] == "llama"]
        return messages if all(any(w in m for m in messages) for _, w in UNCONFIGURABLE.values()) else None

    wait_until(told, 60, "a warning event on the pool for each skipped pod")


CONFIGS = {  # ConfigMap -> (its config.yaml, what the pod gets: injected, or the reason it is skipped)
    "nixl": ("kv-transfer-config:\n  kv_connector: NixlConnector\n  kv_role: kv_both\n", "OwnConnector"),
    "plain": ("max-model-len: 128\nport: 8000\n", None),
    "broken": ("port: [8000\n", "ConfigFileInvalid"),
}


def test_a_connector_in_a_config_map_config_file_is_the_users_and_the_file_is_read(operator: tuple) -> None:
    """vLLM reads `--config FILE` too: the webhook reads the ConfigMap the file comes from (the
    chart's RBAC lets it) and leaves a pod whose file names a connector untouched; a file without one
    gets the cache; one that is not YAML is skipped with the reason, the pod still admitted."""
    cp, _ = operator
    ns = namespace(cp, "vllm-config")
    apply(cp, cpu_pool(ns))
    published = wait_until(lambda: pool_ready(cp, ns, "llama"), 60, "the pool to be Ready")
    for name, (text, _) in CONFIGS.items():
        config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": ns},
                      "data": {"config.yaml": text}}  # fmt: skip
        serve = ["vllm", "serve", "/models/llama", "--config", "/etc/vllm/config.yaml"]
        vllm = container("vllm", command=serve, volumeMounts=[{"name": "config", "mountPath": "/etc/vllm"}])
        volume = {"name": "config", "configMap": {"name": name}}
        apply(cp, config_map, bare_pod(ns, name, vllm, volumes=[volume]))
    for name, (_, reason) in CONFIGS.items():
        pod = get_json(cp, "-n", ns, "pod", name)
        if reason is None:
            assert_injected(pod, published, "vllm")
            continue
        assert untouched(pod), name
        skipped = pod["metadata"]["annotations"]["kvpool.dev/skipped"]
        assert skipped.startswith(f"{reason}: container vllm"), skipped
    assert (
        "--config /etc/vllm/config.yaml"
        in get_json(cp, "-n", ns, "pod", "nixl")["metadata"]["annotations"]["kvpool.dev/skipped"]
    )
    assert (
        "is not YAML"
        in get_json(cp, "-n", ns, "pod", "broken")["metadata"]["annotations"]["kvpool.dev/skipped"]
    )


def test_skipped_replicas_are_one_event_with_a_count_naming_their_replica_set(operator: tuple) -> None:
    """20 replicas kvpool cannot configure (on the host's network) are one PodNotInjected event on
    the pool, counted 20 times, naming their ReplicaSet and a pod: not 20 events."""
    cp, _ = operator
    ns = namespace(cp, "vllm-many-skipped")
    apply(cp, cpu_pool(ns))
    wait_until(lambda: pool_ready(cp, ns, "llama"), 60, "the pool to be Ready")
    replicas = 20
    apply(cp, {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "vllm", "namespace": ns},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "vllm"}},
            "template": {"metadata": {"labels": {"app": "vllm"}},
                         "spec": {"containers": [container("vllm", **VLLM)], "hostNetwork": True}},
        },
    })  # fmt: skip
    wait_until(lambda: len(pods_of(cp, ns)) == replicas, 90, f"{replicas} pods")
    (replica_set,) = get_json(cp, "-n", ns, "replicasets", "-l", "app=vllm")["items"]
    owner = f"ReplicaSet/{replica_set['metadata']['name']}"

    def skip_events() -> list[dict[str, Any]]:
        found = get_json(cp, "-n", ns, "events", "--field-selector", "reason=PodNotInjected")["items"]
        return [e for e in found if e["involvedObject"]["name"] == "llama"]

    found = wait_until(
        lambda: (found := skip_events()) and sum(e.get("count", 1) for e in found) >= replicas and found,
        60,
        f"the pool's PodNotInjected events to count {replicas} pods",
    )
    assert len(found) == 1, [(e["count"], e["message"]) for e in found]
    (event,) = found
    assert event["count"] == replicas and event["type"] == "Warning"
    assert event["message"].startswith(f"pod {replica_set['metadata']['name']}-"), event["message"]
    assert f" of {owner}: HostNetwork: " in event["message"], event["message"]


def _limited_namespace(cp: ControlPlane, name: str, kind: str, spec: dict[str, Any], capacity: str) -> str:
    """A namespace with one LimitRange or ResourceQuota and a Ready pool of `capacity`."""
    ns = namespace(cp, name)
    apply(
        cp, {"apiVersion": "v1", "kind": kind, "metadata": {"name": "limits", "namespace": ns}, "spec": spec}
    )
    apply(cp, cpu_pool(ns, capacity=capacity))
    wait_until(lambda: pool_ready(cp, ns, "llama"), 60, "the pool to be Ready")
    return ns


def test_a_pod_the_sidecar_would_push_over_a_limit_range_is_admitted_untouched(operator: tuple) -> None:
    """The API server checks LimitRanges and quotas after the webhook: a sidecar that pushed the pod
    over got it refused (a Deployment stayed at 0/2), whatever the webhook's failurePolicy."""
    cp, _ = operator
    limits = {"limits": [{"type": "Container", "max": {"memory": "12Gi"}}]}
    ns = _limited_namespace(cp, "vllm-limits", "LimitRange", limits, "16Gi")
    apply(cp, bare_pod(ns, "big", container("vllm", **VLLM)))  # refused before: 16Gi sidecar > 12Gi max
    pod = get_json(cp, "-n", ns, "pod", "big")
    assert untouched(pod) and "initContainers" not in pod["spec"]
    assert pod["metadata"]["annotations"]["kvpool.dev/skipped"].startswith("LimitRangeExceeded: ")
    ready = wait_until(
        lambda: not_ready_for(cp, ns, "LimitRangeExceeded"), 60, "not Ready: every pod skipped"
    )
    assert "1 of 1 matched pod(s) run without the cache" in ready["message"] and "big" in ready["message"]
    BROKEN.append(ns)


def test_a_pod_the_sidecar_would_push_over_a_quota_is_admitted_untouched(operator: tuple) -> None:
    cp, _ = operator
    ns = _limited_namespace(cp, "vllm-quota", "ResourceQuota", {"hard": {"requests.memory": "20Gi"}}, "8Gi")
    memory: dict[str, Any] = {"resources": {"requests": {"memory": "4Gi"}, "limits": {"memory": "4Gi"}}}
    apply(cp, bare_pod(ns, "first", container("vllm", **VLLM, **memory)))  # 4Gi and its 8Gi sidecar fit
    assert "kvpool.dev/skipped" not in get_json(cp, "-n", ns, "pod", "first")["metadata"].get(
        "annotations", {}
    )
    apply(cp, bare_pod(ns, "second", container("vllm", **VLLM, **memory)))  # refused before: 24Gi > 20Gi
    pod = get_json(cp, "-n", ns, "pod", "second")
    assert untouched(pod) and pod["metadata"]["annotations"]["kvpool.dev/skipped"].startswith(
        "QuotaExceeded: "
    )


def test_the_webhook_sees_only_namespaces_that_opt_in(operator: tuple) -> None:
    cp, _ = operator
    ns = namespace(cp, "vllm-not-opted-in", opt_in=False)
    apply(cp, cpu_pool(ns))
    wait_until(lambda: pool_ready(cp, ns, "llama"), 60, "the pool to be Ready")
    apply(cp, bare_pod(ns, "vllm", container("vllm", **VLLM)))
    pod = get_json(cp, "-n", ns, "pod", "vllm")
    assert untouched(pod) and "kvpool.dev/skipped" not in (pod["metadata"].get("annotations") or {})
    ready = wait_until(lambda: not_ready_for(cp, ns, "InjectionNotEnabled"), 60, "InjectionNotEnabled")
    assert "vllm" in ready["message"] and "kvpool.dev/injection=enabled" in ready["message"]
    BROKEN.append(ns)  # the pod stays as it was created: kubectl wait (below) times out
    cp.kubectl("label", "namespace", ns, "kvpool.dev/injection=enabled")
    apply(cp, bare_pod(ns, "vllm-2", container("vllm", **VLLM)))
    assert not untouched(get_json(cp, "-n", ns, "pod", "vllm-2"))


def test_sidecar_resources_the_api_server_admits_and_a_guaranteed_pod_stays_guaranteed(
    operator: tuple,
) -> None:
    """A pool limits the sidecar's CPU below the default request: the request follows the limit (the API
    server refuses a request above its limit, and with it the whole pod); the pool's pull secret is the
    pod's. A Guaranteed vLLM pod stays
    Guaranteed: the API server's own qosClass says so."""
    cp, _ = operator
    ns = namespace(cp, "vllm-qos")
    pool_sidecar = {
        "resources": {"limits": {"cpu": "100m"}},
        "imagePullSecrets": [{"name": "kvpool-registry"}],
    }
    apply(cp, cpu_pool(ns, sidecar=pool_sidecar))
    wait_until(lambda: pool_ready(cp, ns, "llama"), 60, "the pool to be Ready")
    guaranteed = {"limits": {"cpu": "4", "memory": "16Gi"}}
    burstable = {"requests": {"cpu": "1", "memory": "4Gi"}}
    apply(
        cp,
        bare_pod(ns, "guaranteed", container("vllm", **VLLM, resources=guaranteed)),
        bare_pod(ns, "burstable", container("vllm", **VLLM, resources=burstable)),
    )
    pods = {name: get_json(cp, "-n", ns, "pod", name) for name in ("guaranteed", "burstable")}
    for name, pod in pods.items():
        (sidecar,) = [c for c in pod["spec"]["initContainers"] if c["name"] == "kvpool-sidecar"]
        assert sidecar["resources"]["requests"]["cpu"] == "100m", name
        assert pod["spec"]["imagePullSecrets"] == [{"name": "kvpool-registry"}], name  # the pool's registry
    assert pods["guaranteed"]["status"]["qosClass"] == "Guaranteed"
    sidecar = sidecar_of(pods["guaranteed"])
    assert sidecar["resources"]["requests"] == sidecar["resources"]["limits"]
    assert pods["burstable"]["status"]["qosClass"] == "Burstable"


def test_missing_objects_and_an_unreachable_redis_keep_no_pod_from_starting(
    operator: tuple, tmp_path: Path
) -> None:
    """A pool whose password Secret does not exist and whose Redis is unreachable: the pod is admitted
    with every reference optional and no startup probe, and the sidecar started with the pod's own args,
    without the Secret's values and the ConfigMap's file (what the kubelet gives for optional ones that
    are missing), serves the CPU tier at once."""
    cp, _ = operator
    ns = namespace(cp, "vllm-start")
    redis = {"mode": "external", "url": "redis://127.0.0.1:1", "passwordSecretRef": {"name": "absent"}}
    apply(cp, cpu_pool(ns, backend="redis", redis=redis))
    wait_until(lambda: pool_ready(cp, ns, "llama"), 60, "the pool to be Ready (its Secret is never read)")
    apply(cp, bare_pod(ns, "vllm", container("vllm", **VLLM)))
    pod = get_json(cp, "-n", ns, "pod", "vllm")
    sidecar = sidecar_of(pod)
    assert "startupProbe" not in sidecar and "readinessProbe" not in sidecar
    (urls,) = [v for v in pod["spec"]["volumes"] if "configMap" in v]
    assert urls["configMap"]["optional"] is True
    (credentials,) = [v for v in pod["spec"]["volumes"] if v["name"] == "kvpool-credentials"]
    assert all(source["secret"]["optional"] for source in credentials["projected"]["sources"])
    port, status_port = free_port(), free_port()
    args = _replaced(
        sidecar["args"],
        {"--port": str(port), "--status-port": str(status_port), "--arena-dir": str(tmp_path / "arena"),
         "--redis-urls-file": str(tmp_path / "no-configmap" / "redis-urls"),
         "--pool-key-file": str(tmp_path / "no-secret" / "pool-key"),
         "--redis-password-file": str(tmp_path / "no-secret" / "redis-password")},
    )  # fmt: skip
    proc = start_sidecar(tmp_path, "64Mi", [], *args, port=port)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{status_port}/readyz?tier=cpu", timeout=5) as r:
            assert r.status == 200
        _put_and_get(proc, "cd" * 16)
    finally:
        proc.stop()


def _replaced(args: list[str], values: dict[str, str]) -> list[str]:
    out = list(args)
    for flag, value in values.items():
        out[out.index(flag) + 1] = value
    return out


def test_a_call_the_api_server_refuses_degrades_the_pool_instead_of_retrying(operator: tuple) -> None:
    """A quota that allows no ConfigMap: the API server answers 403 to the pool's ConfigMap, every time.
    The pool says so in its conditions and an event, and is not retried every 10 s."""
    cp, _ = operator
    ns = namespace(cp, QUOTA_NAMESPACE)
    apply(cp, {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "none", "namespace": ns},
               "spec": {"hard": {"configmaps": "0"}}})  # fmt: skip
    apply(cp, cpu_pool(ns))

    def refused() -> dict[str, Any] | None:
        pool = get_json(cp, "-n", ns, "kvp", "llama")
        degraded = [c for c in pool.get("status", {}).get("conditions", []) if c["type"] == "Degraded"]
        return pool if degraded and degraded[0]["reason"] == "Refused" else None

    pool = wait_until(refused, 60, "the pool Degraded with the API server's refusal")
    (degraded,) = [c for c in pool["status"]["conditions"] if c["type"] == "Degraded"]
    assert "403" in degraded["message"] and "quota" in degraded["message"]
    assert pool["status"]["refused"]["observedGeneration"] == pool["metadata"]["generation"]
    BROKEN.append(ns)  # refresh runs every second: kubectl wait (below) shows it never says Ready
    # kopf keeps a handler's retry state in an annotation while it retries; there is none
    assert not [k for k in pool["metadata"].get("annotations", {}) if k.startswith("kvpool.dev/reconcile")]


QUOTA_NAMESPACE = "vllm-quota"


def test_a_sidecar_that_cannot_start_opens_a_breaker_so_new_pods_start_without_it(operator: tuple) -> None:
    """A native sidecar whose image does not pull holds vLLM back for good. Once the kubelet reports
    that for a pod, the pool says so and new pods start without the cache; a new image closes it."""
    cp, _ = operator
    ns = namespace(cp, "vllm-stuck")
    apply(cp, cpu_pool(ns, sidecar={"image": "registry.invalid/kvpool/sidecar:missing"}))
    wait_until(lambda: pool_ready(cp, ns, "llama"), 60, "the pool to be Ready")
    stuck = bare_pod(ns, "stuck", container("vllm", **VLLM))
    stuck["metadata"]["annotations"] = CUSTOM_STATUS  # kwok leaves its status to the test, as kubelet
    apply(cp, stuck)
    assert not untouched(get_json(cp, "-n", ns, "pod", "stuck"))
    waiting = {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}
    kubelet_says = {"phase": "Pending", "initContainerStatuses": [
        {"name": "kvpool-sidecar", "image": "registry.invalid/kvpool/sidecar:missing", "imageID": "",
         "ready": False, "started": False, "restartCount": 0, "state": {"waiting": waiting}}]}  # fmt: skip
    cp.kubectl("-n", ns, "patch", "pod", "stuck", "--subresource=status", "--type=merge",
               "-p", json.dumps({"status": kubelet_says}))  # fmt: skip
    breaker = wait_until(lambda: pool_status(cp, ns, "llama").get("sidecarNotStarting"), 60, "the breaker")
    assert breaker["pods"] == 1 and breaker["reason"].startswith("ImagePullBackOff")
    status = pool_status(cp, ns, "llama")
    (degraded,) = [c for c in status["conditions"] if c["type"] == "Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "SidecarNotStarting"

    def admitted_as(name: str) -> dict[str, Any]:  # the server runs the webhook on a dry run too
        doc = json.dumps(bare_pod(ns, name, container("vllm", **VLLM)))
        return json.loads(cp.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", stdin=doc))

    skipped = wait_until(
        lambda: (p := admitted_as("next"))["metadata"].get("annotations", {}).get("kvpool.dev/skipped") and p,
        60,
        "new pods admitted without the cache",
    )
    assert skipped["metadata"]["annotations"]["kvpool.dev/skipped"].startswith("SidecarNotStarting: ")
    assert untouched(skipped)
    events = get_json(cp, "-n", ns, "events", "--field-selector", "reason=SidecarNotStarting")["items"]
    assert [e["involvedObject"]["name"] for e in events] == ["llama"]

    cp.kubectl("-n", ns, "patch", "kvp", "llama", "--type=merge",
               "-p", json.dumps({"spec": {"sidecar": {"image": "kvpool/sidecar:fixed"}}}))  # fmt: skip
    wait_until(lambda: "sidecarNotStarting" not in pool_status(cp, ns, "llama"), 60, "the breaker closed")
    wait_until(lambda: not untouched(admitted_as("again")), 60, "new pods injected again")


# --- Ready means the pool serves -----------------------------------------------------------------


def _pod_with_sidecar(
    cp: ControlPlane,
    kept: contextlib.ExitStack,
    workdir: Path,
    ns: str,
    redis_urls: Sequence[str] = (),
    *extra: str,
    env: dict[str, str] | None = None,
) -> Proc:
    """One injected vLLM pod, Running and Ready (kwok), and its sidecar: the real process on the pod's
    address with the pool's status port, kept up until the module ends."""
    apply(cp, bare_pod(ns, "vllm", container("vllm", **VLLM)))
    (pod,) = wait_until(lambda: all_ready(pods_of(cp, ns), 1), 90, "the pod Running and Ready")
    assert not untouched(pod)
    port = pod["metadata"]["annotations"]["kvpool.dev/status-port"]
    address = ["--status-host", pod["status"]["podIP"], "--status-port", port]
    proc = start_sidecar(workdir, "64Mi", list(redis_urls), *address, *extra, env=env)
    kept.callback(proc.stop)
    return proc


def _pool_key(cp: ControlPlane, ns: str) -> str:
    # made by the operator (the test may read it)
    return secret_value(get_json(cp, "-n", ns, "secret", "llama-kvpool-key"), "pool-key")


def test_a_healthy_pool_with_a_serving_sidecar_is_ready(
    operator: tuple, kept: contextlib.ExitStack, tmp_path: Path
) -> None:
    cp, _ = operator
    ns = namespace(cp, "vllm-healthy")
    apply(cp, cpu_pool(ns))
    _pod_with_sidecar(cp, kept, tmp_path, ns)
    ready = wait_until(lambda: (p := pool_ready(cp, ns, "llama")) and p["status"]["stats"]["sidecars"] == 1
                       and p, 60, "the pool Ready with its pod's sidecar")  # fmt: skip
    (cond,) = [c for c in ready["status"]["conditions"] if c["type"] == "Ready"]
    assert cond["reason"] == "Serving"


def test_a_missing_password_secret_is_redis_refusing_the_sidecars(
    operator: tuple, kept: contextlib.ExitStack, tmp_path: Path
) -> None:
    """The pool's passwordSecretRef names no Secret (the operator never reads Secrets, so only the
    sidecars can tell): the sidecar starts without a password and the real Redis refuses it."""
    cp, _ = operator
    ns = namespace(cp, "vllm-no-secret")
    port, _ = kept.enter_context(redis_with(password="s3cret-the-pool-never-gets"))
    url = f"redis://127.0.0.1:{port}"
    redis = {"mode": "external", "url": url, "passwordSecretRef": {"name": "absent"}}
    apply(cp, cpu_pool(ns, backend="redis", redis=redis))
    wait_until(lambda: pool_status(cp, ns, "llama").get("connectorConfig"), 60, "the pool reconciled")
    env = {"KVPOOL_POOL_KEY": _pool_key(cp, ns)}  # as the kubelet gives it; the password's Secret is absent
    _pod_with_sidecar(cp, kept, tmp_path, ns, [url], "--pool-key-required", env=env)
    ready = wait_until(lambda: not_ready_for(cp, ns, "RedisAuthFailed"), 60, "RedisAuthFailed")
    assert "Authentication" in ready["message"]
    BROKEN.append(ns)


def test_an_unreachable_redis_is_said(operator: tuple, kept: contextlib.ExitStack, tmp_path: Path) -> None:
    cp, _ = operator
    ns = namespace(cp, "vllm-redis-down")
    url = f"redis://127.0.0.1:{free_port()}"  # nothing listens
    apply(cp, cpu_pool(ns, backend="redis", redis={"mode": "external", "url": url}))
    wait_until(lambda: pool_status(cp, ns, "llama").get("connectorConfig"), 60, "the pool reconciled")
    env = {"KVPOOL_POOL_KEY": _pool_key(cp, ns)}
    _pod_with_sidecar(cp, kept, tmp_path, ns, [url], "--pool-key-required", env=env)
    ready = wait_until(lambda: not_ready_for(cp, ns, "RedisUnreachable"), 60, "RedisUnreachable")
    assert "ConnectionError" in ready["message"]
    BROKEN.append(ns)


def test_a_pod_whose_vllm_runs_without_kvpool_keeps_the_pool_from_ready(
    operator: tuple, kept: contextlib.ExitStack, tmp_path: Path
) -> None:
    """kvpool turns itself off in a vLLM whose model it cannot cache (a Mamba hybrid); the engine tells
    its sidecar (the report the connector sends: tests/connector/test_linear_attention_engine.py).
    Before, the pool said Ready: only the engine log said the cache was off."""
    cp, _ = operator
    ns = namespace(cp, "vllm-cache-off")
    apply(cp, cpu_pool(ns))
    sidecar = _pod_with_sidecar(cp, kept, tmp_path, ns)
    wait_until(lambda: pool_ready(cp, ns, "llama"), 60, "the pool Ready")
    client = SidecarClient(sidecar.info["url"], timeout=5)
    why = "kvpool cannot cache a model with state that is not per-token KV (MambaSpec)"
    off = {"cache": "off", "model": "tiny-qwen3-next", "reason": why}
    client.report_engine("dp0", off)
    ready = wait_until(lambda: not_ready_for(cp, ns, "CacheOff"), 60, "CacheOff")
    assert "not per-token KV" in ready["message"] and "tiny-qwen3-next" in ready["message"]
    BROKEN.append(ns)


CRASHING_IMAGE = "vllm/vllm-openai:v0.11.0"  # a stock image: no kvpool_connector in it


def _admitted_as(cp: ControlPlane, ns: str, name: str, image: str) -> dict[str, Any]:
    """The pod as the API server would admit it (a dry run runs the webhook too)."""
    doc = json.dumps(bare_pod(ns, name, container("vllm", image, **VLLM)))
    return json.loads(cp.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", stdin=doc))


def test_a_vllm_that_crash_loops_after_injection_opens_a_breaker_for_its_image(operator: tuple) -> None:
    """The kubelet reports the injected pod's vLLM in CrashLoopBackOff (what a stock image without the
    connector does at every start): the pool says so, an event names the pod and the image, and new
    pods of that image start without the cache, while another image is still injected."""
    cp, _ = operator
    ns = namespace(cp, "vllm-crash")
    apply(cp, cpu_pool(ns))
    wait_until(lambda: pool_ready(cp, ns, "llama"), 60, "the pool to be Ready")
    crash = bare_pod(ns, "crash", container("vllm", CRASHING_IMAGE, **VLLM))
    crash["metadata"]["annotations"] = CUSTOM_STATUS  # kwok leaves its status to the test, as kubelet
    apply(cp, crash)
    assert not untouched(get_json(cp, "-n", ns, "pod", "crash"))
    failed = {
        "exitCode": 1,
        "reason": "Error",
        "message": "ModuleNotFoundError: No module named 'kvpool_connector'",
    }
    kubelet_says = {"phase": "Running", "containerStatuses": [
        {"name": "vllm", "image": CRASHING_IMAGE, "imageID": "", "ready": False, "started": False,
         "restartCount": 3, "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
         "lastState": {"terminated": failed}}]}  # fmt: skip
    cp.kubectl("-n", ns, "patch", "pod", "crash", "--subresource=status", "--type=merge",
               "-p", json.dumps({"status": kubelet_says}))  # fmt: skip
    ready = wait_until(lambda: not_ready_for(cp, ns, "VLLMFailing"), 60, "the vLLM breaker open")
    assert CRASHING_IMAGE in ready["message"] and "crash" in ready["message"]
    (opened,) = pool_status(cp, ns, "llama")["vllmFailing"]["images"]
    assert (opened["image"], opened["pod"]) == (CRASHING_IMAGE, "crash")
    (event,) = get_json(cp, "-n", ns, "events", "--field-selector", "reason=VLLMFailing")["items"]
    assert "crash" in event["message"] and CRASHING_IMAGE in event["message"]

    skipped = wait_until(
        lambda: (p := _admitted_as(cp, ns, "next", CRASHING_IMAGE))["metadata"].get("annotations", {})
        .get("kvpool.dev/skipped") and p, 60, "new pods of that image admitted without the cache",
    )  # fmt: skip
    assert skipped["metadata"]["annotations"]["kvpool.dev/skipped"].startswith("VLLMFailing: ")
    assert untouched(skipped)
    assert not untouched(_admitted_as(cp, ns, "other", "vllm/vllm-openai:v0.32.0"))  # another image
    BROKEN.append(ns)


def test_kubectl_wait_for_ready_times_out_on_every_broken_pool_and_succeeds_on_a_healthy_one(
    operator: tuple,
) -> None:
    """The review's broken pools (an unlabelled namespace, every pod over a LimitRange, a quota that
    refuses the ConfigMap, a missing password Secret, an unreachable Redis, a crash-looping vLLM, a vLLM
    kvpool is off in) all said Ready before. The waits run side by side: one 30 s for all."""
    cp, _ = operator
    assert len(BROKEN) == 7, BROKEN

    def wait(ns: str) -> subprocess.CompletedProcess:
        return cp.kubectl_result("-n", ns, "wait", "--for=condition=Ready", "--timeout=30s", "kvp/llama",
                                 timeout=60)  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(len(BROKEN) + 1) as pool:
        results = dict(zip(["vllm-healthy", *BROKEN], pool.map(wait, ["vllm-healthy", *BROKEN]), strict=True))
    healthy = results.pop("vllm-healthy")
    assert healthy.returncode == 0 and "condition met" in healthy.stdout, healthy.stderr
    for ns, result in results.items():
        assert result.returncode != 0 and "timed out" in result.stderr, (ns, result.stdout, result.stderr)


def kvpool_doctor(cp: ControlPlane, *args: str) -> tuple[int, str]:
    """The `kvpool doctor` command, as a person runs it: their kubectl, their kubeconfig."""
    kubectl = f"{kubectl_binary()} --kubeconfig {cp.kubeconfig}"
    command = [str(Path(sys.executable).parent / "kvpool"), "doctor", *args, "--kubectl", kubectl]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


def test_kvpool_doctor_names_what_is_wrong_with_each_broken_pool_and_how_to_fix_it(operator: tuple) -> None:
    """`kvpool doctor` (#21 item 6) against the review's broken setups: each gets a non-zero exit and its
    fix; the healthy pool gets 0. Its probe pod is a server-side dry run: it goes through the webhook,
    LimitRanger and the quota as the pool's next pod would, and nothing is stored."""
    cp, _ = operator
    fixes = {
        "vllm-not-opted-in": "kubectl label namespace vllm-not-opted-in kvpool.dev/injection=enabled",
        "vllm-limits": "raise the LimitRange by the sidecar's share",
        QUOTA_NAMESPACE: "lift the quota or policy",
        "vllm-no-secret": "create the Secret the pool names",
        "vllm-redis-down": "fix spec.redis.url",
        "vllm-cache-off": 'annotate its pods kvpool.dev/inject: "false"',
        "vllm-crash": "kvpool.dev/reset-breaker",
    }
    assert set(fixes) == set(BROKEN)
    restricted = namespace(cp, "doctor-restricted", {"pod-security.kubernetes.io/enforce": "restricted"})
    apply(cp, cpu_pool(restricted))
    wait_until(lambda: pool_ready(cp, restricted, "llama"), 60, "the pool to be Ready")
    for healthy in ("vllm-healthy", restricted):  # the probe passes Pod Security `restricted` too
        code, said = kvpool_doctor(cp, healthy)
        assert code == 0 and "every pool looked at can serve" in said, said
    code, said = kvpool_doctor(cp, "vllm-restricted")  # the probe copies one of its pods, as admitted
    assert code == 1 and "(SidecarsNotAnswering)" in said and "refuses a pod" not in said, said
    for ns, fix in fixes.items():
        code, said = kvpool_doctor(cp, ns)
        assert code == 1 and f"✗ {ns}" in said and fix in said, (ns, said)
    assert (
        cp.kubectl("-n", "vllm-healthy", "get", "pods", "-o", "name").count("kvpool-doctor") == 0
    )  # a dry run

    # two pools over the same pods; a second release whose webhook has no operator behind it, sent the
    # pods of that namespace and of one only it selects
    ns = namespace(cp, "doctor-overlap", {"doctor": "overlap"})
    apply(cp, cpu_pool(ns, "one"), cpu_pool(ns, "two"), bare_pod(ns, "vllm", container("vllm", **VLLM)))
    dead = namespace(cp, "doctor-dead", {"doctor": "dead"}, opt_in=False)
    apply(cp, cpu_pool(dead))
    (other,) = get_json(cp, "mutatingwebhookconfiguration", "-l", f"app.kubernetes.io/instance={RELEASE}")[
        "items"
    ]
    ours = other["metadata"]["name"]
    other["metadata"] = {"name": "other-kvpool"}
    other["webhooks"][0]["namespaceSelector"] = {
        "matchExpressions": [{"key": "doctor", "operator": "Exists"}]
    }
    other["webhooks"][0]["clientConfig"]["service"] = {"namespace": dead, "name": "nobody", "port": 443}
    apply(cp, other)
    try:
        (code, said), (dead_code, dead_said) = kvpool_doctor(cp, ns), kvpool_doctor(cp, dead)
    finally:
        cp.kubectl("delete", "mutatingwebhookconfiguration", "other-kvpool")
    assert code == 1
    assert "it and pool two both select 1 pod(s) (vllm)" in said and "selectors disjoint" in said, said
    releases = f"2 kvpool releases send this namespace's pods to their webhooks ({ours}, other-kvpool)"
    assert releases in said and "nobody" not in said, said  # kvpool's own webhook answered its probe
    assert (
        dead_code == 1 and f"✗ webhook other-kvpool: Service {dead}/nobody has no ready endpoint" in dead_said
    )


def test_a_person_clears_the_vllm_breaker_with_an_annotation(operator: tuple) -> None:
    """A new value of kvpool.dev/reset-breaker clears it: the image is injected again, and the pod that
    crash-looped before does not open it again."""
    cp, _ = operator
    ns = "vllm-crash"
    cp.kubectl("-n", ns, "annotate", "kvp", "llama", "kvpool.dev/reset-breaker=fixed-connector")
    wait_until(lambda: not untouched(_admitted_as(cp, ns, "again", CRASHING_IMAGE)), 60, "the image injected")
    wait_until(lambda: pool_status(cp, ns, "llama")["vllmFailing"]["images"] == [], 60, "the breaker cleared")
    ready = wait_until(lambda: not_ready_for(cp, ns, "PodsNotReady"), 60, "the breaker no longer the reason")
    assert "1 matched pod" in ready["message"]  # the crash-looping pod itself is still not Ready


# --- the shared Redis tier -------------------------------------------------------------------------


def test_the_shared_tier_follows_the_pools_pods_both_ways_and_drains_before_a_shard_stops(
    operator: tuple, tmp_path: Path
) -> None:
    """Each vLLM pod has a 16 MiB arena and a 32Mi shard holds 22.4 MiB: two ready pods need two shards,
    one pod one. Down, the shard is unpublished first and stopped only once the remaining pod's real
    sidecar reads the shorter list (written to its file here, as the kubelet refreshes a ConfigMap
    volume a minute or more later). The operator reads a real shard's memory as its monitor user."""
    cp, _ = operator
    ns = namespace(cp, "shared-tier")
    tier = "cache-kvpool-redis"
    redis = {"mode": "shared", "replicas": 1, "memory": "32Mi"}
    # sized by the arenas: these idle sidecars share nothing, which would keep the tier at one shard
    scaling = {"minReplicas": 1, "maxReplicas": 2, "capacityPercent": 100, "sizeBy": "arenas"}
    apply(cp, cpu_pool(ns, "cache", capacity="16Mi", backend="redis", redis=redis, scaling=scaling))
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
    (shard,) = wait_until(
        lambda: all_ready(pods_of(cp, ns, "kvpool.dev/pool=cache"), 1), 90, "the first shard"
    )
    password = _secret_password(cp, ns, tier)
    # the real redis-server as the shard pod: on its address, with the StatefulSet's own arguments (its
    # password from the Secret, its maxmemory, the monitor user the operator reads INFO as)
    (container,) = get_json(cp, "-n", ns, "statefulset", tier)["spec"]["template"]["spec"]["containers"]
    args = [a.replace("$(REDIS_PASSWORD)", password) for a in container["args"]]
    shared = lambda: pool_status(cp, ns, "cache").get("sharedTier") or {}  # noqa: E731
    shard_servers = contextlib.ExitStack()  # a real redis-server behind each shard pod's address

    def serve(pod: dict[str, Any]) -> None:
        ip = pod["status"]["podIP"]
        shard_servers.enter_context(redis_with(*args, password=password, port=REDIS_PORT, host=ip))

    sidecars: dict[str, tuple[Proc, Path]] = {}
    try:
        serve(shard)
        wait_until(lambda: shared().get("memoryUtilization") is not None, 60, "the shard's memory, read")
        apply(cp, {**restricted_deployment(ns, replicas=2), "metadata": {"name": "vllm", "namespace": ns}})
        wait_until(lambda: all_ready(pods_of(cp, ns), 2), 90, "two vLLM pods")
        wait_until(lambda: shared().get("publishedShards") == 2, 90, "two shards, both published")
        assert shared()["demandBytes"] == 2 * 16 * 2**20
        (second,) = [p for p in pods_of(cp, ns, "app.kubernetes.io/component=redis,kvpool.dev/pool=cache")
                     if p["metadata"]["name"] != shard["metadata"]["name"]]  # fmt: skip
        serve(second)
        for pod in pods_of(cp, ns):  # each pod's real sidecar, reading its shard list from a file
            urls = tmp_path / pod["metadata"]["name"] / "redis-urls"
            urls.parent.mkdir()
            _kubelet_refresh(cp, ns, urls)
            port = pod["metadata"]["annotations"]["kvpool.dev/status-port"]
            sidecars[pod["metadata"]["name"]] = (
                start_sidecar(urls.parent, "16Mi", [], "--status-host", pod["status"]["podIP"],
                              "--status-port", port, "--redis-urls-file", str(urls)),
                urls,
            )  # fmt: skip
        wait_until(lambda: (pool_status(cp, ns, "cache").get("stats") or {}).get("sidecars") == 2, 60,
                   "both sidecars read by the operator")  # fmt: skip

        cp.kubectl("-n", ns, "scale", "deployment/vllm", "--replicas=1")
        (left,) = wait_until(lambda: all_ready(pods_of(cp, ns), 1), 90, "one vLLM pod left")
        for name in [n for n in sidecars if n != left["metadata"]["name"]]:
            sidecars.pop(name)[0].stop()  # its pod is gone
        draining = wait_until(lambda: (s := shared()).get("draining") and s, 60, "the shard unpublished")
        assert draining["publishedShards"] == 1 and draining["replicas"] == 2
        assert get_json(cp, "-n", ns, "statefulset", tier)["spec"]["replicas"] == 2  # still serving
        proc, urls = sidecars[left["metadata"]["name"]]
        assert SidecarClient(proc.info["url"]).stats()["tiers"]["redis"]["shards"] == 2  # the old list
        _kubelet_refresh(cp, ns, urls)  # the kubelet catches up
        wait_until(lambda: get_json(cp, "-n", ns, "statefulset", tier)["spec"]["replicas"] == 1, 60,
                   "the shard stopped once the sidecar stopped using it")  # fmt: skip
        events = get_json(cp, "-n", ns, "events", "--field-selector", "reason=Scaled")["items"]
        assert any("2 -> 1 shards" in e["message"] for e in events), [e["message"] for e in events]
    finally:
        for proc, _ in sidecars.values():
            proc.stop()
        shard_servers.close()
    cp.kubectl("-n", ns, "delete", "kvp", "cache", "--wait=true", "--timeout=60s")

    def collected() -> bool:  # by the controller manager's garbage collector, from the ownerReferences
        out = cp.kubectl("-n", ns, "get", f"statefulset/{tier}", f"service/{tier}", f"secret/{tier}",
                         "secret/cache-kvpool-key", "configmap/cache-kvpool",
                         "--ignore-not-found", "-o", "name")  # fmt: skip
        return out.strip() == ""

    wait_until(collected, 90, "the pool's objects to be garbage-collected")


def test_a_deleted_secret_is_made_again_once_with_the_shards_rolled_and_an_event(operator: tuple) -> None:
    """The pool's generated Secrets (review D7): never given new values by a reconcile; one deleted is made
    again within a refresh round, the shards' template carries the new password's checksum (they roll
    onto it), and a Warning says so. (The sidecars read them from files: tests/sidecar, the last test of
    test_sidecar_redis.py.)"""
    cp, _ = operator
    ns = namespace(cp, "credentials")
    tier, key = "cache-kvpool-redis", "cache-kvpool-key"
    apply(cp, cpu_pool(ns, "cache", capacity="16Mi", backend="redis",
                       redis={"mode": "shared", "replicas": 1, "memory": "32Mi"}))  # fmt: skip
    statefulset = lambda: get_json(cp, "-n", ns, "statefulset", tier)  # noqa: E731
    wait_until(
        lambda: cp.kubectl_result("-n", ns, "get", "statefulset", tier).returncode == 0, 60, "the shards"
    )

    def values() -> tuple[str, str]:
        return _secret_password(cp, ns, tier), secret_value(get_json(cp, "-n", ns, "secret", key), "pool-key")

    first = values()
    cp.kubectl("-n", ns, "patch", "kvp", "cache", "--type=merge", "-p", '{"spec":{"capacity":"24Mi"}}')
    wait_until(
        lambda: pool_status(cp, ns, "cache").get("observedGeneration") == 2, 60, "the change reconciled"
    )
    assert values() == first  # a reconcile never writes them again (T5)
    revision = wait_until(lambda: (statefulset().get("status") or {}).get("updateRevision"), 60, "a revision")
    assert CHECKSUM not in (statefulset()["spec"]["template"]["metadata"].get("annotations") or {})

    cp.kubectl("-n", ns, "delete", "secret", tier, key)  # T4
    wait_until(lambda: cp.kubectl_result("-n", ns, "get", "secret", tier, key).returncode == 0, 30,
               "both Secrets made again")  # fmt: skip
    again = values()
    assert again[0] != first[0] and again[1] != first[1]
    annotations = lambda: statefulset()["spec"]["template"]["metadata"].get("annotations") or {}  # noqa: E731
    wait_until(lambda: CHECKSUM in annotations(), 30, "the shards' template to carry the new password's")
    assert annotations()[CHECKSUM] == checksum(get_json(cp, "-n", ns, "secret", tier))
    wait_until(lambda: statefulset()["status"].get("updateRevision") != revision, 60, "the shards rolling")
    said = wait_until(lambda: get_json(cp, "-n", ns, "events", "--field-selector",
                                       "reason=CredentialsRecreated")["items"], 30, "the event")  # fmt: skip
    messages = " ".join(e["message"] for e in said)
    assert tier in messages and key in messages and all(e["type"] == "Warning" for e in said)
    assert values() == again  # made once: the rounds since have not made them a third time
    cp.kubectl("-n", ns, "delete", "kvp", "cache", "--wait=true", "--timeout=60s")


def _kubelet_refresh(cp: ControlPlane, ns: str, path: Path) -> None:
    """What the kubelet does for a ConfigMap volume: the pool's shard list, written to the pod's file."""
    path.write_text(get_json(cp, "-n", ns, "configmap", "cache-kvpool")["data"]["redis-urls"])


def _secret_password(cp: ControlPlane, ns: str, name: str) -> str:
    return secret_value(get_json(cp, "-n", ns, "secret", name), "password")


# --- the operator's own metrics ----------------------------------------------------------------------


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The operator's /metrics: each sample's value by (name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_operator_serves_its_metrics(operator: tuple) -> None:
    """The real operator process, scraped on the port the chart gives it: pools reconciled, the webhook's
    decisions on the API server's calls (one pod injected, one admitted without the cache for a reason)
    with their latency, a pool's readiness and its unread sidecar, and a shared tier's shards."""
    cp, op = operator
    (operator_container,) = operator_pods(cp)[0]["spec"]["containers"]
    port = next(p["containerPort"] for p in operator_container["ports"] if p["name"] == "metrics")
    url = f"http://{op.ip}:{port}/metrics"
    ns = namespace(cp, "metrics")
    apply(cp, cpu_pool(ns, "llama"),
          cpu_pool(ns, "cache", selector={"matchLabels": {"app": "none-yet"}}, capacity="16Mi",
                   backend="redis", redis={"mode": "shared", "replicas": 1, "memory": "32Mi"}))  # fmt: skip
    for name in ("llama", "cache"):
        wait_until(
            lambda n=name: pool_status(cp, ns, n).get("connectorConfig"), 60, f"pool {name} reconciled"
        )
    apply(cp, bare_pod(ns, "injected", container("vllm", **VLLM)),
          bare_pod(ns, "host-network", container("vllm", **VLLM), hostNetwork=True))  # fmt: skip
    assert sidecar_of(get_json(cp, "-n", ns, "pod", "injected")) is not None
    wait_until(
        lambda: condition(get_json(cp, "-n", ns, "pod", "injected"), "Ready") == "True", 60, "the pod Ready"
    )
    llama, cache = (("namespace", ns), ("pool", "llama")), (("namespace", ns), ("pool", "cache"))

    def shown() -> dict | None:
        found = _scrape(url)
        shard = ("kvpool_operator_pool_shards_ready", cache)
        failed = ("kvpool_operator_sidecar_scrape_failures_total", llama)
        # the pool's Ready condition as the metric says it (its sidecar never answers: not Ready)
        ready = condition(get_json(cp, "-n", ns, "kvp", "llama"), "Ready") == "True"
        said = found.get(("kvpool_operator_pool_ready", llama)) == (1 if ready else 0)
        return found if found.get(shard) == 1 and found.get(failed, 0) >= 1 and said else None

    found = wait_until(
        shown, 60, "the shard ready, the pool's readiness and its unread sidecar in the metrics"
    )
    assert found[("kvpool_operator_reconciles_total", (("outcome", "Succeeded"),))] >= 2
    injected = found[("kvpool_operator_webhook_decisions_total", (("reason", "Injected"),))]
    skipped = found[("kvpool_operator_webhook_decisions_total", (("reason", "HostNetwork"),))]
    assert injected >= 1 and skipped >= 1
    answered = sum(v for (name, _), v in found.items() if name == "kvpool_operator_webhook_decisions_total")
    assert found[("kvpool_operator_webhook_duration_seconds_count", ())] == answered
    assert found[("kvpool_operator_webhook_duration_seconds_bucket", (("le", "+Inf"),))] == answered
    assert found[("kvpool_operator_webhook_duration_seconds_sum", ())] > 0
    assert found[("kvpool_operator_pool_shards_desired", cache)] == 1
    assert ("kvpool_operator_pool_shards_desired", llama) not in found  # no shared tier
    scrapes = found[("kvpool_operator_sidecar_scrapes_total", llama)]
    assert scrapes >= found[("kvpool_operator_sidecar_scrape_failures_total", llama)]
    # nothing failed open: the API server's every call was answered by a ready operator
    assert not [k for k, v in found.items() if k[0] == "kvpool_operator_webhook_fail_open_total" and v]
    cp.kubectl("-n", ns, "delete", "kvp", "--all", "--wait=false")


# --- RBAC, again, and fail-open (last: it stops the operator) ---------------------------------------


def test_the_api_server_never_refused_the_operator(operator: tuple) -> None:
    _, op = operator
    refused = [line for line in forbidden_calls(op.proc.output()) if QUOTA_NAMESPACE not in line]
    assert refused == []  # the quota test's 403 is the one refusal on purpose


def test_pods_created_while_the_operator_is_down_are_admitted_untouched(operator: tuple) -> None:
    cp, op = operator
    ns = namespace(cp, "operator-down", {"pod-security.kubernetes.io/enforce": "restricted"})
    apply(cp, cpu_pool(ns))
    wait_until(lambda: pool_ready(cp, ns, "llama"), 60, "the pool to be Ready")
    op.proc.stop()
    apply(cp, restricted_deployment(ns, replicas=1))
    (pod,) = wait_until(lambda: all_ready(pods_of(cp, ns), 1), 90, "the pod, created without the webhook")
    assert untouched(pod)
