"""Every --stats-interval seconds, per pool: count its pods, gather its sidecars' stats, scale its
shared Redis tier, and write what it found to status (the handler is a kopf timer)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

import kopf

from kvpool_operator import conditions, events, names, objects, pods, pool_health, vllm_breaker
from kvpool_operator.injection import sidecar_image
from kvpool_operator.kube import ApiError, Kube
from kvpool_operator.objects import shard_maxmemory
from kvpool_operator.outdated import outdated
from kvpool_operator.pool import Pool, parse_pool, problems
from kvpool_operator.reconcile import RETRY_DELAY, publish
from kvpool_operator.scaling import demand_bytes, desired_shards, drained, shards_to_publish
from kvpool_operator.state import OperatorState


async def refresh(
    spec: Mapping[str, Any],
    meta: Mapping[str, Any],
    name: str,
    namespace: str | None,
    status: Mapping[str, Any],
    patch: kopf.Patch,
    memo: OperatorState,
    **_: Any,
) -> None:
    namespace = namespace or ""  # pools are namespaced (kopf types None for cluster objects)
    kube = memo.kube
    settings = memo.settings
    try:
        pool = parse_pool(namespace, name, spec, meta.get("uid"))
    except ValueError:
        return  # reconcile reports it
    if problems(pool):
        return
    now = datetime.datetime.now(datetime.UTC)
    generation = meta.get("generation")
    try:
        found = await kube.list_pods(namespace, pool.selector)
        counts = pods.count(found, name, lambda p: outdated(p, pool, settings))
        urls = [
            u for p in found if pods.injected_by(p, name) and pods.is_ready(p) and (u := pods.stats_url(p))
        ]
        each = await pods.scrape(urls, settings.scrape_timeout)
        scraped = [s for s in each if s is not None]
        stats = pods.aggregate(scraped)
        tier: tuple[int, int] | None = None
        shared: dict[str, Any] | None = None
        if pool.shared_tier:
            shared = await scale(kube, pool, memo, now, counts, scraped, len(urls))
            tier = (shared["replicas"], shared["readyReplicas"])
    except ApiError as e:
        raise kopf.TemporaryError(f"API call failed: {e}", delay=RETRY_DELAY) from e

    image = sidecar_image(pool, settings)
    breaker = await sidecar_breaker(kube, pool, image, found, status, generation)
    reset = (meta.get("annotations") or {}).get(vllm_breaker.RESET_ANNOTATION, "")
    failing = await vllm_breaker.update(kube, pool, found, status.get("vllmFailing"), reset, now)
    seen = pool_health.Seen(
        reconciled=status.get("observedGeneration") == generation and bool(status.get("connectorConfig")),
        refused=(status.get("refused") or {}).get("message"),
        counts=counts,
        sidecars=each,
        tier=tier,
        sidecar_breaker=breaker,
        vllm_breaker=failing,
    )
    ready, degraded = pool_health.assess(seen)
    found_status = {
        "matchedPods": counts.matched,
        "readyPods": counts.ready,
        "outdatedPods": counts.outdated,
        "injectedPods": counts.injected,
        "skippedPods": counts.skipped,
        "skipReasons": counts.skip_reasons,
        "stats": stats,
        "sidecarNotStarting": breaker,
        "vllmFailing": failing,
        "conditions": conditions.merge(status.get("conditions") or [], [ready, degraded], generation, now),
    }
    if shared is not None:
        found_status["sharedTier"] = shared
    # only what changed: an unchanged pool costs the API server no write and its watchers no event
    for key, value in found_status.items():
        if status.get(key) != value:
            patch.status[key] = value


async def sidecar_breaker(
    kube: Kube,
    pool: Pool,
    image: str,
    found: list[dict[str, Any]],
    status: Mapping[str, Any],
    generation: Any,
) -> dict[str, Any] | None:
    """status.sidecarNotStarting: open once a pod's kvpool sidecar of the current `image` waits for good
    (the image does not pull, it crashes at start), which as a native sidecar keeps vLLM from starting;
    while open the webhook admits new pods without the cache. It closes when the pool's spec changes
    (a new image): pods still stuck on an older image do not open it again."""
    stuck = [
        r
        for p in found
        if pods.injected_by(p, pool.name) and pods.sidecar_image(p) == image and (r := pods.sidecar_stuck(p))
    ]
    previous = status.get("sidecarNotStarting") or {}
    still_open = previous.get("observedGeneration") == generation
    if not stuck:
        return dict(previous) if still_open else None
    if not still_open:
        await events.post(kube, pool, "Warning", "SidecarNotStarting", f"{len(stuck)} pod(s): {stuck[0]}")
    return {"pods": len(stuck), "reason": stuck[0], "observedGeneration": generation}


async def scale(
    kube: Kube,
    pool: Pool,
    memo: OperatorState,
    now: datetime.datetime,
    counts: pods.PodCounts,
    sidecars: list[dict[str, Any]],
    expected: int,
) -> dict[str, Any]:
    """Resizes the shared tier to the pool's demand (its ready pods) and publishes the shard list;
    returns sharedTier.

    `sidecars` are the /stats that answered of the `expected` ready pods' sidecars: a shard is stopped
    only once all of them have stopped using it. The time of the last change lives on the
    StatefulSet, written in the same patch as the count, and read fresh every time: a pool's status
    seen by a timer may lag behind its last write.
    """
    assert pool.redis is not None
    settings = memo.settings
    ns, name = pool.namespace, names.redis_name(pool.name)
    sts = await kube.get("StatefulSet", ns, name)
    if sts is None:  # reconcile creates it
        return {"replicas": 0, "readyReplicas": 0}
    running = int(sts.get("spec", {}).get("replicas") or 0)
    ready = int((sts.get("status") or {}).get("readyReplicas") or 0)
    last = (sts["metadata"].get("annotations") or {}).get(names.LAST_SCALE_ANNOTATION)
    result: dict[str, Any] = {"lastScaleTime": last} if last else {}

    desired = pool.redis.replicas
    why = ""
    if pool.scaling is not None:
        utilization = await memo.memory_source(pool, await _ready_shard_pods(kube, pool))
        if utilization is not None:  # shown, never acted on: an LRU cache is always full
            result["memoryUtilization"] = round(utilization)
        demand, shard = demand_bytes(pool, counts.ready), shard_maxmemory(pool)
        result["demandBytes"] = demand
        since = (now - datetime.datetime.fromisoformat(last)).total_seconds() if last else None
        desired = desired_shards(running, demand, shard, pool.scaling, since, settings.scale_cooldown)
        percent = pool.scaling.capacity_percent
        why = f" ({counts.ready} pods x {pool.capacity} x {percent}%, {shard} bytes a shard)"

    cm_name = names.config_map_name(pool.name)
    published = objects.published_shards(await kube.get("ConfigMap", ns, cm_name))
    if desired < running:  # sidecars stop using the shards before they go away
        if published is None or published > desired:
            await publish(kube, pool, desired)
            published = desired
        if not drained(sidecars, expected, desired):
            result.update(replicas=running, readyReplicas=ready, publishedShards=published, draining=True)
            return result
    if desired != running:
        stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        change = {
            "metadata": {"annotations": {names.LAST_SCALE_ANNOTATION: stamp}},
            "spec": {"replicas": desired},
        }
        await kube.patch("StatefulSet", ns, name, change)
        result["lastScaleTime"] = stamp
        await events.post(
            kube, pool, "Normal", "Scaled", f"shared Redis tier {running} -> {desired} shards{why}"
        )
    count = shards_to_publish(published, desired, ready)
    if count != published:
        await publish(kube, pool, count)
    result.update(replicas=desired, readyReplicas=ready, publishedShards=count)
    return result


async def _ready_shard_pods(kube: Kube, pool: Pool) -> list[dict[str, Any]]:
    found = await kube.list_pods(pool.namespace, {"matchLabels": objects.redis_selector(pool)})
    return [p for p in found if pods.is_ready(p)]
