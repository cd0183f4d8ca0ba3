"""Small pure parts of the operator: quantities, selectors, scaling decisions, conditions, flags."""

from __future__ import annotations

import asyncio
import datetime

import aiohttp
import pytest
from kvtest import free_port

from kvpool_operator import conditions, pool_health, readiness, working_set
from kvpool_operator.injection import arena_size_limit
from kvpool_operator.kube import ApiError
from kvpool_operator.leading import Peering, leads
from kvpool_operator.pods import PodCounts, aggregate, miss_ratio_curve
from kvpool_operator.pool import ScalingSpec, parse_pool
from kvpool_operator.quantity import format_mebibytes, parse_quantity
from kvpool_operator.scaling import demand_bytes, desired_shards
from kvpool_operator.selector import matches, to_query
from kvpool_operator.shards import shards_to_publish, undrained
from kvpool_operator.vllm_target import strip_ours
from kvpool_sidecar.miss_ratio import SCALES


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4Gi", 4 * 2**30),
        ("512Mi", 512 * 2**20),
        ("1G", 10**9),
        ("1.5Ki", 1536),
        ("100", 100),
        (7, 7),
        ("0.5k", 500),
    ],
)
def test_parse_quantity(text: str | int, value: int) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("bad", ["", "Gi", "-1Gi", "1 Gi", "1gi", "1e3", True, -5])
def test_parse_quantity_refuses(bad: object) -> None:
    with pytest.raises(ValueError, match="quantity"):
        parse_quantity(bad)  # type: ignore[arg-type]


def test_format_mebibytes_rounds_up() -> None:
    assert format_mebibytes(2**30) == "1024Mi" and format_mebibytes(2**20 + 1) == "2Mi"


@pytest.mark.parametrize(("capacity", "limit"), [("1Gi", "1030Mi"), ("1G", "960Mi"), ("1.5Gi", "1544Mi")])
def test_arena_size_limit_holds_the_arena_in_whole_pages(capacity: str, limit: str) -> None:
    pool = parse_pool("ns", "p", {"selector": {"matchLabels": {"a": "b"}}, "capacity": capacity})
    assert arena_size_limit(pool) == limit
    pages = -(-pool.capacity_bytes // 4096)
    assert pages * 4096 < parse_quantity(limit)


SELECTOR = {
    "matchLabels": {"app": "vllm"},
    "matchExpressions": [
        {"key": "tier", "operator": "In", "values": ["a", "b"]},
        {"key": "canary", "operator": "DoesNotExist"},
        {"key": "zone", "operator": "NotIn", "values": ["x"]},
        {"key": "gpu", "operator": "Exists"},
    ],
}


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ({"app": "vllm", "tier": "a", "gpu": "h100"}, True),
        ({"app": "vllm", "tier": "b", "gpu": "1", "zone": "y"}, True),
        ({"app": "vllm", "tier": "c", "gpu": "1"}, False),
        ({"app": "vllm", "tier": "a"}, False),
        ({"app": "vllm", "tier": "a", "gpu": "1", "canary": "1"}, False),
        ({"app": "vllm", "tier": "a", "gpu": "1", "zone": "x"}, False),
        ({"app": "other", "tier": "a", "gpu": "1"}, False),
    ],
)
def test_selector_matches(labels: dict[str, str], expected: bool) -> None:
    assert matches(SELECTOR, labels) is expected


def test_empty_selector_matches_nothing() -> None:
    assert not matches({}, {"app": "vllm"}) and not matches({"matchLabels": {}}, {})


def test_selector_query() -> None:
    assert to_query(SELECTOR) == "app=vllm,tier in (a,b),!canary,zone notin (x),gpu"


S = ScalingSpec(min_replicas=2, max_replicas=6, capacity_percent=100)
GB = 10**9  # a shard holds 1 GB here


@pytest.mark.parametrize(
    ("current", "demand", "since", "expected"),
    [
        (2, 4 * GB, None, 4),  # up at once to what the demand needs
        (2, 2 * GB, None, 2),  # fits exactly: no change
        (4, int(1.7 * GB), None, 3),  # fits two with 10% to spare: down one shard, not two at once
        (3, int(1.85 * GB), None, 3),  # fits two, but not with 10% to spare: no change (no flapping)
        (4, 0, None, 3),  # no pods: down, one at a time
        (2, 0, None, 2),  # ... never below min
        (4, 40 * GB, None, 6),  # never above max
        (2, 4 * GB, 10.0, 4),  # up at once, even within the cooldown of the last change
        (4, 0, 10.0, 4),  # down waits out the cooldown
        (4, 0, 400.0, 3),  # cooldown over
        (1, 0, 10.0, 2),  # below min (bounds changed): corrected even in the cooldown
        (9, 0, 10.0, 6),  # above max: corrected even in the cooldown
    ],
)
def test_desired_shards_follow_demand_both_ways(
    current: int, demand: int, since: float | None, expected: int
) -> None:
    assert desired_shards(current, demand, GB, S, since, cooldown=300) == expected


