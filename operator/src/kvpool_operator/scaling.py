"""Shard count of a pool's shared Redis tier: the decision (pure), and Redis's own memory figures.

Sidecars place keys on shards by rendezvous hashing, so a changed shard count moves about 1/N of
the keys (they become misses, never errors). New shards are published to the sidecars only once
they are ready; removed shards are unpublished before they stop.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any

from kvpool_operator.names import MONITOR_USER, REDIS_PORT
from kvpool_operator.pool import Pool, ScalingSpec

TOLERANCE = 0.1  # no change while utilization is within 10% of the target (as the HPA does)

# (pool, its ready shard pods, the Redis password) -> mean memory utilization in percent, or None
MemorySource = Callable[[Pool, list[dict[str, Any]]], Awaitable[float | None]]


def clamp(n: int, scaling: ScalingSpec) -> int:
    return max(scaling.min_replicas, min(scaling.max_replicas, n))


def desired_shards(
    current: int,
    utilization: float | None,
    scaling: ScalingSpec,
    since_last_change: float | None,
    cooldown: float,
) -> int:
    """The shard count: proportional to utilization/target, within bounds, one change a cooldown.

    A count outside [minReplicas, maxReplicas] (the bounds changed) is corrected at once.
    """
    bounded = clamp(current, scaling)
    if bounded != current:
        return bounded
    if utilization is None:
        return current
    ratio = utilization / scaling.target_utilization
    if abs(ratio - 1.0) <= TOLERANCE:
        return current
    wanted = clamp(max(1, math.ceil(current * ratio)), scaling)
    if wanted != current and since_last_change is not None and since_last_change < cooldown:
        return current
    return wanted


def shards_to_publish(published: int | None, desired: int, ready: int) -> int:
    """How many shard URLs the sidecars should use: shrink at once, grow once the new shards are ready."""
    if published is None or desired <= published or ready >= desired:
        return desired
    return published


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
