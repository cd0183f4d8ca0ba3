"""How many shards a pool's shared Redis tier runs, and how many of them its sidecars are told (the
ConfigMap key whose file they re-read): reconcile starts the tier, refresh resizes it.

The rule both follow: a new shard is published only once it is ready, and a shard that goes is
unpublished first and stopped only once every sidecar has stopped using it (drained). The count
itself comes from scaling.py.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from kvpool_operator import events, names, objects, pods, working_set
from kvpool_operator.kube import Kube
from kvpool_operator.objects import shard_maxmemory
from kvpool_operator.pool import Pool
from kvpool_operator.scaling import clamp, demand_bytes, desired_shards
from kvpool_operator.state import OperatorState


def initial_shards(pool: Pool, current: int | None) -> int:
    """Shards to run now: the spec's count, or with scaling the running count kept within bounds."""
    assert pool.redis is not None
    if pool.scaling is None:
        return pool.redis.replicas
    return clamp(current if current is not None else pool.redis.replicas, pool.scaling)


def shards_to_publish(published: int | None, desired: int, ready: int) -> int:
    """How many shard URLs the sidecars should use: shrink at once, grow once the new shards are ready."""
    if published is None or desired <= published or ready >= desired:
        return desired
    return published


def undrained(stats: list[dict[str, Any]], expected: int, shards: int) -> str:
    """Why the sidecars are not all known to use at most `shards` shards ("" when they are): all
    `expected` must answer (they re-read the shard list from a ConfigMap file the kubelet refreshes a
    minute or more after it changes)."""
    using = [((s.get("tiers") or {}).get("redis") or {}).get("shards") for s in stats]
    silent = max(0, expected - len(using))
    behind = sum(1 for n in using if not (isinstance(n, int) and n <= shards))
    why = [f"{silent} of {expected} sidecar(s) did not answer"] if silent else []
    why += [f"{behind} sidecar(s) still use more than {shards} shard(s)"] if behind else []
    return "; ".join(why)


async def publish(kube: Kube, pool: Pool, count: int) -> None:
    """Tells the pool's sidecars the first `count` shards (the ConfigMap key they re-read)."""
    text = objects.redis_urls_text(objects.shard_urls(pool, count))
    await kube.patch(
        "ConfigMap", pool.namespace, names.config_map_name(pool.name), {"data": {names.REDIS_URLS_KEY: text}}
    )


async def _published(kube: Kube, pool: Pool) -> int | None:
    cm = await kube.get("ConfigMap", pool.namespace, names.config_map_name(pool.name))
    return objects.published_shards(cm)


async def _unpublish(kube: Kube, pool: Pool, published: int | None, keep: int) -> int:
    """The first step of a shrink: the sidecars are told at most `keep` shards before any beyond them
    stops (None, nothing published: they are told `keep`). Returns what they are told now."""
    if published is None or published > keep:
        await publish(kube, pool, keep)
        return keep
    return published