def test_demand_is_the_ready_pods_arenas_times_the_percent() -> None:
    spec = {"selector": {"matchLabels": {"a": "b"}}, "capacity": "4Gi", "backend": "redis",
            "redis": {"mode": "shared"}, "scaling": {"maxReplicas": 4, "capacityPercent": 150}}  # fmt: skip
    pool = parse_pool("ns", "p", spec)
    assert demand_bytes(pool, 3) == 3 * 4 * 2**30 * 3 // 2


def test_a_shard_stops_only_once_every_sidecar_has_stopped_using_it() -> None:
    def using(n: int | None) -> dict:
        return {"tiers": {"redis": {"shards": n}}} if n is not None else {}

    assert undrained([using(2), using(2)], expected=2, shards=2) == ""
    assert (
        undrained([using(2), using(3)], expected=2, shards=2) == "1 sidecar(s) still use more than 2 shard(s)"
    )
    assert undrained([using(2)], expected=2, shards=2) == "1 of 2 sidecar(s) did not answer"  # unknown
    assert undrained([using(2), using(None)], expected=2, shards=2)  # one has no Redis tier configured
    assert undrained([], expected=0, shards=1) == ""  # no pods: nothing uses any shard


@pytest.mark.parametrize(
    ("published", "desired", "ready", "expected"),
    [(None, 3, 0, 3), (2, 1, 0, 1), (2, 4, 3, 2), (2, 4, 4, 4), (3, 3, 1, 3)],
)
def test_shards_to_publish(published: int | None, desired: int, ready: int, expected: int) -> None:
    assert shards_to_publish(published, desired, ready) == expected


def test_conditions_keep_transition_time_while_unchanged() -> None:
    t0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    t1 = t0 + datetime.timedelta(hours=1)
    fine = pool_health.assess(pool_health.Seen(True, None, PodCounts(0, 0, 0), []))
    first = conditions.merge([], fine, 1, t0)
    same = conditions.merge(first, fine, 2, t1)
    assert [c["lastTransitionTime"] for c in same] == [c["lastTransitionTime"] for c in first]
    assert all(c["observedGeneration"] == 2 for c in same)
    broken = conditions.merge(same, conditions.failed("InvalidSpec", ["spec.capacity is wrong"]), 3, t1)
    by_type = {c["type"]: c for c in broken}
    assert (
        by_type["Ready"]["status"] == "False"
        and by_type["Ready"]["lastTransitionTime"] == "2026-01-01T01:00:00Z"
    )
    assert (
        by_type["Degraded"]["reason"] == "InvalidSpec" and "spec.capacity" in by_type["Degraded"]["message"]
    )


def test_strip_ours_leaves_a_users_connector() -> None:
    ours = '{"kv_connector":"KVPoolConnector","kv_connector_module_path":"kvpool_connector"}'
    theirs = '{"kv_connector":"LMCacheConnectorV1"}'
    argv = ["--model", "m", "--kv-transfer-config", ours, "--x", f"--kv_transfer_config={ours}",
            "--kv-transfer-config", theirs, "--kv-transfer-configs"]  # fmt: skip
    assert strip_ours(argv) == [
        "--model",
        "m",
        "--x",
        "--kv-transfer-config",
        theirs,
        "--kv-transfer-configs",
    ]


@pytest.mark.asyncio
async def test_the_probes_answer_on_ipv4_and_ipv6_alike() -> None:
    """The chart's probe URLs name 0.0.0.0: that means every address of both families, so the kubelet of
    an IPv6-only cluster reaches them too (kopf's own liveness endpoint would bind IPv4 alone)."""
    ready = asyncio.Event()
    ready_port, live_port = free_port(), free_port()
    runners = await readiness.serve(
        f"http://0.0.0.0:{ready_port}/readyz", f"http://0.0.0.0:{live_port}/healthz", ready
    )
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:

            async def status(url: str) -> int:
                async with session.get(url) as rsp:
                    return rsp.status

            for host in ("127.0.0.1", "[::1]"):
                assert await status(f"http://{host}:{live_port}/healthz") == 200
                assert await status(f"http://{host}:{ready_port}/readyz") == 503
            ready.set()
            for host in ("127.0.0.1", "[::1]"):
                assert await status(f"http://{host}:{ready_port}/readyz") == 200
    finally:
        for runner in runners:
            await runner.cleanup()


def test_the_pools_miss_ratio_curve_weighs_each_sidecar_by_its_lookups() -> None:
    def sidecar(hits: int, misses: int, rates: list[float], ceiling: float) -> dict:
        curve = [{"scale": s, "capacity_bytes": 1, "hit_rate": r} for s, r in zip(SCALES, rates, strict=True)]
        return {"hits": hits, "misses": misses, "miss_ratio": {"curve": curve, "ceiling_hit_rate": ceiling}}

    busy = sidecar(300, 100, [0.1, 0.2, 0.3, 0.4, 0.5], 0.9)
    quiet = sidecar(50, 50, [0.5, 0.5, 0.5, 0.5, 0.5], 0.5)
    older = {"hits": 1000, "misses": 0}  # an image without the curve: left out, not a zero
    malformed = {"hits": 1, "misses": 1, "miss_ratio": {"curve": [{"scale": "x"}]}}
    assert miss_ratio_curve([busy, quiet, older, malformed]) == {
        "hitRateAt": {"0.25x": 0.18, "0.5x": 0.26, "1x": 0.34, "2x": 0.42, "4x": 0.5},
        "hitRateCeiling": 0.82,
    }
    assert miss_ratio_curve([older]) == {} and "hitRateAt" not in aggregate([older])


