"""The operator against kmock (a Kubernetes API emulator): pools become ConfigMaps, status, a shared
Redis tier; spec changes and outdated pods; stats from a real sidecar; scaling and its cooldown;
deletion. kmock's gaps are worked around in tests/kubeharness/emulator.py, never in the operator."""

from __future__ import annotations

import datetime
import json
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubeharness.emulator import Cluster, wait_indexed
from kubeharness.objects import apps_path, core_path, pool_manifest, pool_path, secret_value
from kubeharness.webhooks import admitted, take_skip_reason
from kvtest import free_port, wait_until

from kvpool_connector.config import load_config
from kvpool_operator import kube
from kvpool_sidecar.client import SidecarClient

_created: list[tuple[str, str]] = []


def create_pool(cluster: Cluster, namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    _created.append((namespace, name))
    return cluster.api.create(pool_path(namespace), pool_manifest(namespace, name, spec))


@pytest.fixture(autouse=True)
def _delete_pools_afterwards(cluster: Cluster) -> Iterator[None]:
    """Each test's pools go when it ends: their timers would only load the shared operator."""
    assert cluster.operator.thread.is_alive(), cluster.operator.error
    yield
    while _created:
        namespace, name = _created.pop()
        cluster.api.delete(pool_path(namespace, name))


def pool_status(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    return (cluster.api.get(pool_path(namespace, name)) or {}).get("status") or {}


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


def wait_status(
    cluster: Cluster, namespace: str, name: str, check: Callable[[dict[str, Any]], Any], what: str
) -> dict:
    wait_until(lambda: check(pool_status(cluster, namespace, name)), 30, what)
    return pool_status(cluster, namespace, name)


def owned_by(obj: dict[str, Any], pool: dict[str, Any]) -> bool:
    return obj["metadata"].get("ownerReferences") == [
        {
            "apiVersion": "kvpool.dev/v1alpha1",
            "kind": "KVCachePool",
            "name": pool["metadata"]["name"],
            "uid": pool["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def run_pod(
    cluster: Cluster, namespace: str, name: str, labels: dict[str, str], *, ready: bool, **meta: Any
) -> dict:
    """A pod as a ReplicaSet would create it: through the webhook, then stored, then (kmock has no
    kubelet) given the status the kubelet would report."""
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "vllm-", "labels": labels, **meta},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai", "args": ["--model", "m"]}]},
    }
    wait_indexed(cluster, namespace)
    pod, _ = admitted(cluster.webhook_url, pod, namespace)
    pod["metadata"].update(name=name, namespace=namespace)
    cluster.api.create(core_path(namespace, "pods"), pod)
    status = {
        "phase": "Running",
        "podIP": "127.0.0.1",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    cluster.api.patch(core_path(namespace, "pods", name), {"status": status})
    return pod


def test_cpu_pool_gets_configmap_and_ready_status(cluster: Cluster) -> None:
    pool = create_pool(
        cluster, "cpu", "llama", {"selector": {"matchLabels": {"app": "vllm"}}, "capacity": "1Gi"}
    )
    status = wait_status(
        cluster, "cpu", "llama", lambda s: condition(s, "Ready").get("status") == "True", "Ready"
    )
    cm = cluster.api.get(core_path("cpu", "configmaps", "llama-kvpool"))
    assert cm is not None and owned_by(cm, pool)
    assert cm["data"] == {"kv-transfer-config.json": status["connectorConfig"]}
    config = json.loads(status["connectorConfig"])
    assert config["kv_load_failure_policy"] == "recompute"
    assert load_config(config["kv_connector_extra_config"])[1] == []
    assert status["observedGeneration"] == 1
    assert condition(status, "Degraded")["status"] == "False"
    wait_until(
        lambda: any(e["reason"] == "ConfigUpdated" for e in cluster.api.events("cpu", "llama")), 30, "event"
    )


def test_changing_chunk_size_and_priority_updates_config_and_counts_outdated(cluster: Cluster) -> None:
    ns, selector = "upd", {"matchLabels": {"app": "vllm"}}
    create_pool(cluster, ns, "llama", {"selector": selector, "chunkSize": 256})
    wait_status(cluster, ns, "llama", lambda s: s.get("connectorConfig"), "config")
    run_pod(cluster, ns, "ready-1", {"app": "vllm"}, ready=True)
    run_pod(cluster, ns, "starting-1", {"app": "vllm"}, ready=False)
    run_pod(cluster, ns, "opted-out", {"app": "vllm"}, ready=True, annotations={"kvpool.dev/inject": "false"})
    run_pod(cluster, ns, "other-app", {"app": "web"}, ready=True)
    wait_status(
        cluster,
        ns,
        "llama",
        lambda s: (s.get("matchedPods"), s.get("readyPods"), s.get("outdatedPods")) == (2, 1, 0),
        "2 matched, 1 ready, 0 outdated",
    )

    cluster.api.patch(
        pool_path(ns, "llama"), {"spec": {"chunkSize": 512, "priorityLimit": 5}}, new_generation=True
    )
    status = wait_status(
        cluster,
        ns,
        "llama",
        lambda s: s.get("observedGeneration") == 2 and s.get("outdatedPods") == 2,
        "the new config and 2 outdated pods",
    )
    extra = json.loads(status["connectorConfig"])["kv_connector_extra_config"]
    assert (extra["chunk_size"], extra["priority_limit"]) == (512, 5)
    cm = cluster.api.read(core_path(ns, "configmaps", "llama-kvpool"))
    assert cm["data"]["kv-transfer-config.json"] == status["connectorConfig"]

    fresh = run_pod(cluster, ns, "ready-2", {"app": "vllm"}, ready=True)  # a replacement gets the new config
    args = fresh["spec"]["containers"][0]["args"]
    assert args[args.index("--kv-transfer-config") + 1] == status["connectorConfig"]
    wait_status(
        cluster,
        ns,
        "llama",
        lambda s: (s.get("matchedPods"), s.get("readyPods"), s.get("outdatedPods")) == (3, 2, 2),
        "3 matched, 2 ready, still 2 outdated",
    )


def test_status_stats_come_from_the_ready_sidecars(
    cluster: Cluster, sidecar_factory: Callable[..., Any]
) -> None:
    port = next(p for p in iter(free_port, None) if p < 65000 and _free(p + 1))
    sidecar = sidecar_factory("64Mi", (), "--status-port", str(port + 1), port=port)
    client = SidecarClient(sidecar.info["url"])
    keys = [f"{i:032x}" for i in range(3)]
    for key in keys[:2]:
        assert client.put(key, b"x" * 4096)
    assert client.lookup(keys) == 2  # a hit of 2 chunks, then a miss
    ns = "stats"
    create_pool(
        cluster,
        ns,
        "llama",
        {"selector": {"matchLabels": {"app": "vllm"}}, "capacity": "64Mi", "sidecar": {"port": port}},
    )
    wait_status(cluster, ns, "llama", lambda s: s.get("connectorConfig"), "config")
    run_pod(cluster, ns, "vllm-0", {"app": "vllm"}, ready=True)
    expected = client.stats()
    status = wait_status(cluster, ns, "llama", lambda s: s.get("stats", {}).get("sidecars") == 1, "stats")
    stats = status["stats"]
    assert stats["capacityBytes"] == 64 * 2**20 == expected["capacity_bytes"]
    assert stats["storedBytes"] == expected["stored_bytes"] >= 2 * 4096
    assert stats["hits"] == expected["hits"] and stats["misses"] == expected["misses"]
    assert stats["hitRate"] == round(expected["hits"] / (expected["hits"] + expected["misses"]), 4) > 0
    curve = expected["miss_ratio"]  # the sidecar's own sizing estimate, as the pool's
    assert stats["hitRateAt"] == {f"{p['scale']:g}x": round(p["hit_rate"], 4) for p in curve["curve"]}
    assert stats["hitRateCeiling"] == round(curve["ceiling_hit_rate"], 4)
    client.close()


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_shared_redis_pool_owns_secret_statefulset_and_service(cluster: Cluster) -> None:
    ns = "shared"
    pool = create_pool(
        cluster,
        ns,
        "llama",
        {
            "selector": {"matchLabels": {"app": "vllm"}},
            "backend": "redis",
            "redis": {"mode": "shared", "replicas": 2, "memory": "512Mi"},
        },
    )
    starting = lambda s: condition(s, "Ready").get("reason") == "SharedTierStarting"  # noqa: E731
    wait_status(cluster, ns, "llama", starting, "no shard ready yet")

    secret = cluster.api.read(core_path(ns, "secrets", "llama-kvpool-redis"))
    password = secret_value(secret, "password")
    assert len(password) >= 32 and owned_by(secret, pool)
    key_secret = cluster.api.read(core_path(ns, "secrets", "llama-kvpool-key"))  # authenticates chunks
    pool_key = secret_value(key_secret, "pool-key")
    assert len(pool_key) >= 32 and pool_key != password and owned_by(key_secret, pool)
    service = cluster.api.read(core_path(ns, "services", "llama-kvpool-redis"))
    sts = cluster.api.read(apps_path(ns, "statefulsets", "llama-kvpool-redis"))
    assert owned_by(service, pool) and owned_by(sts, pool)
    assert service["spec"]["clusterIP"] == "None"
    selector = sts["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"] == selector
    assert sts["spec"]["template"]["metadata"]["labels"].items() >= selector.items()
    assert sts["spec"]["replicas"] == 2 and sts["spec"]["serviceName"] == "llama-kvpool-redis"
    (redis,) = sts["spec"]["template"]["spec"]["containers"]
    assert redis["resources"] == {
        "requests": {"cpu": "250m", "memory": "512Mi"},
        "limits": {"memory": "512Mi"},
    }
    assert redis["args"][redis["args"].index("--maxmemory") + 1] == str(int(512 * 2**20 * 0.7))
    assert redis["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "llama-kvpool-redis", "key": "password"}
    assert sts["spec"]["template"]["metadata"]["labels"]["kvpool.dev/inject"] == "false"  # never injected
    cm = cluster.api.read(core_path(ns, "configmaps", "llama-kvpool"))
    assert cm["data"]["redis-urls"].splitlines() == [
        f"redis://llama-kvpool-redis-{i}.llama-kvpool-redis.shared.svc:6379/0" for i in range(2)
    ]

    cluster.api.patch(apps_path(ns, "statefulsets", "llama-kvpool-redis"), {"status": {"readyReplicas": 2}})
    status = wait_status(
        cluster, ns, "llama", lambda s: condition(s, "Degraded").get("status") == "False", "healthy"
    )
    assert condition(status, "Ready")["status"] == "True"
    assert status["sharedTier"]["replicas"] == status["sharedTier"]["readyReplicas"] == 2

    cluster.api.patch(pool_path(ns, "llama"), {"spec": {"chunkSize": 128}}, new_generation=True)
    wait_status(cluster, ns, "llama", lambda s: s.get("observedGeneration") == 2, "the update handled")
    secret = cluster.api.read(core_path(ns, "secrets", "llama-kvpool-redis"))
    assert secret_value(secret, "password") == password  # a generated password is never regenerated
    key_secret = cluster.api.read(core_path(ns, "secrets", "llama-kvpool-key"))
    assert secret_value(key_secret, "pool-key") == pool_key

    # fewer shards: the sidecars are told before the StatefulSet shrinks
    before = len(cluster.api.requests())
    cluster.api.patch(pool_path(ns, "llama"), {"spec": {"redis": {"replicas": 1}}}, new_generation=True)
    wait_until(lambda: scale_state(cluster, ns, "llama") == (1, 1), 30, "one shard")
    sent = cluster.api.requests()[before:]
    unpublished = next(
        i
        for i, (m, p, _, body) in enumerate(sent)
        if m == "PATCH"
        and p == core_path(ns, "configmaps", "llama-kvpool")
        and len(body["data"]["redis-urls"].splitlines()) == 1
    )
    shrunk = next(
        i
        for i, (m, p, _, body) in enumerate(sent)
        if m == "PATCH"
        and p == apps_path(ns, "statefulsets", "llama-kvpool-redis")
        and body["spec"]["replicas"] == 1
    )
    assert unpublished < shrunk


def scale_state(cluster: Cluster, ns: str, pool: str = "tier") -> tuple[int, int]:
    """(StatefulSet replicas, shard URLs published to the sidecars)."""
    sts = cluster.api.read(apps_path(ns, "statefulsets", f"{pool}-kvpool-redis"))
    cm = cluster.api.read(core_path(ns, "configmaps", f"{pool}-kvpool"))
    return sts["spec"]["replicas"], len(cm["data"]["redis-urls"].splitlines())


def refreshes(cluster: Cluster) -> int:
    """How many times the operator measured the pool's memory (once per refresh)."""
    return cluster.memory.reads.get("tier", 0)


def end_cooldown(cluster: Cluster, ns: str) -> None:
    """Moves the last scaling into the past instead of waiting out the hour-long test cooldown."""
    cluster.api.patch(
        apps_path(ns, "statefulsets", "tier-kvpool-redis"),
        {"metadata": {"annotations": {"kvpool.dev/last-scale-time": "2000-01-01T00:00:00Z"}}},
    )


def shards_ready(cluster: Cluster, ns: str, n: int) -> None:
    cluster.api.patch(apps_path(ns, "statefulsets", "tier-kvpool-redis"), {"status": {"readyReplicas": n}})


def shared_tier(cluster: Cluster, ns: str, capacity: str, max_replicas: int, **spec: Any) -> None:
    """A pool "tier" of the pods labelled app=vllm with a shared Redis tier of 128Mi shards, scaled
    from one to `max_replicas`; once its StatefulSet exists, the first shard is reported ready."""
    create_pool(
        cluster,
        ns,
        "tier",
        {
            "selector": {"matchLabels": {"app": "vllm"}},
            "capacity": capacity,
            "backend": "redis",
            "redis": {"mode": "shared", "replicas": 1, "memory": "128Mi"},
            "scaling": {"minReplicas": 1, "maxReplicas": max_replicas},
            **spec,
        },
    )
    wait_until(
        lambda: cluster.api.get(apps_path(ns, "statefulsets", "tier-kvpool-redis")), 30, "the StatefulSet"
    )
    shards_ready(cluster, ns, 1)


def test_the_shared_tier_follows_the_pools_pods_both_ways_within_bounds_with_a_cooldown(
    cluster: Cluster,
) -> None:
    """Demand is the ready pods' arenas together (64 MiB each here; a 128Mi shard holds 89.6 MiB): two
    pods, two shards; five, the maximum of three at once (the cooldown holds shrinks only); none,
    down one shard per cooldown to the minimum, each unpublished before it stops. (Real sidecars,
    whose drain holds a shrink: tests/k8s.)"""
    ns = "scale"
    shared_tier(cluster, ns, "64Mi", 3)
    assert scale_state(cluster, ns) == (1, 1)
    for i in range(2):
        run_pod(cluster, ns, f"vllm-{i}", {"app": "vllm"}, ready=True)

    def scaled_up() -> bool:
        # the shard stays ready, as a StatefulSet controller keeps reporting it (an operator patch of
        # the object may land after the test's status patch above)
        shards_ready(cluster, ns, 1)
        return scale_state(cluster, ns)[0] == 2

    wait_until(scaled_up, 60, "scale up to 2")
    assert scale_state(cluster, ns) == (2, 1)  # the new shard is not published before it is ready
    wait_until(
        lambda: any(e["reason"] == "Scaled" for e in cluster.api.events(ns, "tier")), 30, "a Scaled event"
    )
    shards_ready(cluster, ns, 2)
    wait_until(lambda: scale_state(cluster, ns) == (2, 2), 30, "the second shard published")
    status = pool_status(cluster, ns, "tier")
    assert status["sharedTier"]["demandBytes"] == 2 * 64 * 2**20 and status["sharedTier"]["replicas"] == 2

    def step_down_to(n: int) -> None:
        # The cooldown ended once, not on every poll: an end landing just after the operator's own
        # change would let the next shrink start at once, and the state below would not hold still.
        end_cooldown(cluster, ns)
        wait_until(lambda: scale_state(cluster, ns)[0] == n, 30, f"down to {n} shard(s)")

    for i in range(2, 5):
        run_pod(cluster, ns, f"vllm-{i}", {"app": "vllm"}, ready=True)
    # up at once, though the last change (to two shards) was a moment ago and the cooldown is an hour
    wait_until(lambda: scale_state(cluster, ns)[0] == 3, 30, "scale up to the maximum")  # 320 MiB: 4, max 3
    shards_ready(cluster, ns, 3)
    wait_until(lambda: scale_state(cluster, ns) == (3, 3), 30, "three shards published")
    seen = refreshes(cluster)  # in the cooldown, and at the maximum: no change
    wait_until(lambda: refreshes(cluster) >= seen + 3, 30, "three more refreshes")
    assert scale_state(cluster, ns) == (3, 3)

    # a change just now (the test's own end_cooldown may have landed after the operator's last one)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    cluster.api.patch(
        apps_path(ns, "statefulsets", "tier-kvpool-redis"),
        {"metadata": {"annotations": {"kvpool.dev/last-scale-time": now}}},
    )
    for i in range(5):  # the pool's Deployment scaled to zero: the tier follows, one shard at a time
        cluster.api.delete(core_path(ns, "pods", f"vllm-{i}"))
    seen = refreshes(cluster)
    wait_until(lambda: refreshes(cluster) >= seen + 3, 30, "three more refreshes")
    assert scale_state(cluster, ns) == (3, 3)  # the cooldown holds the shrink too
    step_down_to(2)
    assert scale_state(cluster, ns) == (2, 2)  # unpublished before it goes
    step_down_to(1)  # the minimum
    assert scale_state(cluster, ns) == (1, 1)
    end_cooldown(cluster, ns)
    seen = refreshes(cluster)
    wait_until(lambda: refreshes(cluster) >= seen + 3, 30, "three more refreshes")
    assert scale_state(cluster, ns) == (1, 1)  # never below the minimum


def test_a_shrink_whose_sidecars_never_confirm_gives_up_after_the_drain_timeout(cluster: Cluster) -> None:
    """A ready pod whose sidecar does not answer (nothing listens on its status port here) can never
    confirm it stopped using a shard that goes. The shrink unpublishes the shard, waits the drain
    timeout (3 s here, 10 minutes by default), then stops it anyway: a Warning event, and the pool
    Degraded with reason DrainGaveUp naming why. Before, the tier stayed at its size for ever."""
    ns = "drain"
    shared_tier(cluster, ns, "64Mi", 2)
    for i in range(2):
        run_pod(cluster, ns, f"vllm-{i}", {"app": "vllm"}, ready=True)

    def two_shards_published() -> bool:
        shards_ready(cluster, ns, 2 if scale_state(cluster, ns)[0] == 2 else 1)
        return scale_state(cluster, ns) == (2, 2)

    wait_until(two_shards_published, 60, "two shards, both published")
    cluster.api.delete(core_path(ns, "pods", "vllm-1"))  # demand for one shard
    end_cooldown(cluster, ns)
    draining = wait_status(
        cluster, ns, "tier", lambda s: (s.get("sharedTier") or {}).get("draining"), "the shrink to drain"
    )["sharedTier"]
    assert draining["drainingSince"] and scale_state(cluster, ns) == (2, 1)  # unpublished, still running
    wait_until(lambda: scale_state(cluster, ns) == (1, 1), 30, "the shrink to give up waiting")
    status = wait_status(
        cluster, ns, "tier", lambda s: (s.get("sharedTier") or {}).get("drainGaveUp"), "drainGaveUp"
    )
    assert "1 of 1 sidecar(s) did not answer" in status["sharedTier"]["drainGaveUp"]
    said = "shared Redis tier: stopped 1 shard(s) after"  # Degraded lists it (its first reason is
    # SidecarsNotAnswering: that pod's sidecar also keeps the pool from Ready)
    degraded = wait_status(
        cluster, ns, "tier", lambda s: said in condition(s, "Degraded").get("message", ""), "Degraded"
    )
    assert condition(degraded, "Degraded")["status"] == "True"
    warnings = [e for e in cluster.api.events(ns, "tier") if e["reason"] == "DrainGaveUp"]
    assert warnings and warnings[0]["type"] == "Warning"


def test_the_shared_tier_is_sized_by_what_the_pods_share_not_by_their_arenas(
    cluster: Cluster, sidecar_factory: Callable[..., Any]
) -> None:
    """Two pods with 1 GiB arenas would ask 2 GiB of the tier (four shards of 128Mi, the maximum here).
    Their sidecar (both pods' status port reach one real sidecar here) asked for 40 distinct chunks of
    4 KiB lately: the tier stays at one shard, and says what it sized to."""
    port = next(p for p in iter(free_port, None) if p < 65000 and _free(p + 1))
    sidecar = sidecar_factory("64Mi", (), "--status-port", str(port + 1), port=port)
    client = SidecarClient(sidecar.info["url"])
    keys = [f"{i:032x}" for i in range(40)]
    for key in keys:
        assert client.put(key, b"x" * 4096)
    assert client.lookup(keys) == 40
    ns = "sharing"
    shared_tier(cluster, ns, "1Gi", 4, sidecar={"port": port})
    for i in range(2):
        run_pod(cluster, ns, f"vllm-{i}", {"app": "vllm"}, ready=True)
    tier = wait_status(
        cluster, ns, "tier", lambda s: (s.get("sharedTier") or {}).get("workingSetBytes"), "the working set"
    )["sharedTier"]
    assert abs(tier["workingSetBytes"] - 40 * 4096) < 0.05 * 40 * 4096
    assert tier["demandBytes"] == math.ceil(tier["workingSetBytes"] * 1.25)  # not 2 x 1 GiB
    seen = refreshes(cluster)
    wait_until(lambda: refreshes(cluster) >= seen + 3, 30, "three more refreshes")
    assert scale_state(cluster, ns) == (1, 1)
    client.close()


def test_external_redis_is_configured_without_reading_its_secret(cluster: Cluster) -> None:
    """The password Secret is the user's: the operator never reads Secrets (least privilege), so the
    pool is Ready without it; pods reference it optionally and their sidecars report a refused login."""
    ns = "ext"
    create_pool(
        cluster,
        ns,
        "llama",
        {
            "selector": {"matchLabels": {"app": "vllm"}},
            "backend": "redis",
            "redis": {
                "mode": "external",
                "url": "redis://redis.cache.svc:6379/0",
                "passwordSecretRef": {"name": "pw"},
            },
        },
    )
    wait_status(cluster, ns, "llama", lambda s: condition(s, "Ready").get("status") == "True", "Ready")
    cm = cluster.api.read(core_path(ns, "configmaps", "llama-kvpool"))
    assert cm["data"]["redis-urls"] == "redis://redis.cache.svc:6379/0\n"


def test_a_pool_the_schema_cannot_refuse_is_degraded_and_never_injected(cluster: Cluster) -> None:
    ns = "bad"
    create_pool(
        cluster,
        ns,
        "llama",
        {
            "selector": {"matchLabels": {"app": "vllm"}},
            "capacity": "4Gi",
            "sidecar": {"resources": {"limits": {"memory": "1Gi"}}},
        },
    )
    status = wait_status(
        cluster, ns, "llama", lambda s: condition(s, "Degraded").get("status") == "True", "Degraded"
    )
    assert condition(status, "Degraded")["reason"] == "InvalidSpec"
    assert "spec.sidecar.resources.limits.memory" in condition(status, "Degraded")["message"]
    assert cluster.api.get(core_path(ns, "configmaps", "llama-kvpool")) is None
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"labels": {"app": "vllm"}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
    }
    wait_indexed(cluster, ns)
    result, response = admitted(cluster.webhook_url, pod, ns)
    assert take_skip_reason(result).startswith("PoolNotUsable: pool llama is not usable")
    assert result == pod and "not usable" in response["warnings"][0]


def test_skipped_replicas_are_one_event_per_owner_with_a_count(cluster: Cluster) -> None:
    """Every pod of a ReplicaSet is skipped (here: the pool's sidecar could never start, a pool not
    usable), and its pool gets one PodNotInjected event for them, counted up in place, naming the owner
    and a pod."""
    ns = "skipped"
    unusable = {"sidecar": {"resources": {"limits": {"memory": "1Gi"}}}}
    create_pool(
        cluster, ns, "llama", {"selector": {"matchLabels": {"app": "vllm"}}, "capacity": "4Gi", **unusable}
    )
    wait_status(cluster, ns, "llama", lambda s: condition(s, "Degraded").get("status") == "True", "Degraded")
    ref = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "vllm-5c9d", "uid": "u", "controller": True}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "vllm-5c9d-", "labels": {"app": "vllm"}, "ownerReferences": [ref]},
        "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
    }

    def counted(n: int) -> dict[str, Any] | None:
        found = [e for e in cluster.api.events(ns, "llama") if "ReplicaSet/vllm-5c9d" in e.get("message", "")]
        return found[0] if len(found) == 1 and found[0].get("count") == n else None

    wait_indexed(cluster, ns)
    admitted(cluster.webhook_url, pod, ns)
    wait_until(lambda: counted(1), 30, "the owner's event, created")
    for _ in range(4):
        admitted(cluster.webhook_url, pod, ns)
    event = wait_until(lambda: counted(5), 30, "the same event counted up to 5")
    assert event["reason"] == "PodNotInjected" and event["type"] == "Warning"
    assert event["message"].startswith("pod vllm-5c9d- of ReplicaSet/vllm-5c9d: PoolNotUsable: ")


