"""A new sidecar pre-warms its CPU tier from the pool's hottest chunks in Redis (#25, warm rollouts):
real sidecar processes and a real redis-server."""

from __future__ import annotations

import redis as redis_py
from kvtest import RedisServer, wait_until
from sidecar_support import key, load, payload, redis_stats, save

from kvpool_sidecar.client import SidecarClient
from kvpool_sidecar.hot_chunks import HotChunks, hot_set_name, hottest
from kvpool_sidecar.redis_shard import Shards

POOL_KEY = "the-pools-secret"
KiB, MiB = 2**10, 2**20


def client(proc) -> SidecarClient:
    return SidecarClient(proc.info["url"], timeout=10, shm_path=str(proc.info["arena_dir"]))


def make_hot(sidecar_factory, redis: RedisServer, sizes: list[int], loads: list[int]) -> list[str]:
    """A pod of the pool saves chunks of `sizes` and loads the i-th loads[i] times; returns their keys
    once the pool's hot set holds every loaded one with its count."""
    a = client(sidecar_factory("64Mi", [redis.url], env={"KVPOOL_POOL_KEY": POOL_KEY}))
    r, name = redis_py.Redis(port=redis.port), hot_set_name(POOL_KEY.encode())
    # a first load, whose report starts the set's first half-life (halving it): the loads below
    # then count whole, in whichever reports they land
    primer = key(0, "primer")
    assert save(a, {primer: b"p" * 1024}) == [primer] and load(a, [primer])
    wait_until(lambda: r.exists(name + ":halved"), 30, "the hot set's first report")
    chunks = {key(i, "hot"): payload(n, i) for i, n in enumerate(sizes)}
    keys = list(chunks)
    assert save(a, chunks) == keys
    wait_until(lambda: redis_stats(a)["written"] == len(keys) + 1, 30, "the write-behind")
    for k, n in zip(keys, loads, strict=True):
        for _ in range(n):
            assert load(a, [k]) == {k: chunks[k]}
    expected = [(k.encode(), float(n)) for k, n in zip(keys, loads, strict=True) if n]
    expected = [*sorted(expected, key=lambda kv: -kv[1]), (primer.encode(), 0.5)]
    wait_until(lambda: r.zrevrange(name, 0, -1, withscores=True) == expected, 30, "every load in the hot set")
    return keys


def test_a_new_sidecar_prewarms_the_hottest_chunks_within_its_budget(sidecar_factory, redis) -> None:
    keys = make_hot(sidecar_factory, redis, [MiB] * 4, loads=[2, 5, 4, 0])

    b = client(
        sidecar_factory(
            "64Mi", [redis.url], "--prewarm-bytes", str(2 * MiB + MiB // 2), env={"KVPOOL_POOL_KEY": POOL_KEY}
        )
    )
    stats = wait_until(lambda: (s := redis_stats(b))["prewarm"] == "done" and s, 30, "the pre-warm")
    # the two hottest fit 2.5 MiB; the third would cross it
    assert (stats["prewarmed"], stats["prewarmed_bytes"]) == (2, 2 * MiB)
    assert b.stats()["chunks"] == 2
    hits_before = stats["hits"]
    assert load(b, [keys[1], keys[2]]) == {keys[1]: payload(MiB, 1), keys[2]: payload(MiB, 2)}
    assert redis_stats(b)["hits"] == hits_before  # served from the CPU tier, Redis not asked

    # another pool on the same Redis (another key) pre-warms nothing of this pool's and deletes nothing
    other = client(
        sidecar_factory("64Mi", [redis.url], "--prewarm-bytes", "8Mi", env={"KVPOOL_POOL_KEY": "other"})
    )
    stats = wait_until(lambda: (s := redis_stats(other))["prewarm"] == "done" and s, 30, "the other pre-warm")
    assert (stats["prewarmed"], stats["auth_failures"]) == (0, 0)
    assert load(b, [keys[0]]) == {keys[0]: payload(MiB, 0)}  # still in Redis: promoted on a miss


def test_a_prewarm_never_evicts_what_the_sidecar_holds(sidecar_factory, redis, tmp_path) -> None:
    """The pre-warm fills free room only. The sidecar's tier comes up after it saved chunks of its own
    (its URL file written late, as a ConfigMap may be): it then pre-warms into what is left."""
    keys = make_hot(sidecar_factory, redis, [256 * KiB] * 5, loads=[5, 4, 3, 2, 1])
    urls = tmp_path / "urls"
    urls.write_text("")
    late = ["--redis-urls-file", str(urls), "--prewarm-bytes", "64Mi"]
    b = client(sidecar_factory("4Mi", [], *late, env={"KVPOOL_POOL_KEY": POOL_KEY}))
    assert redis_stats(b)["prewarm"] == "waiting"
    own = {key(i, "own"): payload(MiB, 100 + i) for i in range(3)}
    assert save(b, own) == list(own)
    urls.write_text(redis.url + "\n")
    stats = wait_until(lambda: (s := redis_stats(b))["prewarm"] == "done" and s, 30, "the pre-warm")
    # 4 MiB less the 3 MiB held: the four hottest 256 KiB chunks fit, the fifth would evict
    assert (stats["prewarmed"], b.stats()["chunks"], b.stats()["evictions"]) == (4, 7, 0)
    assert load(b, list(own)) == own
    assert load(b, keys[:4]) == {k: payload(256 * KiB, i) for i, k in enumerate(keys[:4])}


def test_the_hot_set_halves_every_half_life_so_it_follows_what_is_hot_now(redis) -> None:
    """A prefix loaded 8 times one half-life ago weighs less than one loaded 6 times now (without the
    halving, 8 > 6: a pre-warm would bring last week's prefixes)."""
    shards = Shards([redis.url], None, None)
    shards.check()
    hot, name = HotChunks(half_life=1), "kvpool:hot:v1:test"
    r = redis_py.Redis(port=redis.port)
    hot.loaded(["old"] * 8)
    assert hot.report(shards, name) == 1
    assert r.zscore(name, "old") == 4.0  # the first report starts the first half-life
    wait_until(lambda: not r.exists(name + ":halved"), 10, "the half-life to pass")
    hot.loaded(["new"] * 6)
    hot.report(shards, name)
    assert r.zrevrange(name, 0, -1, withscores=True) == [(b"new", 3.0), (b"old", 2.0)]
    assert hottest(shards, name) == ["new", "old"]
    shards.close()
