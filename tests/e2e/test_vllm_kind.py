"""vLLM on a real cluster (kind only, until the real node has a CPU vLLM image): injection, the
sidecar's endpoints, a cross-pod cache hit through
the shared Redis tier with identical output, honest `kubectl get kvp`, and clean deletion.

The tests run in file order on one cluster: the hit-rate check reads what the cross-pod test did,
and the last test deletes the pool.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest
from clusterkit import NAMESPACE, get_json, kubectl, kubectl_json, pods, port_forward
from kvtest import wait_until
from podchecks import assert_injected

pytestmark = pytest.mark.kind

STATUS_PORT = 7071  # the pool's sidecar port 7070 + 1
PROMPT = " ".join(f"the cache keeps token {i} of this prompt warm" for i in range(30))


def vllm_pods() -> list[dict[str, Any]]:
    return pods("app=vllm-e2e")


def complete(base: str, prompt: str) -> str:
    body = json.dumps({"model": "/models/tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(
        base + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)["choices"][0]["text"]


def test_both_pods_got_the_sidecar_and_the_config(vllm_workload: str) -> None:
    pods = vllm_pods()
    assert len(pods) == 2
    pool = kubectl_json("-n", NAMESPACE, "get", "kvp", "shared")
    for pod in pods:
        assert_injected(pod, pool, "vllm")  # the same check the API-server tier makes (tests/k8s)
        assert all(cs["ready"] for cs in pod["status"]["containerStatuses"])


def test_sidecar_readyz_and_stats_through_port_forward(vllm_workload: str) -> None:
    for pod in vllm_pods():
        with port_forward(pod["metadata"]["name"], STATUS_PORT) as url:
            with urllib.request.urlopen(url + "/readyz", timeout=10) as r:
                assert r.status == 200
            stats = get_json(url + "/stats")
            assert stats["capacity_bytes"] == 256 * 2**20
            assert stats["tiers"]["redis"]["ready"] is True


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


def test_kubectl_get_kvp_shows_ready_counts_and_hit_rate(vllm_workload: str) -> None:
    def status() -> dict[str, Any] | None:
        s = kubectl_json("-n", NAMESPACE, "get", "kvp", "shared").get("status", {})
        return s if s.get("readyPods") == 2 and float(s.get("stats", {}).get("hitRate") or 0) > 0 else None

    s = wait_until(status, 120, "the pool's status to show two ready pods and a hit rate")
    assert s["matchedPods"] == 2
    assert {c["type"]: c["status"] for c in s["conditions"]}["Ready"] == "True"
    table = kubectl("-n", NAMESPACE, "get", "kvp")
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
