"""The sidecar's statistics, each declared once (its /stats key, its Prometheus type, its help), and the
Prometheus text exposition of them (names prefixed kvpool_). /stats takes its fields through fields()
and /metrics renders them through render(), both from the declarations below, so a number cannot be
in one without the other, and its type is said, not guessed: a value that can go down is a gauge."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Stat:
    key: str  # the field of /stats
    kind: Literal["counter", "gauge"]  # counter: only ever goes up (from 0 at start); gauge: anything
    help: str

    def metric(self, prefix: str) -> str:
        return f"{prefix}{self.key}_total" if self.kind == "counter" else f"{prefix}{self.key}"


def counter(key: str, help_: str) -> Stat:
    return Stat(key, "counter", help_)


def gauge(key: str, help_: str) -> Stat:
    return Stat(key, "gauge", help_)


PREFIX = "kvpool_"
# /stats' top level: the index and its CPU tier (ChunkIndex.snapshot), and the hit rate
STATS = (
    counter("hits", "Chunks found by lookups and GETs"),
    counter("misses", "Chunks asked for and not found"),
    gauge("hit_rate", "hits / (hits + misses) since start"),
    gauge("stored_bytes", "Bytes of chunks in the CPU tier"),
    gauge("capacity_bytes", "CPU tier capacity (the arena size)"),
    gauge("chunks", "Chunks in the CPU tier"),
    counter("evictions", "Chunks evicted from the CPU tier to make room"),
    counter("bytes_in", "Bytes saved into the CPU tier"),
    counter("bytes_out", "Bytes handed out for loading"),
    counter("corrupt_dropped", "Chunks failing their checksum: dropped"),
    counter("reservations_expired", "Reservations left uncommitted"),
    counter("leases_expired", "Pin leases never released in time"),
    counter("promotions", "Chunks loaded from Redis into the CPU tier"),
    counter("refused_commits", "Commits of a reservation that was no longer the writer's"),
    counter("arena_reinitialised", "Arena headers changed behind the sidecar: chunks dropped, new epoch"),
    counter("adopted", "Chunks found whole in the arena at start (a restarted sidecar) and served again"),
    counter("adoption_refused", "Chunks the arena's journal named whose bytes no longer match: not adopted"),
    gauge("reserved_chunks", "Chunks reserved and not yet committed"),
    gauge("pinned_leases", "Pin leases held (chunks being loaded)"),
    gauge("free_bytes", "Bytes of the arena not stored or reserved"),
)
# /stats' tiers.cpu: the same numbers as the top level's fields of these names (rendered there once)
CPU_TIER_KEYS = ("stored_bytes", "capacity_bytes", "chunks", "evictions", "free_bytes")

REDIS_PREFIX = "kvpool_redis_"
# /stats' tiers.redis (RedisTier.stats); its "reason" is text, not a number: /stats only
REDIS_STATS = (
    gauge("ready", "Redis tier: 1 when every shard is up"),
    gauge("shards", "Redis tier: shards configured"),
    gauge("shards_up", "Redis tier: shards reachable"),
    gauge("queued", "Redis tier: writes waiting in the write-behind queue"),
    gauge("queued_bytes", "Redis tier: bytes waiting in the write-behind queue"),
    counter("written", "Redis tier: chunks written behind"),
    counter("dropped", "Redis tier: saves not written behind (queue full, shard down, evicted first)"),
    counter("write_errors", "Redis tier: writes that failed"),
    counter("bytes_written", "Redis tier: bytes written behind"),
    counter("hits", "Redis tier: chunks found in Redis"),
    counter("misses", "Redis tier: chunks asked of Redis and not found"),
    counter("read_errors", "Redis tier: reads that failed"),
    counter("auth_failures", "Redis tier: chunks whose MAC failed (never promoted, deleted)"),
    gauge("authenticated", "Redis tier: 1 when chunks carry a MAC (a pool key is set)"),
    counter("bytes_read", "Redis tier: bytes read from Redis"),
    counter("hot_reported", "Redis tier: chunk loads counted into the pool's hot set"),
    gauge("prewarmed", "Redis tier: chunks pre-warmed into the CPU tier at start"),
    gauge("prewarmed_bytes", "Redis tier: bytes pre-warmed into the CPU tier at start"),
)
REDIS_TEXT_KEYS = ("reason", "prewarm")

MISS_RATIO_PREFIX = "kvpool_miss_ratio_"
# /stats' miss_ratio (MissRatioCurve.snapshot); its "curve", a list of points, is one labelled family
MISS_RATIO_STATS = (
    gauge("ceiling_hit_rate", "Estimated hit rate of an unbounded CPU tier: chunks saved before"),
    gauge("sampling_rate", "Share of chunk keys the miss-ratio curve follows (SHARDS sampling)"),
    counter("sampled_lookups", "Chunk lookups the miss-ratio curve followed"),
)
WORKING_SET_PREFIX = "kvpool_working_set_"
# /stats' working_set (WorkingSet.snapshot); its "sketch" (HyperLogLog registers, base64) is for merging
WORKING_SET_STATS = (
    gauge("chunks", "Distinct chunks looked up in the last one to two windows (HyperLogLog estimate)"),
    gauge("window_seconds", "The working set's window"),
)
CURVE = Stat(
    "hit_rate", "gauge", "Estimated CPU-tier hit rate at `scale` times its capacity (`capacity_bytes`)"
)


def fields(stats: tuple[Stat, ...], values: Mapping[str, Any], text: tuple[str, ...] = ()) -> dict[str, Any]:
    """The /stats fields of `stats` (and the `text` ones), in declaration order, from `values`, which
    must hold exactly those: a number produced without a declaration is a bug, not a silent omission."""
    keys = [s.key for s in stats] + list(text)
    if set(values) != set(keys):
        raise AssertionError(f"undeclared or missing stats: {sorted(set(values) ^ set(keys))}")
    return {k: values[k] for k in keys}


def _lines(name: str, kind: str, help_: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {float(value)!r}"]


def _render(stats: tuple[Stat, ...], prefix: str, values: Mapping[str, Any]) -> list[str]:
    lines: list[str] = []
    for s in stats:
        if isinstance(values.get(s.key), bool | int | float):  # a tier not configured has fewer
            lines += _lines(s.metric(prefix), s.kind, s.help, values[s.key])
    return lines


def render(stats: dict, ready: bool) -> str:
    lines = _render(STATS, PREFIX, stats)
    lines += _lines(f"{PREFIX}ready", "gauge", "1 when every tier is usable", 1 if ready else 0)
    lines += _render(REDIS_STATS, REDIS_PREFIX, stats.get("tiers", {}).get("redis") or {})
    lines += _render(WORKING_SET_STATS, WORKING_SET_PREFIX, stats.get("working_set") or {})
    if curve := stats.get("miss_ratio"):
        lines += _render(MISS_RATIO_STATS, MISS_RATIO_PREFIX, curve)
        name = CURVE.metric(MISS_RATIO_PREFIX)
        lines += [f"# HELP {name} {CURVE.help}", f"# TYPE {name} {CURVE.kind}"]
        for p in curve["curve"]:
            labels = f'scale="{p["scale"]:g}",capacity_bytes="{p["capacity_bytes"]}"'
            lines.append(f"{name}{{{labels}}} {float(p['hit_rate'])!r}")
    return "\n".join(lines) + "\n"
