"""Prometheus text exposition of the sidecar's stats (names prefixed kvpool_)."""

from __future__ import annotations

# stats key -> (metric name, type, help)
_METRICS = {
    "hits": ("kvpool_hits_total", "counter", "Chunks found by lookups and GETs"),
    "misses": ("kvpool_misses_total", "counter", "Chunks asked for and not found"),
    "hit_rate": ("kvpool_hit_rate", "gauge", "hits / (hits + misses) since start"),
    "stored_bytes": ("kvpool_stored_bytes", "gauge", "Bytes of chunks in the CPU tier"),
    "capacity_bytes": ("kvpool_capacity_bytes", "gauge", "CPU tier capacity (the arena size)"),
    "chunks": ("kvpool_chunks", "gauge", "Chunks in the CPU tier"),
    "evictions": ("kvpool_evictions_total", "counter", "Chunks evicted from the CPU tier to make room"),
    "bytes_in": ("kvpool_bytes_in_total", "counter", "Bytes saved into the CPU tier"),
    "bytes_out": ("kvpool_bytes_out_total", "counter", "Bytes handed out for loading"),
    "corrupt_dropped": ("kvpool_corrupt_dropped_total", "counter", "Chunks failing their checksum: dropped"),
    "reservations_expired": ("kvpool_reservations_expired_total", "counter", "Reservations left uncommitted"),
    "leases_expired": ("kvpool_leases_expired_total", "counter", "Pin leases never released in time"),
    "promotions": ("kvpool_promotions_total", "counter", "Chunks loaded from Redis into the CPU tier"),
}  # fmt: skip


def _lines(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> list[str]:
    out = [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
    out += [f"{name}{labels} {float(value)!r}" for labels, value in samples]
    return out


def render(stats: dict, ready: bool) -> str:
    lines: list[str] = []
    for key, (name, kind, help_) in _METRICS.items():
        if key in stats:
            lines += _lines(name, kind, help_, [("", stats[key])])
    lines += _lines("kvpool_ready", "gauge", "1 when every tier is usable", [("", 1 if ready else 0)])
    redis = stats.get("tiers", {}).get("redis")
    if redis:
        for key, value in redis.items():
            if isinstance(value, bool | int | float):
                kind = "gauge" if key in ("ready", "shards", "queued") else "counter"
                suffix = "" if kind == "gauge" else "_total"
                lines += _lines(f"kvpool_redis_{key}{suffix}", kind, f"Redis tier: {key}", [("", value)])
    return "\n".join(lines) + "\n"
