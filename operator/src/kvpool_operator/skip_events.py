"""`PodNotInjected` events that scale: one Event per (pool, reason, owner) with a count, as client-go's
EventCorrelator keeps them, so 100 skipped replicas are one line "x100" in `kubectl describe kvp`.

The Event's name is derived from (pool, reason, owner), so every webhook call and every operator
replica finds the same object: a GET, then a merge patch of `count` and `lastTimestamp` guarded by
the read resourceVersion (a 409 means another writer got there first: read again), or a create on
404 (a 409 there means another writer created it: read again). In one process the skips of a key are
summed while a write is under way and written together, so a burst of pods costs a few writes.
Writers that conflict back off for a random while, so they fall out of step. Counts are exact unless
a write gives up (`ATTEMPTS` conflicts in a row, or the API failing), when that write's skips are
logged and dropped: under such races the count runs low, never high, and no event is lost.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpool_operator import events
from kvpool_operator.kube import MESSAGE_LIMIT, ApiError, Kube, event_body
from kvpool_operator.pool import Pool
from kvpool_operator.vllm_target import Skip

REASON = "PodNotInjected"
ATTEMPTS = 8  # conflicting writers in a row before a write gives up
BACKOFF_S = 0.01  # after a conflict, a random wait up to this, doubled each time: writers fall out of step
log = logging.getLogger("kvpool.events")


def owner_of(pod: Mapping[str, Any]) -> str:
    """`Kind/name` of what made the pod (its controller, else its first owner); a bare pod is its own."""
    meta = pod.get("metadata") or {}
    refs = meta.get("ownerReferences") or []
    ref = next((r for r in refs if r.get("controller")), refs[0] if refs else None)
    if ref is not None:
        return f"{ref.get('kind', '?')}/{ref.get('name', '?')}"
    return f"Pod/{pod_name(pod)}"


def pod_name(pod: Mapping[str, Any]) -> str:
    """The pod's name; at admission a controller's pod has only its generateName (`vllm-7d9f8-`)."""
    meta = pod.get("metadata") or {}
    return str(meta.get("name") or meta.get("generateName") or "?")


def event_name(pool: Pool, reason: str, owner: str) -> str:
    digest = hashlib.sha256(f"{reason}\0{owner}".encode()).hexdigest()[:16]
    return f"{pool.name[:200]}.{digest}"


@dataclass
class _Tally:
    pool: Pool
    reason: str
    owner: str
    message: str = ""
    pending: int = 0  # skips recorded and not yet written


class SkipEvents:
    """Records skips as they are decided (no I/O) and writes them in the background, one writer per key."""

    def __init__(self, kube: Kube) -> None:
        self._kube = kube
        self._tallies: dict[tuple[str, str, str], _Tally] = {}
        self._writers: dict[tuple[str, str, str], asyncio.Task[None]] = {}

    def record(self, pool: Pool, skip: Skip, pod: Mapping[str, Any]) -> asyncio.Task[None] | None:
        """Counts one skipped pod; returns the writer it started (None: one is running and takes it)."""
        owner = owner_of(pod)
        key = (pool.key, skip.reason, owner)
        tally = self._tallies.setdefault(key, _Tally(pool, skip.reason, owner))
        tally.pool = pool
        tally.pending += 1
        named = pod_name(pod)
        of = "" if owner == f"Pod/{named}" else f" of {owner}"
        tally.message = f"pod {named}{of}: {skip.reason}: {skip.message}"
        if key in self._writers:
            return None
        task = asyncio.get_running_loop().create_task(self._write(key))
        self._writers[key] = task
        return task

    async def _write(self, key: tuple[str, str, str]) -> None:
        tally = self._tallies[key]
        try:
            while tally.pending:
                count, tally.pending = tally.pending, 0
                try:
                    await add_to_event(self._kube, tally, count)
                except Exception as e:  # an event is information, never a reason to fail
                    log.warning("could not count %d %s event(s) for %s: %s", count, REASON, tally.pool.key, e)
        finally:
            del self._writers[key]
            if not tally.pending:
                del self._tallies[key]


async def add_to_event(kube: Kube, tally: _Tally, count: int) -> None:
    """Adds `count` to the key's Event, creating it if it is gone (never made, or expired)."""
    ref = events.pool_ref(tally.pool)
    namespace = tally.pool.namespace
    name = event_name(tally.pool, tally.reason, tally.owner)
    for attempt in range(ATTEMPTS):
        if attempt:
            await asyncio.sleep(random.uniform(0, BACKOFF_S * 2**attempt))
        now = _now()
        existing = await kube.get("Event", namespace, name)
        try:
            if existing is None:
                body = event_body(ref, "Warning", REASON, tally.message, name=name, count=count, now=now)
                await kube.create("Event", namespace, body)
            else:
                patch = {
                    # the version read: the API server refuses the patch (409) if another wrote since
                    "metadata": {"resourceVersion": (existing.get("metadata") or {}).get("resourceVersion")},
                    "count": int(existing.get("count") or 1) + count,
                    "lastTimestamp": now,
                    "message": tally.message[:MESSAGE_LIMIT],
                }
                await kube.patch("Event", namespace, name, patch)
            return
        except ApiError as e:
            if e.status not in (404, 409):  # 409: another writer first; 404: expired meanwhile
                raise
    raise ApiError(409, f"event {namespace}/{name}: still conflicting after {ATTEMPTS} attempts")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")
