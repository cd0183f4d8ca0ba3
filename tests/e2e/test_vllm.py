"""vLLM on a real cluster, from a stock image built from the Dockerfile (nothing of kvpool in it):
injection with the staged connector, the sidecar's endpoints, a returning prompt loaded from kvpool
(vLLM's own /metrics), a cross-pod hit through the shared Redis tier with identical output, a killed
sidecar that vLLM answers through with the same tokens and that comes back with its arena's chunks, a
rollout to the same image with kvpool's connector built in (nothing staged) whose new pods load what
the old ones served, honest `kubectl get kvp`, and clean deletion. Runs on the real node
(make test) and on kind (make e2e-kind).

The tests run in file order on one cluster: the hit-rate check reads what the earlier tests did, and
the last test deletes the pool.
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import pytest
from clusterkit import (
    NAMESPACE,
    Cluster,
    container_status,
    container_statuses,
    get_json,
    kubectl,
    kubectl_json,
    pod_json,
    pods,
    port_forward,
)
from kvtest import wait_until
from podchecks import assert_injected

pytestmark = pytest.mark.e2e

STATUS_PORT = 7071  # the pool's sidecar port 7070 + 1
PROMPT = " ".join(f"the cache keeps token {i} of this prompt warm" for i in range(30))
RETURNING = " ".join(f"a user comes back with message {i} of the conversation" for i in range(30))
ROLLOUT = " ".join(f"the deployment rolls while message {i} waits" for i in range(30))


def vllm_pods() -> list[dict[str, Any]]:
    return pods("app=vllm-e2e")


def completion(base: str, prompt: str) -> dict[str, Any]:
    body = json.dumps({"model": "/models/tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(
        base + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def complete(base: str, prompt: str) -> str:
    return completion(base, prompt)["choices"][0]["text"]


def answer_stored(base: str, sidecar: str, prompt: str) -> str:
    """Completes `prompt` at `base`, then waits until the pod's sidecar at `sidecar` holds the prompt's
    whole chunks. Saves run off the step: a prompt sent again while its save is still running (longer
    than the scheduler waits for it, on a loaded machine) is a miss, rightly."""
    before = get_json(sidecar + "/stats")["chunks"]
    answer = completion(base, prompt)
    chunk_tokens = kubectl_json("-n", NAMESPACE, "get", "kvp", "shared")["spec"]["chunkSize"]
    chunks = answer["usage"]["prompt_tokens"] // chunk_tokens
    wait_until(
        lambda: get_json(sidecar + "/stats")["chunks"] - before >= chunks, 60, "the prompt's chunks stored"
    )
    return answer["choices"][0]["text"]


def hit_tokens(base: str) -> float:
    """vLLM's own counter of prompt tokens kvpool loaded (the connector's Prometheus metrics)."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    counted = [line for line in text.splitlines() if line.startswith("vllm:kvpool_hit_tokens_total")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in counted)


def test_both_stock_pods_got_the_sidecar_the_connector_and_the_config(vllm_workload: str) -> None:
    pods = vllm_pods()
    assert len(pods) == 2
    pool = kubectl_json("-n", NAMESPACE, "get", "kvp", "shared")
    for pod in pods:
        assert_injected(pod, pool, "vllm")  # the same check the API-server tier makes (tests/k8s)
        assert all(cs["ready"] for cs in pod["status"]["containerStatuses"])
        # the image has no kvpool: vLLM loaded the staged payload, first on its PYTHONPATH, and never
        # restarted for want of it
        (vllm,) = pod["spec"]["containers"]
        paths = [e["value"] for e in vllm["env"] if e["name"] == "PYTHONPATH"]
        assert paths and paths[0].startswith("/opt/kvpool-connector"), paths
        assert all(s["restartCount"] == 0 for s in container_statuses(pod)), container_statuses(pod)