def test_the_shared_tier_holds_the_union_of_what_the_pods_asked_for() -> None:
    import hashlib

    from kvpool_sidecar.miss_ratio import key_hashes
    from kvpool_sidecar.working_set import WorkingSet, decode
    from kvpool_sidecar.working_set import estimate as sidecars_estimate

    def key(i: int, tag: str) -> str:
        return hashlib.sha256(f"{tag}:{i}".encode()).hexdigest()

    def sidecar(own: str) -> dict:  # 1,000 chunks of a shared prompt and 250 of its own, 1 MiB each
        ws = WorkingSet()
        ws.looked_up(key_hashes([key(i, "shared") for i in range(1000)] + [key(i, own) for i in range(250)]))
        return {"stored_bytes": 100 * 2**20, "chunks": 100, "working_set": ws.snapshot()}

    pods = [sidecar(f"pod{n}") for n in range(4)]
    for s in pods:  # one estimate, written in both images
        sketch = decode(s["working_set"]["sketch"])
        assert working_set.estimate(sketch) == sidecars_estimate(sketch)
    shared = working_set.shared_bytes(pods, expected=4)
    assert shared is not None and abs(shared - 2000 * 2**20) < 0.05 * 2000 * 2**20  # not 5,000 chunks
    assert working_set.shared_bytes(pods[:3], expected=4) is None  # one did not answer: unknown
    assert working_set.shared_bytes([*pods[:3], {"chunks": 1}], expected=4) is None  # an older sidecar
    idle = {"stored_bytes": 0, "chunks": 0, "working_set": WorkingSet().snapshot()}
    assert working_set.shared_bytes([idle, idle], expected=2) == 0

    spec = {"selector": {"matchLabels": {"a": "b"}}, "capacity": "8Gi", "backend": "redis",
            "redis": {"mode": "shared"}, "scaling": {"maxReplicas": 64}}  # fmt: skip
    pool = parse_pool("ns", "p", spec)
    assert demand_bytes(pool, 300, shared=2000 * 2**20) == 2500 * 2**20  # not 300 x 8 GiB: 2.4 TiB
    assert demand_bytes(pool, 300, shared=None) == 300 * 8 * 2**30  # no sketch from every pod: arenas
    assert demand_bytes(pool, 1, shared=2**40) == 8 * 2**30  # never more than the arenas
    by_arenas = parse_pool("ns", "p", {**spec, "scaling": {"maxReplicas": 64, "sizeBy": "arenas"}})
    assert demand_bytes(by_arenas, 300, shared=2000 * 2**20) == 300 * 8 * 2**30


def test_only_the_replica_kopf_lets_act_refreshes() -> None:
    """kopf's rule: a replica pauses while a live peer has its priority or a higher one."""
    now = datetime.datetime(2026, 11, 26, 12, 0, tzinfo=datetime.UTC)
    me = Peering(name="kvpool", clusterwide=True, identity="me", priority=-10, standalone=False)

    def peer(priority: int, seconds_ago: float, lifetime: int = 60) -> dict:
        seen = (now - datetime.timedelta(seconds=seconds_ago)).isoformat()
        return {"priority": priority, "lifetime": lifetime, "lastseen": seen}

    assert leads({"me": peer(-10, 0)}, me, now)  # alone
    assert leads({"me": peer(-10, 0), "young": peer(-20, 1)}, me, now)  # the older process leads
    assert not leads({"me": peer(-10, 0), "old": peer(-5, 1)}, me, now)
    assert not leads({"me": peer(-10, 0), "twin": peer(-10, 1)}, me, now)  # a tie pauses both
    assert leads({"me": peer(-10, 0), "gone": peer(-5, 61)}, me, now)  # dead past its lifetime
    assert leads({"me": peer(-10, 0), "odd": {"priority": "x"}}, me, now)  # unreadable: not alive


def test_a_namespace_being_deleted_is_gone_not_a_refusal() -> None:
    """The 403 a terminating namespace answers every create with is the pool going away (refresh and
    reconcile stop), not an API server refusing the operator (a quota, a policy: reported)."""
    terminating = (
        'events "x" is forbidden: unable to create new content in namespace ns because it is being terminated'
    )
    assert ApiError(403, f"POST /api/v1/namespaces/ns/events: {terminating}").gone
    assert ApiError(404, "GET ...").gone
    assert not ApiError(403, 'configmaps "x" is forbidden: exceeded quota: none').gone
