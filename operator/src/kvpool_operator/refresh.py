"""One pool's refresh: count its pods, gather its sidecars' stats, scale its shared Redis tier, and
say what changed in its status (refresh_loop.py runs it for every pool every --stats-interval)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from kvpool_operator import (
    conditions,
    credentials,
    events,
    metrics,
    objects,
    pods,
    pool_health,
    shards,
    vllm_breaker,
)
from kvpool_operator.injection import sidecar_image
from kvpool_operator.kube import Kube
from kvpool_operator.outdated import outdated
from kvpool_operator.pool import Pool, parse_pool, problems
from kvpool_operator.state import OperatorState


async def refresh(body: Mapping[str, Any], memo: OperatorState) -> dict[str, Any]:
    """The pool's status fields that changed (none for a pool reconcile reports as unusable). API
    errors go to the caller: the next round tries again."""
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    status: Mapping[str, Any] = body.get("status") or {}
    namespace, name = meta.get("namespace") or "", meta.get("name") or ""
    kube = memo.kube
    settings = memo.settings
    try:
        pool = parse_pool(namespace, name, spec, meta.get("uid"))
    except ValueError:
        metrics.pool_refreshed(namespace, name, False, 0, 0, None)
        return {}  # reconcile reports it
    if problems(pool):
        metrics.pool_refreshed(namespace, name, False, 0, 0, None)
        return {}
    now = datetime.datetime.now(datetime.UTC)
    generation = meta.get("generation")
    await credentials.ensure(kube, pool, objects.owner_reference(body))  # one deleted is made again now
    found = await kube.list_pods(namespace, pool.selector)
    counts = pods.count(found, name, lambda p: outdated(p, pool, settings))
    urls = [u for p in found if pods.injected_by(p, name) and pods.is_ready(p) and (u := pods.stats_url(p))]
    each = await pods.scrape(urls, settings.scrape_timeout)
    scraped = [s for s in each if s is not None]
    stats = pods.aggregate(scraped)
    tier: tuple[int, int] | None = None
    shared: dict[str, Any] | None = None
    if pool.shared_tier:
        shared = await shards.scale(kube, pool, memo, now, counts, scraped, len(urls))
        tier = (shared["replicas"], shared["readyReplicas"])

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
        drain_gave_up=(shared or {}).get("drainGaveUp"),
        sidecar_breaker=breaker,
        vllm_breaker=failing,
    )
    ready, degraded = pool_health.assess(seen)
    metrics.pool_refreshed(namespace, name, ready.status, len(urls), len(urls) - len(scraped), tier)
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
    return {key: value for key, value in found_status.items() if status.get(key) != value}


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
