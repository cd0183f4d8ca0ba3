"""Shard count of a pool's shared Redis tier: the decision (pure), and Redis's own memory figures.

The tier is sized on demand: the arenas of the pool's ready pods together, times the pool's
capacityPercent, in shards of their maxmemory. (Memory use says nothing: an LRU cache sits at
maxmemory whether its chunks are wanted or not, so scaling on it only ever grew the tier.)

Sidecars place keys on shards by rendezvous hashing, so a changed shard count moves about 1/N of
the keys (they become misses, never errors). New shards are published to the sidecars only once
they are ready; a removed shard is unpublished first and stopped only once every sidecar has
stopped using it (shards.py, which applies the count).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any

from kvpool_operator.names import MONITOR_USER, REDIS_PORT
from kvpool_operator.pool import Pool, ScalingSpec

WORKING_SET_HEADROOM = 1.25  # the shared working set grows between refreshes; LRU needs slack
SHRINK_BAND = 0.9  # shrink only when the demand fits the smaller tier with 10% to spare (no flapping)

# (pool, its ready shard pods) -> mean memory utilization in percent, or None (for status only)
MemorySource = Callable[[Pool, list[dict[str, Any]]], Awaitable[float | None]]


def clamp(n: int, scaling: ScalingSpec) -> int:
    return max(scaling.min_replicas, min(scaling.max_replicas, n))


def demand_bytes(pool: Pool, ready_pods: int, shared: int | None = None) -> int:
    """What the pool's pods ask of the shared tier: their arenas together, times capacityPercent; with
    sizeBy workingSet and the `shared` bytes known, what they share with headroom, if less."""
    assert pool.scaling is not None
    arenas = ready_pods * pool.capacity_bytes * pool.scaling.capacity_percent // 100
    if pool.scaling.size_by != "workingSet" or shared is None:
        return arenas
    return min(arenas, math.ceil(shared * WORKING_SET_HEADROOM))


def desired_shards(
    current: int,
    demand: int,
    shard_bytes: int,
    scaling: ScalingSpec,
    since_last_change: float | None,
    cooldown: float,
) -> int:
    """The shard count for `demand` bytes in shards of `shard_bytes`, within bounds. Up at once to what
    the demand needs, whenever it needs it (a tier too small turns hits into misses now); down one
    shard at a time, once the demand fits the smaller tier with a band to spare and a cooldown has
    passed since the last change (a shrink moves keys, and demand that dips often comes back). A
    count outside the bounds is corrected at once."""
    bounded = clamp(current, scaling)
    if bounded != current:
        return bounded
    needed = clamp(math.ceil(demand / shard_bytes), scaling)
    if needed > current:
        return needed
    if since_last_change is not None and since_last_change < cooldown:
        return current
    if clamp(math.ceil(demand / (shard_bytes * SHRINK_BAND)), scaling) < current:
        return current - 1
    return current


async def redis_memory_utilization(host: str, port: int, timeout: float) -> float | None:
    """used_memory / maxmemory in percent from `INFO memory` (RESP over a plain socket), asked as the
    shard's monitor user (names.MONITOR_USER); None if unknown."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError):
        return None
    try:
        writer.write(_command("AUTH", MONITOR_USER, "-"))  # nopass: any password
        writer.write(_command("INFO", "memory"))
        await writer.drain()
        if not (await asyncio.wait_for(reader.readline(), timeout)).startswith(b"+OK"):
            return None
        header = await asyncio.wait_for(reader.readline(), timeout)
        if not header.startswith(b"$"):
            return None
        body = await asyncio.wait_for(reader.readexactly(int(header[1:]) + 2), timeout)
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError):
        return None
    finally:
        writer.close()
    fields = dict(line.split(":", 1) for line in body.decode().splitlines() if ":" in line)
    used, limit = int(fields.get("used_memory", 0)), int(fields.get("maxmemory", 0))
    return 100.0 * used / limit if limit > 0 else None


def redis_info_source(timeout: float, port: int = REDIS_PORT) -> MemorySource:
    """The default source: INFO memory from each ready shard pod, averaged."""

    async def source(pool: Pool, shard_pods: list[dict[str, Any]]) -> float | None:
        ips = [p.get("status", {}).get("podIP") for p in shard_pods]
        values = await asyncio.gather(*(redis_memory_utilization(ip, port, timeout) for ip in ips if ip))
        known = [v for v in values if v is not None]
        return sum(known) / len(known) if known else None

    return source


def _command(*parts: str) -> bytes:
    out = [f"*{len(parts)}\r\n".encode()]
    for part in parts:
        raw = part.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(out)