def test_extra_config_is_merged_under_the_pools_own_keys_with_a_warning(cluster: Cluster) -> None:
    ns = "extra"
    create_pool(cluster, ns, "llama", {"selector": {"matchLabels": {"app": "vllm"}},
                                       "extraConfig": {"chunk_size": 64, "timeout_ms": 300}})  # fmt: skip
    status = wait_status(cluster, ns, "llama", lambda s: s.get("connectorConfig"), "config")
    extra = json.loads(status["connectorConfig"])["kv_connector_extra_config"]
    assert (extra["chunk_size"], extra["timeout_ms"]) == (256, 300)

    def warned() -> bool:
        return any(e["reason"] == "ExtraConfigOverridden" and "spec.extraConfig.chunk_size" in e["message"]
                   for e in cluster.api.events(ns, "llama"))  # fmt: skip

    wait_until(warned, 30, "a warning event")


def test_a_wrong_type_the_api_server_let_through_is_reported_not_crashed_on(cluster: Cluster) -> None:
    """kmock validates nothing, like an API server without the CRD's schema: the operator checks too."""
    ns = "types"
    create_pool(cluster, ns, "llama", {"selector": {"matchLabels": {"app": "vllm"}}, "chunkSize": "big"})
    status = wait_status(
        cluster, ns, "llama", lambda s: condition(s, "Degraded").get("status") == "True", "Degraded"
    )
    assert "spec.chunkSize" in condition(status, "Degraded")["message"]
    assert cluster.operator.thread.is_alive()