def test_the_saves_run_in_their_own_process_under_the_pods_seccomp_profile(vllm_workload: str) -> None:
    """A CPU worker's saves copy vLLM's blocks from a child process, through a shared mapping of the KV
    cache (memfd_create and mmap) and, for its partial pages, ptrace's permission (process_vm_readv or
    /proc/<pid>/mem), which the runtime's default seccomp profile must allow in a pod: the worker says
    which process saves and how it reads, or why it saves on its own thread."""
    for pod in vllm_pods():
        assert pod["spec"]["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        log = kubectl("-n", NAMESPACE, "logs", pod["metadata"]["name"], "-c", "vllm")
        saves_in_process = "saves in process" in log and "no save process" not in log
        # the cache shared, or left on its huge pages (a node whose THP mode is "always") and read from there
        shared = "(a shared mapping, else " in log or "stay on their transparent huge pages" in log
        assert saves_in_process and shared and "not shared" not in log, [
            line for line in log.splitlines() if "kvpool" in line
        ]


def test_sidecar_readyz_and_stats_through_port_forward(vllm_workload: str) -> None:
    for pod in vllm_pods():
        with port_forward(pod["metadata"]["name"], STATUS_PORT) as url:
            with urllib.request.urlopen(url + "/readyz", timeout=10) as r:
                assert r.status == 200
            stats = get_json(url + "/stats")
            assert stats["capacity_bytes"] == 256 * 2**20
            assert stats["tiers"]["redis"]["ready"] is True


def test_a_returning_prompt_is_loaded_from_kvpool_with_identical_output(vllm_workload: str) -> None:
    """vLLM's own prefix cache is off in these pods: a returning prompt's prefix can only come from
    kvpool, and vLLM's /metrics counts it."""
    a = vllm_pods()[0]["metadata"]["name"]
    with port_forward(a, 8000) as vllm_a, port_forward(a, STATUS_PORT) as side_a:
        first = answer_stored(vllm_a, side_a, RETURNING)
        before = hit_tokens(vllm_a)
        again = complete(vllm_a, RETURNING)
        loaded = wait_until(lambda: (n := hit_tokens(vllm_a)) > before and n, 60, "vLLM's count of the hit")
    assert again == first
    assert loaded - before >= 32  # at least one whole chunk of the prompt came from the sidecar


def test_same_prompt_on_a_then_b_is_a_hit_on_b_with_identical_output(vllm_workload: str) -> None:
    a, b = (p["metadata"]["name"] for p in vllm_pods())
    with port_forward(a, 8000) as vllm_a, port_forward(a, STATUS_PORT) as side_a:
        text_a = complete(vllm_a, PROMPT)
        # the chunks A saved reach the shared tier (write-behind) before B asks
        wait_until(lambda: (s := get_json(side_a + "/stats"))["tiers"]["redis"]["written"] > 0
                   and s["tiers"]["redis"]["queued"] == 0, 60, "A's chunks written to Redis")  # fmt: skip
    with port_forward(b, 8000) as vllm_b, port_forward(b, STATUS_PORT) as side_b:
        before = get_json(side_b + "/stats")
        text_b = complete(vllm_b, PROMPT)
        after = get_json(side_b + "/stats")
    assert after["hits"] > before["hits"], (before, after)
    assert after["tiers"]["redis"]["hits"] > before["tiers"]["redis"]["hits"]
    assert text_b == text_a


def test_vllm_answers_the_same_through_a_killed_sidecar(cluster: Cluster, vllm_workload: str) -> None:
    """The sidecar SIGKILLed: vLLM keeps answering (a cache down is a miss), with the same tokens, and
    is never restarted; the same pod restarts the sidecar, which takes back the chunks its arena (the
    pod's emptyDir) still holds whole: the prompt loads from the CPU tier again, not from Redis."""
    pod = vllm_pods()[0]
    name = pod["metadata"]["name"]
    before = container_status(pod, "kvpool-sidecar")
    with port_forward(name, 8000) as vllm:
        expected = complete(vllm, PROMPT)
        cluster.kill_container(before["containerID"])
        assert complete(vllm, PROMPT) == expected  # while the sidecar is down or restarting

        def restarted() -> dict[str, Any] | None:
            p = kubectl_json("-n", NAMESPACE, "get", "pod", name)
            s = container_status(p, "kvpool-sidecar")
            return p if s["restartCount"] > before["restartCount"] and s.get("ready") else None

        after = wait_until(restarted, 120, "the killed sidecar to be restarted")
        # running is not serving yet (the sidecar has no readiness probe: its readiness is the pod's)
        warm = wait_until(lambda: pod_json(name, STATUS_PORT, "/stats"), 60, "the restarted sidecar's /stats")
        assert complete(vllm, PROMPT) == expected  # and with the restarted sidecar
        served = pod_json(name, STATUS_PORT, "/stats")
    assert warm["adopted"] > 0  # chunks saved before the kill, served again
    assert served["hits"] > warm["hits"]
    assert served["tiers"]["redis"]["hits"] == warm["tiers"]["redis"]["hits"]  # all from the arena
    assert container_status(after, "vllm")["restartCount"] == container_status(pod, "vllm")["restartCount"]


def test_a_rollout_comes_up_warm_from_the_shared_tier(cluster: Cluster, vllm_workload: str) -> None:
    """The Deployment rolls to the vLLM image with kvpool's connector built in (Dockerfile --target
    connector), annotated `kvpool.dev/connector: image`: new pods, empty arenas, the sidecar injected and
    nothing staged, so vLLM runs the image's own connector. A conversation the old pods served loads as
    much from kvpool on a new pod, with the same answer, and from its own CPU tier: the pool's pre-warm
    (spec.redis.prewarm) loaded the chunks the old pods used most into it as it started."""
    old = vllm_pods()[0]["metadata"]["name"]
    with port_forward(old, 8000) as vllm, port_forward(old, STATUS_PORT) as side:
        answer = answer_stored(vllm, side, ROLLOUT)
        before = hit_tokens(vllm)
        assert complete(vllm, ROLLOUT) == answer
        old_hit = wait_until(lambda: (n := hit_tokens(vllm)) > before and n, 60, "the old pod's hit") - before

        def redis_tier() -> dict[str, Any]:
            return get_json(side + "/stats")["tiers"]["redis"]

        wait_until(lambda: redis_tier()["queued"] == 0, 60, "the write-behind")
        wait_until(lambda: redis_tier()["hot_reported"] > 0, 60, "the loads counted into the pool's hot set")
    template = {
        "metadata": {"annotations": {"kvpool.dev/connector": "image"}},
        "spec": {"containers": [{"name": "vllm", "image": cluster.images["vllm-connector"]}]},
    }
    patch = json.dumps({"spec": {"template": template}})
    kubectl("-n", NAMESPACE, "patch", "deployment", "vllm", "-p", patch)
    kubectl("-n", NAMESPACE, "rollout", "status", "deployment/vllm", "--timeout", "900s", timeout=960)
    rolled = time.monotonic()
    rolled_pods = vllm_pods()
    new = [p["metadata"]["name"] for p in rolled_pods]
    assert old not in new and len(new) == 2
    pool = kubectl_json("-n", NAMESPACE, "get", "kvp", "shared")
    for pod in rolled_pods:
        (container,) = pod["spec"]["containers"]
        assert container["image"] == cluster.images["vllm-connector"]
        assert_injected(pod, pool, "vllm")
        assert not any(c["name"] == "kvpool-connector" for c in pod["spec"]["initContainers"])  # none staged
        assert not any(e["name"] == "PYTHONPATH" for e in container.get("env", []))  # the image's own holds
        assert all(s["restartCount"] == 0 for s in container_statuses(pod)), container_statuses(pod)
    where = "import kvpool_connector.connector as c; print(c.__file__)"
    loaded = kubectl("-n", NAMESPACE, "exec", new[0], "-c", "vllm", "--", "python3", "-c", where)
    assert loaded.strip() == "/opt/kvpool/kvpool_connector/connector.py", loaded
    with port_forward(new[0], 8000) as vllm, port_forward(new[0], STATUS_PORT) as side:
        warm = wait_until(
            lambda: (r := get_json(side + "/stats")["tiers"]["redis"])["prewarm"] == "done" and r,
            60,
            "the new sidecar's pre-warm",
        )
        assert complete(vllm, ROLLOUT) == answer
        new_hit = wait_until(lambda: hit_tokens(vllm) or None, 60, "the new pod's hit")
        after = get_json(side + "/stats")["tiers"]["redis"]
    print(f"rollout: {new_hit:.0f} tokens loaded on a new pod against {old_hit:.0f} on the old one, "
          f"{time.monotonic() - rolled:.1f} s after the rollout was done; {warm['prewarmed']} chunks "
          f"({warm['prewarmed_bytes']} bytes) pre-warmed")  # fmt: skip
    assert new_hit >= 0.8 * old_hit, (new_hit, old_hit)
    assert warm["prewarmed"] > 0
    assert after["hits"] == warm["hits"]  # every chunk loaded came from the pre-warmed CPU tier


def test_kubectl_get_kvp_shows_ready_counts_and_hit_rate(vllm_workload: str) -> None:
    seen: list[dict[str, Any]] = []

    def status() -> dict[str, Any] | None:
        s = kubectl_json("-n", NAMESPACE, "get", "kvp", "shared").get("status", {})
        seen[:] = [s]
        ready = {c["type"]: c for c in s.get("conditions", [])}.get("Ready", {})
        pods_counted = s.get("matchedPods") == s.get("readyPods") == 2  # the rollout's surge pod gone
        counted = pods_counted and float(s.get("stats", {}).get("hitRate") or 0) > 0
        return s if counted and ready.get("status") == "True" else None

    try:  # after the sidecar's restart and the rollout the pool serves again once its /stats answers
        wait_until(status, 120, "the pool Ready, with two matched and ready pods and a hit rate")
    except TimeoutError:
        raise AssertionError(f"last status: {seen}") from None
    table = kubectl("-n", NAMESPACE, "get", "kvp", "shared")  # the scenarios' pools share the namespace
    header, row = table.splitlines()[:2]
    for column in ("BACKEND", "CAPACITY", "PODS", "READY", "HIT RATE"):
        assert column in header
    assert row.split()[0] == "shared" and "redis" in row


def test_deleting_the_pool_cleans_up(vllm_workload: str) -> None:
    kubectl("-n", NAMESPACE, "delete", "kvp", "shared", "--wait=true", "--timeout=120s")
    owned = ["configmap/shared-kvpool", "statefulset/shared-kvpool-redis", "service/shared-kvpool-redis",
             "secret/shared-kvpool-redis"]  # fmt: skip

    def gone() -> bool:
        out = kubectl("-n", NAMESPACE, "get", *owned, "--ignore-not-found", "-o", "name", check=False)
        return out.strip() == ""

    wait_until(gone, 120, "the pool's objects to be garbage-collected")
    # running pods keep their sidecar until they are replaced
    assert all(
        any(c["name"] == "kvpool-sidecar" for c in p["spec"].get("initContainers", [])) for p in vllm_pods()
    )
