"""What the operator reads from a pool's pods: counts for status, and the sidecars' /stats."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvpool_operator import names


@dataclass(frozen=True)
class PodCounts:
    matched: int  # selected by the pool and not opted out
    ready: int  # injected by this pool and Ready
    outdated: int  # matched, not skipped, but not carrying what the pool would inject now
    injected: int = 0  # carrying this pool's cache
    skipped: int = 0  # admitted without the cache, for a reason each pod's annotation gives
    skip_reasons: dict[str, int] = field(default_factory=dict)
    # matched pods the webhook never saw (neither injected nor skipped), by name: their namespace is not
    # labelled for injection, or they were created while the webhook was down
    unseen: list[str] = field(default_factory=list)
    skipped_example: str = ""  # one skipped pod and its annotation, for messages


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


def count(
    pods: Iterable[Mapping[str, Any]], pool_name: str, outdated: Callable[[Mapping[str, Any]], bool]
) -> PodCounts:
    """The pool's pod counts; `outdated` tells whether an injected pod differs from what the pool would
    inject now (a pod the webhook never saw counts outdated too: a restart may bring it the cache)."""
    live = [p for p in pods if not opted_out(p) and not p.get("metadata", {}).get("deletionTimestamp")]
    injected = [p for p in live if injected_by(p, pool_name)]
    ready = [p for p in injected if is_ready(p)]
    skipped = {i: r for i, p in enumerate(live) if (r := skip_reason(p)) is not None}
    reasons = Counter(skipped.values())
    unseen = {
        i
        for i, p in enumerate(live)
        if i not in skipped and names.CONFIG_HASH_ANNOTATION not in (p["metadata"].get("annotations") or {})
    }
    stale = [p for i, p in enumerate(live) if i not in skipped and i not in unseen and outdated(p)]
    example = next((live[i] for i in skipped), None)
    return PodCounts(
        matched=len(live),
        ready=len(ready),
        outdated=len(stale) + len(unseen),
        injected=len(injected),
        skipped=len(skipped),
        skip_reasons=dict(sorted(reasons.items())),
        unseen=sorted(str(live[i]["metadata"].get("name")) for i in unseen),
        skipped_example=(
            f"pod {example['metadata'].get('name')}: "
            f"{example['metadata']['annotations'][names.SKIPPED_ANNOTATION]}"
            if example is not None
            else ""
        ),
    )


def skip_reason(pod: Mapping[str, Any]) -> str | None:
    """The reason a pod was admitted without the cache (its kvpool.dev/skipped annotation's first word)."""
    text = (pod.get("metadata", {}).get("annotations") or {}).get(names.SKIPPED_ANNOTATION)
    return text.split(":", 1)[0] if text else None


def stats_url(pod: Mapping[str, Any]) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    port = (pod.get("metadata", {}).get("annotations") or {}).get(names.STATUS_PORT_ANNOTATION)
    return f"http://{ip}:{port}/stats" if ip and port else None


async def scrape(urls: Iterable[str], timeout: float) -> list[dict[str, Any] | None]:
    """The /stats of each sidecar, in the order of `urls`; None for one that did not answer in time."""

    async def one(session: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
        try:
            async with session.get(url) as rsp:
                return await rsp.json() if rsp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        found = await asyncio.gather(*(one(session, u) for u in urls))
    return [s if isinstance(s, dict) else None for s in found]


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
        **miss_ratio_curve(stats),
    }


def miss_ratio_curve(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """status.stats' hitRateAt ("0.25x" .. "4x": the pool's hit rate were every sidecar that multiple of
    its capacity) and hitRateCeiling (an unbounded tier): each sidecar's online estimate (its /stats
    miss_ratio), weighted by its lookups. Sidecars without one (older images) or with a malformed one
    are left out; none at all: nothing said."""
    curves: list[tuple[dict[str, float], float, int]] = []
    for s in stats:
        try:
            m = s["miss_ratio"]
            at = {f"{float(p['scale']):g}x": float(p["hit_rate"]) for p in m["curve"]}
            curves.append(
                (at, float(m["ceiling_hit_rate"]), int(s.get("hits") or 0) + int(s.get("misses") or 0))
            )
        except (KeyError, TypeError, ValueError):
            continue
    weight = sum(w for _, _, w in curves)
    if not weight:
        return {}
    scales = sorted({k for at, _, _ in curves for k in at}, key=lambda k: float(k[:-1]))
    return {
        "hitRateAt": {k: round(sum(at.get(k, 0.0) * w for at, _, w in curves) / weight, 4) for k in scales},
        "hitRateCeiling": round(sum(c * w for _, c, w in curves) / weight, 4),
    }
