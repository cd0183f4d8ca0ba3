"""What the operator reads from a pool's pods: counts for status, and the sidecars' /stats."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvpool_operator import names


@dataclass(frozen=True)
class PodCounts:
    matched: int  # selected by the pool and not opted out
    ready: int  # injected by this pool and Ready
    outdated: int  # matched, not skipped, but not running the pool's current connector config
    injected: int = 0  # carrying this pool's cache
    skipped: int = 0  # admitted without the cache, for a reason each pod's annotation gives
    skip_reasons: dict[str, int] = field(default_factory=dict)


def opted_out(pod: Mapping[str, Any]) -> bool:
    """`kvpool.dev/inject: "false"` as an annotation, or as the label the webhook's objectSelector skips."""
    meta = pod.get("metadata") or {}
    return (meta.get("annotations") or {}).get(names.INJECT_ANNOTATION) == "false" or (
        meta.get("labels") or {}
    ).get(names.INJECT_ANNOTATION) == "false"


# what the kubelet reports for a container that will not start without someone changing something
STUCK_REASONS = frozenset({
    "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CrashLoopBackOff",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
})  # fmt: skip


def sidecar_stuck(pod: Mapping[str, Any]) -> str | None:
    """`Reason: message` when the pod's kvpool sidecar, or the init container that copies the connector
    from the same image, waits for good (the image does not pull, it crashes at start): either holds
    vLLM back, since vLLM starts after both."""
    status = pod.get("status") or {}
    ours = (names.SIDECAR_CONTAINER, names.CONNECTOR_CONTAINER)
    for c in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (c.get("state") or {}).get("waiting") or {}
        if c.get("name") in ours and waiting.get("reason") in STUCK_REASONS:
            return f"{waiting['reason']}: {waiting.get('message') or ''}".strip().rstrip(":")
    return None


def sidecar_image(pod: Mapping[str, Any]) -> str | None:
    spec = pod.get("spec") or {}
    for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        if c.get("name") == names.SIDECAR_CONTAINER:
            return c.get("image")
    return None


def not_starting(pool_object: Mapping[str, Any]) -> str | None:
    """The pool's open sidecar breaker (status.sidecarNotStarting), while its spec is unchanged."""
    found = (pool_object.get("status") or {}).get("sidecarNotStarting") or {}
    generation = (pool_object.get("metadata") or {}).get("generation")
    if found and found.get("observedGeneration") == generation:
        return str(found.get("reason") or "the sidecar does not start")
    return None


def injected_by(pod: Mapping[str, Any], pool_name: str) -> bool:
    return (pod.get("metadata", {}).get("labels") or {}).get(names.POOL_LABEL) == pool_name


def is_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def count(pods: Iterable[Mapping[str, Any]], pool_name: str, current_hash: str) -> PodCounts:
    live = [p for p in pods if not opted_out(p) and not p.get("metadata", {}).get("deletionTimestamp")]
    injected = [p for p in live if injected_by(p, pool_name)]
    ready = [p for p in injected if is_ready(p)]
    skipped = {i: r for i, p in enumerate(live) if (r := skip_reason(p)) is not None}
    reasons = Counter(skipped.values())
    outdated = [
        p
        for i, p in enumerate(live)
        if i not in skipped
        and (p["metadata"].get("annotations") or {}).get(names.CONFIG_HASH_ANNOTATION) != current_hash
    ]
    return PodCounts(
        matched=len(live),
        ready=len(ready),
        outdated=len(outdated),
        injected=len(injected),
        skipped=len(skipped),
        skip_reasons=dict(sorted(reasons.items())),
    )


def skip_reason(pod: Mapping[str, Any]) -> str | None:
    """The reason a pod was admitted without the cache (its kvpool.dev/skipped annotation's first word)."""
    text = (pod.get("metadata", {}).get("annotations") or {}).get(names.SKIPPED_ANNOTATION)
    return text.split(":", 1)[0] if text else None


def stats_url(pod: Mapping[str, Any]) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    port = (pod.get("metadata", {}).get("annotations") or {}).get(names.STATUS_PORT_ANNOTATION)
    return f"http://{ip}:{port}/stats" if ip and port else None


async def scrape(urls: Iterable[str], timeout: float) -> list[dict[str, Any]]:
    """The /stats of each sidecar that answers in time; the others are left out (a cache may be down)."""

    async def one(session: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
        try:
            async with session.get(url) as rsp:
                return await rsp.json() if rsp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        found = await asyncio.gather(*(one(session, u) for u in urls))
    return [s for s in found if isinstance(s, dict)]


def aggregate(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The pool's status.stats: sums, and the hit rate over all lookups of all sidecars."""

    def total(key: str) -> int:
        return sum(int(s.get(key) or 0) for s in stats)

    hits, misses = total("hits"), total("misses")
    return {
        "sidecars": len(stats),
        "hits": hits,
        "misses": misses,
        "hitRate": round(hits / (hits + misses), 4) if hits + misses else 0.0,
        "storedBytes": total("stored_bytes"),
        "capacityBytes": total("capacity_bytes"),
        "evictions": total("evictions"),
    }