async def start(kube: Kube, pool: Pool, owner: Mapping[str, Any]) -> list[str]:
    """Runs the tier (its Service and StatefulSet; credentials.py makes its Secret) and returns the
    shard URLs the sidecars are to be told. It never stops a shard: a smaller count is unpublished
    here, and the StatefulSet shrunk by `scale` once every sidecar has stopped using the shards that go."""
    ns, name = pool.namespace, names.redis_name(pool.name)
    await kube.ensure("Service", ns, objects.redis_service(pool, owner))
    sts = await kube.get("StatefulSet", ns, name)
    current = (sts or {}).get("spec", {}).get("replicas")
    desired = initial_shards(pool, current)
    published = await _published(kube, pool)
    if published is not None:  # else no ConfigMap yet: the caller writes it with these URLs
        published = await _unpublish(kube, pool, published, desired)
    replicas = max(desired, current or 0)
    sts = await kube.ensure("StatefulSet", ns, objects.redis_statefulset(pool, owner, replicas))
    ready = int((sts.get("status") or {}).get("readyReplicas") or 0)
    count = shards_to_publish(published, desired, ready)
    return objects.shard_urls(pool, count)


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
    annotations = sts["metadata"].get("annotations") or {}
    last = annotations.get(names.LAST_SCALE_ANNOTATION)
    result: dict[str, Any] = {"lastScaleTime": last} if last else {}
    if gave_up := annotations.get(names.DRAIN_GAVE_UP_ANNOTATION):
        result["drainGaveUp"] = gave_up

    desired = pool.redis.replicas
    why = ""
    if pool.scaling is not None:
        utilization = await memo.memory_source(pool, await _ready_shard_pods(kube, pool))
        if utilization is not None:  # shown, never acted on: an LRU cache is always full
            result["memoryUtilization"] = round(utilization)
        shared = working_set.shared_bytes(sidecars, expected)
        if shared is not None:
            result["workingSetBytes"] = shared
        demand, shard = demand_bytes(pool, counts.ready, shared), shard_maxmemory(pool)
        result["demandBytes"] = demand
        since = (now - datetime.datetime.fromisoformat(last)).total_seconds() if last else None
        desired = desired_shards(running, demand, shard, pool.scaling, since, settings.scale_cooldown)
        percent = pool.scaling.capacity_percent
        why = f" ({counts.ready} pods x {pool.capacity} x {percent}%, {shard} bytes a shard)"
        if demand < demand_bytes(pool, counts.ready):
            why = f" (what the {counts.ready} pods share: {shared} bytes + 25%, {shard} bytes a shard)"

    published = await _published(kube, pool)
    gave_up = None
    if desired >= running and names.DRAIN_SINCE_ANNOTATION in annotations:  # the shrink is off
        await kube.patch("StatefulSet", ns, name, {"metadata": {"annotations": {
            names.DRAIN_SINCE_ANNOTATION: None}}})  # fmt: skip
    if desired < running:
        published = await _unpublish(kube, pool, published, desired)
        if pending := undrained(sidecars, expected, desired):
            since = annotations.get(names.DRAIN_SINCE_ANNOTATION)
            if since is None:
                await kube.patch("StatefulSet", ns, name, {"metadata": {"annotations": {
                    names.DRAIN_SINCE_ANNOTATION: _stamp(now)}}})  # fmt: skip
            waited = (now - datetime.datetime.fromisoformat(since)).total_seconds() if since else 0.0
            if waited < settings.drain_timeout:
                result.update(replicas=running, readyReplicas=ready, publishedShards=published, draining=True)
                result["drainingSince"] = since or _stamp(now)
                return result
            # Bounded: a sidecar that never answers must not hold the tier at its size for ever. Its
            # reads of the stopped shards fail and become misses; the pool's status says so.
            gave_up = f"stopped {running - desired} shard(s) after {waited:.0f} s of draining: {pending}"
            await events.post(kube, pool, "Warning", "DrainGaveUp", gave_up)
    if desired != running:
        stamp = _stamp(now)
        change = {
            "metadata": {"annotations": {
                names.LAST_SCALE_ANNOTATION: stamp,
                names.DRAIN_SINCE_ANNOTATION: None,  # the next shrink waits afresh
                names.DRAIN_GAVE_UP_ANNOTATION: gave_up,  # said until the next change
            }},
            "spec": {"replicas": desired},
        }  # fmt: skip
        await kube.patch("StatefulSet", ns, name, change)
        result["lastScaleTime"] = stamp
        result.pop("drainGaveUp", None)
        if gave_up:
            result["drainGaveUp"] = gave_up
        await events.post(
            kube, pool, "Normal", "Scaled", f"shared Redis tier {running} -> {desired} shards{why}"
        )
    count = shards_to_publish(published, desired, ready)
    if count != published:
        await publish(kube, pool, count)
    result.update(replicas=desired, readyReplicas=ready, publishedShards=count)
    return result


def _stamp(now: datetime.datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")


async def _ready_shard_pods(kube: Kube, pool: Pool) -> list[dict[str, Any]]:
    found = await kube.list_pods(pool.namespace, {"matchLabels": objects.redis_selector(pool)})
    return [p for p in found if pods.is_ready(p)]