def test_deleting_a_pool_completes(cluster: Cluster) -> None:
    ns = "del"
    pool = create_pool(cluster, ns, "llama", {"selector": {"matchLabels": {"app": "vllm"}}})
    wait_status(cluster, ns, "llama", lambda s: s.get("matchedPods") == 0, "a first refresh")
    cm = cluster.api.read(core_path(ns, "configmaps", "llama-kvpool"))
    assert owned_by(cm, pool)  # the API server's garbage collector deletes it with the pool (kmock has none)
    cluster.api.delete(pool_path(ns, "llama"))
    _created.remove((ns, "llama"))
    wait_until(lambda: cluster.api.get(pool_path(ns, "llama")) is None, 30, "the pool to be gone")


_RESOURCE_PATH = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)(?:/namespaces/[^/]+)?/(?P<resource>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$"
)


def operator_permissions(requests: list[tuple[str, str, dict[str, str], Any]]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource[/subresource], verb) for every API request made, as RBAC names them."""
    used = set()
    for method, path, params, _ in requests:
        m = _RESOURCE_PATH.match(path)
        if not m:
            continue  # discovery (/api, /apis/<group>/<version>) needs no RBAC rule
        group, resource, name, sub = (
            m.group("group") or "",
            m.group("resource"),
            m.group("name"),
            m.group("sub"),
        )
        if method == "GET":
            verb = "watch" if params.get("watch") == "true" else ("get" if name else "list")
        else:
            verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method]
        used.add((group, f"{resource}/{sub}" if sub else resource, verb))
    return used


def test_every_request_the_operator_sent_is_in_its_rbac(cluster: Cluster) -> None:
    """Runs last in this file: by now the scenarios above made every kind of call."""
    sent = cluster.api.requests()
    pod_lists = [q for m, p, q, _ in sent if m == "GET" and p.endswith("/pods")]
    assert pod_lists and all(q.get("labelSelector") for q in pod_lists)  # the server filters (kmock does not)
    used = operator_permissions(sent)
    missing = {(g, r, v) for g, r, v in used if v not in kube.RBAC.get((g, r), frozenset())}
    assert not missing, f"requests outside kube.RBAC: {sorted(missing)}"
    ours = {(k.group, k.plural, v) for k in kube.KINDS.values() for v in k.verbs}
    assert ours <= used, f"kube.KINDS lists verbs no scenario used: {sorted(ours - used)}"
