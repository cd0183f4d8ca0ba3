"""/metrics of a real sidecar process (with a real Redis shard) against its /stats: every number of /stats
is on /metrics with its declared Prometheus type, and what went down while the test ran (a lease
released, a shard lost, chunks evicted) is typed gauge, never counter."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from itertools import pairwise
from typing import Any

from kvtest import RedisServer, wait_until
from sidecar_support import key, load, payload, save

from kvpool_sidecar import metrics
from kvpool_sidecar.client import SidecarClient


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        return r.read()


def scrape(url: str) -> dict[str, tuple[str, float]]:
    """The Prometheus text, read as a scraper does: metric name -> (its # TYPE, its value)."""
    types: dict[str, str] = {}
    out: dict[str, tuple[str, float]] = {}
    for line in _get(url + "/metrics").decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif line and not line.startswith("#"):
            name, value = line.split(" ")
            assert name not in out, f"{name} twice"
            out[name] = (types[name.split("{")[0]], float(value))
    return out


def numbers(stats: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], float]]:
    """Every number of /stats (booleans as 0/1), with its path."""
    for k, v in stats.items():
        if isinstance(v, dict):
            yield from numbers(v, (*path, k))
        elif isinstance(v, bool | int | float):
            yield (*path, k), float(v)


def declared(path: tuple[str, ...]) -> tuple[str, str]:
    """The metric name and type the declarations give a /stats path."""
    if path[:2] == ("tiers", "redis"):
        stat = next(s for s in metrics.REDIS_STATS if s.key == path[2])
        return stat.metric(metrics.REDIS_PREFIX), stat.kind
    if path[0] == "miss_ratio":
        stat = next(s for s in metrics.MISS_RATIO_STATS if s.key == path[1])
        return stat.metric(metrics.MISS_RATIO_PREFIX), stat.kind
    if path[0] == "working_set":
        stat = next(s for s in metrics.WORKING_SET_STATS if s.key == path[1])
        return stat.metric(metrics.WORKING_SET_PREFIX), stat.kind
    if path[:2] == ("tiers", "cpu"):  # the top level's numbers of the same names
        path = path[2:]
    (name,) = path
    stat = next(s for s in metrics.STATS if s.key == name)
    return stat.metric(metrics.PREFIX), stat.kind


def stats_and_metrics(url: str) -> tuple[dict[str, Any], dict[str, tuple[str, float]]]:
    """/stats and /metrics of one moment: /stats read on both sides of /metrics, the same both times."""

    def settled() -> tuple[dict[str, Any], dict[str, tuple[str, float]]] | None:
        before = json.loads(_get(url + "/stats"))
        scraped = scrape(url)
        return (before, scraped) if json.loads(_get(url + "/stats")) == before else None

    got = wait_until(settled, 30, "/stats to hold still around a scrape")
    assert isinstance(got, tuple)
    return got


def check_every_number(url: str) -> dict[str, tuple[str, float]]:
    stats, scraped = stats_and_metrics(url)
    paths = [path for path, _ in numbers(stats)]
    assert {"hits", "hit_rate"} <= {p[0] for p in paths} and ("tiers", "redis", "shards") in paths
    for path, value in numbers(stats):
        name, kind = declared(path)
        assert name in scraped, f"/stats {'.'.join(path)} is not on /metrics as {name}"
        assert scraped[name] == (kind, value), ".".join(path)
        assert name.endswith("_total") == (kind == "counter"), name
    assert scraped["kvpool_ready"][0] == "gauge"
    # the miss-ratio curve's points: one labelled gauge each
    curve = {
        f'kvpool_miss_ratio_hit_rate{{scale="{p["scale"]:g}",capacity_bytes="{p["capacity_bytes"]}"}}': p
        for p in stats["miss_ratio"]["curve"]
    }
    assert len(curve) == 5
    for name, point in curve.items():
        assert scraped[name] == ("gauge", point["hit_rate"]), name
    # nothing on /metrics that /stats does not have (but the sidecar's own readiness)
    from_stats = {declared(path)[0] for path, _ in numbers(stats)} | set(curve)
    assert set(scraped) - from_stats == {"kvpool_ready"}
    return scraped


def test_every_stats_number_is_on_metrics_with_its_type(sidecar_factory, redis: RedisServer) -> None:
    proc = sidecar_factory("1Mi", [redis.url])
    url = proc.info["url"]
    c = SidecarClient(url, timeout=10, shm_path=str(proc.info["arena_dir"]))
    seen = [check_every_number(url)]

    chunks = {key(i, "m"): payload(200_000, i) for i in range(4)}
    assert save(c, chunks) == list(chunks)

    def written_behind() -> bool:  # the queue (half the 1 MiB capacity) takes some of them
        r = c.stats()["tiers"]["redis"]
        return r["queued"] == 0 and r["written"] + r["dropped"] == 4 and r["written"] > 0

    wait_until(written_behind, 30, "the write-behind of the 4 chunks")
    assert c.lookup([*chunks, key(99, "m")]) == 4
    pinned = c.pin(list(chunks))
    seen.append(check_every_number(url))
    assert seen[-1]["kvpool_pinned_leases"] == ("gauge", 1.0)
    c.release(pinned.lease)
    more = {key(i, "n"): payload(200_000, 10 + i) for i in range(4)}  # the 1 MiB arena evicts for these
    save(c, more)
    assert load(c, list(more)) == more
    seen.append(check_every_number(url))
    assert seen[-1]["kvpool_evictions_total"][1] > 0

    redis.stop()
    wait_until(lambda: c.stats()["tiers"]["redis"]["shards_up"] == 0, 30, "the sidecar to see Redis down")
    seen.append(check_every_number(url))

    # what went down between scrapes is a gauge; and these did go down (a lease, a shard, chunks)
    went_down = {
        name
        for before, after in pairwise(seen)
        for name, (_, value) in after.items()
        if value < before[name][1]
    }
    assert {"kvpool_pinned_leases", "kvpool_redis_shards_up", "kvpool_redis_ready"} <= went_down
    for name in went_down:
        assert seen[-1][name][0] == "gauge", f"{name} went down but is typed {seen[-1][name][0]}"
    c.close()
