"""The operator's Prometheus metrics (names prefixed kvpool_operator_), served on --metrics by every
replica: what it reconciled, what its webhook decided and how fast, the pods it let through without
the cache because of its own failure (fail open), the sidecars it could not scrape, and each pool's
readiness and shared-tier shards as its last refresh saw them (only the leading replica refreshes,
so only it has the per-pool series; a replica that stops leading drops them).

Its own registry, so that what it serves is exactly what is declared here (and the process's own
numbers), and tests can list the names.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from kvpool_operator.readiness import serve_endpoint

PREFIX = "kvpool_operator_"
REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

RECONCILES = Counter(
    PREFIX + "reconciles",
    "Pool reconciles (create, update, resume) by outcome: Succeeded, a reason the pool was given up "
    "on (InvalidSpec, Refused), Retried (a transient API error) or Error (an exception)",
    ["outcome"],
    registry=REGISTRY,
)
REFRESHES = Counter(
    PREFIX + "refreshes",
    "Pool status refreshes by outcome: Succeeded or Error (retried next round)",
    ["outcome"],
    registry=REGISTRY,
)
WEBHOOK_DECISIONS = Counter(
    PREFIX + "webhook_decisions",
    "Pods the webhook answered, by reason: Injected, NotClaimed (no pool selects it), a reason it was "
    "admitted without the cache (HostNetwork, SeveralPools, ...), NotReady or Error",
    ["reason"],
    registry=REGISTRY,
)
WEBHOOK_DURATION = Histogram(
    PREFIX + "webhook_duration_seconds",
    "Time the webhook took to decide on a pod",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=REGISTRY,
)
FAIL_OPEN = Counter(
    PREFIX + "webhook_fail_open",
    "Pods admitted without the cache because of the operator's own failure, by reason: Error (the "
    "webhook failed), NotReady (the pools not read yet), LimitsUnreadable (the namespace's "
    "LimitRanges/ResourceQuotas could not be read)",
    ["reason"],
    registry=REGISTRY,
)


def _per_pool(kind: type[Counter] | type[Gauge], name: str, doc: str) -> Any:
    return kind(PREFIX + name, doc, ["namespace", "pool"], registry=REGISTRY)


SCRAPES = _per_pool(Counter, "sidecar_scrapes", "Sidecar /stats reads by the pool refresh")
SCRAPE_FAILURES = _per_pool(
    Counter,
    "sidecar_scrape_failures",
    "Sidecar /stats reads that failed (no answer in time, not 200, not JSON)",
)
POOL_READY = _per_pool(Gauge, "pool_ready", "1 when the pool's Ready condition is True")
SHARDS_DESIRED = _per_pool(Gauge, "pool_shards_desired", "Shards the pool's shared Redis tier should run")
SHARDS_READY = _per_pool(Gauge, "pool_shards_ready", "Shards of the pool's shared Redis tier that are ready")
PER_POOL = (POOL_READY, SHARDS_DESIRED, SHARDS_READY)

# Skip reasons that are the operator's failure, not the pod's or the pool's: counted as fail open
OPERATOR_FAILURES = frozenset({"Error", "NotReady", "LimitsUnreadable"})
for _reason in sorted(OPERATOR_FAILURES):  # at 0 from the start: the first failure is an increase
    FAIL_OPEN.labels(reason=_reason)
log = logging.getLogger("kvpool.metrics")


def webhook_decided(reason: str, seconds: float) -> None:
    WEBHOOK_DECISIONS.labels(reason=reason).inc()
    WEBHOOK_DURATION.observe(seconds)
    if reason in OPERATOR_FAILURES:
        FAIL_OPEN.labels(reason=reason).inc()


def pool_refreshed(
    namespace: str, pool: str, ready: bool, scraped: int, failed: int, tier: tuple[int, int] | None
) -> None:
    """One pool's refresh: its readiness, its sidecar reads, its shards (desired, ready) if shared."""
    POOL_READY.labels(namespace, pool).set(1 if ready else 0)
    SCRAPES.labels(namespace, pool).inc(scraped)
    SCRAPE_FAILURES.labels(namespace, pool).inc(failed)
    if tier is not None:
        SHARDS_DESIRED.labels(namespace, pool).set(tier[0])
        SHARDS_READY.labels(namespace, pool).set(tier[1])


def keep_pools(pools: Iterable[tuple[str, str]]) -> None:
    """Drops the per-pool gauges of every pool not in `pools` (deleted, or refreshed by another
    replica now): a stale 1 would hide a pool that is not ready, a stale 0 would alert for ever."""
    keep = set(pools)
    for gauge in PER_POOL:
        for labels in [k for k in _label_sets(gauge) if k not in keep]:
            gauge.remove(*labels)


def _label_sets(gauge: Gauge) -> list[tuple[str, str]]:
    return [(s.labels["namespace"], s.labels["pool"]) for family in gauge.collect() for s in family.samples]


def names() -> set[str]:
    """Every sample name the operator can serve (counters with _total, histograms' series)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    found: set[str] = set()
    for family in REGISTRY.collect():
        found.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return found


async def serve(endpoint: str) -> web.AppRunner | None:
    """Serves the registry at http://host:port/path (a wildcard host: every address of both
    families). A port that cannot be bound is logged, not fatal: the webhook matters more."""

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    try:
        return await serve_endpoint(endpoint, metrics, default_path="/metrics")
    except OSError as e:
        log.error("cannot serve metrics on %s (%s); running without them", endpoint, e)
        return None
