"""The Redis tier against real redis-server processes and real sidecar processes."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

from kvtest import RedisServer, free_port, redis_call, redis_with, wait_until
from sidecar_support import key, load, payload, redis_stats, reserved, save

from kvpool_sidecar.client import SidecarClient, checksum
from kvpool_sidecar.redis_format import alias_key, alias_value, chunk_key


def client(proc) -> SidecarClient:
    return SidecarClient(proc.info["url"], timeout=10, shm_path=str(proc.info["arena_dir"]))


def test_two_sidecars_sharing_one_redis_cross_pod_hit(sidecar_factory, redis) -> None:
    a, b = sidecar_factory("64Mi", [redis.url]), sidecar_factory("64Mi", [redis.url])
    ca, cb = client(a), client(b)
    chunks = {key(i): payload(n, i) for i, n in enumerate([9 * 2**20 + 5, 4 * 2**20, 1000])}  # 3, 1, 1 pieces
    keys = list(chunks)
    assert save(ca, chunks) == keys
    wait_until(lambda: redis_stats(ca)["written"] == 3, 30, "write-behind of 3 chunks")
    assert cb.lookup(keys) == 3  # found in Redis by the other pod
    assert load(cb, keys) == chunks  # promoted into b's arena, byte for byte
    assert cb.stats()["promotions"] == 3
    assert cb.get(keys[0]) == chunks[keys[0]]  # now a CPU hit in b
    # and over HTTP only: a chunk PUT into a is a GET hit in b
    k = key(99)
    assert ca.put(k, b"over http" * 1000)
    wait_until(lambda: redis_stats(ca)["written"] == 4, 30, "write-behind of the PUT chunk")
    assert cb.get(k) == b"over http" * 1000


def test_redis_stopped_mid_run_then_back_on_the_same_port(sidecar_factory, redis: RedisServer) -> None:
    proc = sidecar_factory("32Mi", [redis.url])
    c = client(proc)
    assert c.readyz() == (True, "ok")
    first = {key(i, "r1"): payload(50_000, i) for i in range(4)}
    save(c, first)
    wait_until(lambda: redis_stats(c)["written"] == 4, 30, "write-behind before the outage")

    redis.stop()
    _, reason = wait_until(lambda: None if (r := c.readyz())[0] else r, 30, "readiness to report Redis down")
    assert "redis" in reason.lower() and str(redis.port) in reason
    # the pod's startup probe asks for the CPU tier only: a Redis outage must not hold vLLM back
    with urllib.request.urlopen(proc.info["url"] + "/readyz?tier=cpu", timeout=5) as r:
        assert r.status == 200 and json.loads(r.read())["ready"] is True
    # saves and CPU hits keep working while Redis is away
    during = {key(i, "r2"): payload(50_000, 100 + i) for i in range(4)}
    assert save(c, during) == list(during)
    assert load(c, list(first) + list(during)) == {**first, **during}
    assert c.put(key(7, "r2"), b"during") and c.get(key(7, "r2")) == b"during"
    assert c.lookup([key(1, "absent")]) == 0  # a miss, not an error
    stats = redis_stats(c)
    assert stats["ready"] is False and stats["dropped"] >= 1

    redis.start()  # the same port, an empty Redis
    wait_until(lambda: c.readyz()[0], 30, "readiness to recover by itself")
    after = {key(i, "r3"): payload(60_000, 200 + i) for i in range(2)}
    save(c, after)
    wait_until(lambda: redis_stats(c)["written"] == 6, 30, "write-behind after the outage")
    for k in after:
        assert b":1" in redis_call(redis.port, "EXISTS", chunk_key(k))


def test_write_behind_never_blocks_a_save_and_counts_what_it_drops(sidecar_factory, redis) -> None:
    proc = sidecar_factory("64Mi", [redis.url], "--redis-queue-bytes", "250000")  # two chunks and a half
    c = client(proc)
    redis.proc.popen.send_signal(signal.SIGSTOP)  # Redis hangs: the writer blocks on its socket
    try:
        chunks = {key(i, "q"): payload(100_000, i) for i in range(20)}
        for k, v in chunks.items():  # one commit per chunk, each returns without waiting on Redis
            assert save(c, {k: v}) == [k]
        assert c.lookup(list(chunks)) == 20
        wait_until(lambda: redis_stats(c)["dropped"] >= 17, 10, "queue-full drops to be counted")
    finally:
        redis.proc.popen.send_signal(signal.SIGCONT)


def test_rendezvous_sharding_across_two_redis(sidecar_factory, redis) -> None:
    with redis_with() as (port2, _):
        url2 = f"redis://127.0.0.1:{port2}/0"
        a = sidecar_factory("64Mi", [redis.url, url2])
        b = sidecar_factory("64Mi", [url2, redis.url])  # order does not matter to rendezvous hashing
        ca, cb = client(a), client(b)
        chunks = {key(i, "s"): payload(10_000, i) for i in range(40)}
        save(ca, chunks)
        wait_until(lambda: redis_stats(ca)["written"] == 40, 30, "write-behind of 40 chunks")
        counts = [int(redis_call(p, "DBSIZE").strip(b":\r\n")) for p in (redis.port, port2)]
        assert all(n > 0 for n in counts) and sum(counts) == 40  # one Redis key per chunk
        assert load(cb, list(chunks)) == chunks


def test_redis_cluster_url(sidecar_factory, redis_cluster: int) -> None:
    url = f"redis+cluster://127.0.0.1:{redis_cluster}"
    a = sidecar_factory("64Mi", [url])
    b = sidecar_factory("64Mi", [f"redis://127.0.0.1:{redis_cluster}?cluster=true"])
    ca, cb = client(a), client(b)
    assert ca.readyz()[0] and cb.readyz()[0]
    chunks = {key(i, "c"): payload(5 * 2**20 if i == 0 else 30_000, i) for i in range(5)}
    save(ca, chunks)
    wait_until(lambda: redis_stats(ca)["written"] == 5, 30, "write-behind into the cluster")
    assert cb.lookup(list(chunks)) == 5
    assert load(cb, list(chunks)) == chunks


def test_password_from_the_url_or_the_environment(sidecar_factory) -> None:
    with redis_with(password="s3cret") as (port, _):
        in_url = sidecar_factory("16Mi", [f"redis://:s3cret@127.0.0.1:{port}/0"])
        wait_until(lambda: client(in_url).readyz()[0], 15, "auth with the URL's password")
        assert "s3cret" not in str(client(in_url).stats())
        # the same URL without a password and nothing in the environment: not ready, says why
        no_pw = sidecar_factory("16Mi", [f"redis://127.0.0.1:{port}/0"])
        ready, reason = client(no_pw).readyz()
        assert not ready and "auth" in reason.lower()


def test_password_from_environment(tmp_path, monkeypatch) -> None:
    from kvtest import start_sidecar

    with redis_with(password="envpw") as (port, _):
        monkeypatch.setenv("KVPOOL_REDIS_PASSWORD", "envpw")
        proc = start_sidecar(tmp_path, "16Mi", [f"redis://127.0.0.1:{port}/0"])
        try:
            wait_until(lambda: client(proc).readyz()[0], 15, "auth with KVPOOL_REDIS_PASSWORD")
        finally:
            proc.stop()


def test_redis_urls_file_is_re_read(sidecar_factory, redis, tmp_path) -> None:
    urls = tmp_path / "redis-urls"
    urls.write_text("")
    proc = sidecar_factory("16Mi", [], "--redis-urls-file", str(urls))
    c = client(proc)
    ready, reason = c.readyz()
    assert not ready and "no shard" in reason
    urls.write_text(f"# written by the operator\n{redis.url}\n")
    wait_until(lambda: c.readyz()[0], 30, "the new shard list to be picked up")
    save(c, {key(1, "f"): b"x" * 5000})
    wait_until(lambda: redis_stats(c)["written"] == 1, 30, "write-behind to the new shard")


def test_a_chunk_changed_in_redis_is_never_served(sidecar_factory, redis) -> None:
    a, b = sidecar_factory("16Mi", [redis.url]), sidecar_factory("16Mi", [redis.url])
    ca, cb = client(a), client(b)
    k = key(1, "x")
    save(ca, {k: payload(20_000, 1)})
    wait_until(lambda: redis_stats(ca)["written"] == 1, 30, "write-behind")
    tampered = bytearray(payload(20_000, 1))
    tampered[100:108] = b"tampered"
    redis_call(redis.port, "HSET", chunk_key(k), "0", bytes(tampered))
    assert load(cb, [k]) == {}
    assert cb.stats()["corrupt_dropped"] == 1
    # deleted from Redis, so no pod keeps finding it, fetching it and failing on it
    wait_until(lambda: b":0" in redis_call(redis.port, "EXISTS", chunk_key(k)), 10, "the bad chunk deleted")
    assert cb.get(k) is None and cb.lookup([k]) == 0


def test_redis_absent_at_start_then_up(sidecar_factory) -> None:
    """Pods may start before their Redis: the sidecar serves from the CPU tier and joins Redis later."""
    from kvtest import free_port

    port = free_port()
    plain = sidecar_factory("16Mi", [f"redis://127.0.0.1:{port}/0"])
    cluster = sidecar_factory("16Mi", [f"redis+cluster://127.0.0.1:{port}"])
    for proc in (plain, cluster):
        c = client(proc)
        ready, reason = c.readyz()
        assert not ready and f"127.0.0.1:{port}" in reason
        assert save(c, {key(1, "early"): b"e" * 4096}) == [key(1, "early")]
        assert load(c, [key(1, "early")]) == {key(1, "early"): b"e" * 4096}
    with redis_with(port=port):
        wait_until(lambda: client(plain).readyz()[0], 30, "the plain client to find Redis")
        save(client(plain), {key(2, "late"): b"l" * 4096})
        wait_until(lambda: redis_stats(client(plain))["written"] == 1, 30, "write-behind once Redis is up")
        # a plain (non-cluster) Redis behind a cluster URL: not ready, and it says why
        _, reason = client(cluster).readyz()
        assert "cluster" in reason.lower()


POOL = {"KVPOOL_POOL_KEY": "pool-a-secret"}


def test_a_chunk_planted_without_the_pool_key_is_never_loaded(sidecar_factory, redis) -> None:
    import struct

    from kvpool_sidecar.wire import checksum

    a, b = sidecar_factory("16Mi", [redis.url], env=POOL), sidecar_factory("16Mi", [redis.url], env=POOL)
    ca, cb = client(a), client(b)
    planted, other_pool = key(1, "planted"), key(2, "other-pool")
    # bytes with a valid checksum and the pool's meta format, from something without the pool's key
    evil = payload(30_000, 66)
    meta = struct.pack(">4sQQiI16s", b"KVP3", len(evil), checksum(evil), 0, 1, b"\x07" * 16)
    redis_call(redis.port, "HSET", chunk_key(planted), "0", evil, "m", meta)
    # and a chunk written by a sidecar of another pool (another key) into the same Redis
    stranger = client(sidecar_factory("16Mi", [redis.url], env={"KVPOOL_POOL_KEY": "pool-b-secret"}))
    save(stranger, {other_pool: payload(30_000, 77)})
    wait_until(lambda: redis_stats(stranger)["written"] == 1, 30, "the other pool's write-behind")
    assert load(cb, [planted]) == {} and load(cb, [other_pool]) == {} and cb.get(planted) is None
    assert redis_stats(cb)["auth_failures"] == 2 and redis_stats(cb)["authenticated"] is True
    assert b":0" in redis_call(redis.port, "EXISTS", chunk_key(planted))  # deleted, not kept
    # the pool's own chunk under that key is then written behind by one pod and shared byte for byte
    real = payload(30_000, 1)
    save(ca, {planted: real})
    wait_until(lambda: redis_stats(ca)["written"] == 1, 30, "write-behind of the real chunk")
    assert load(cb, [planted]) == {planted: real}


def test_a_pod_that_must_authenticate_and_has_no_key_keeps_redis_off(sidecar_factory, redis) -> None:
    proc = sidecar_factory("16Mi", [redis.url], "--pool-key-required")
    c = client(proc)
    ready, reason = c.readyz()
    assert not ready and "KVPOOL_POOL_KEY" in reason
    assert c.stats()["tiers"]["redis"] == {"ready": False, "reason": reason}
    save(c, {key(1, "nokey"): b"n" * 4096})  # the CPU tier serves on
    assert load(c, [key(1, "nokey")]) == {key(1, "nokey"): b"n" * 4096}
    assert b":0" in redis_call(redis.port, "DBSIZE")


def test_first_whole_group_found_in_the_cpu_tier_or_through_redis(sidecar_factory, redis) -> None:
    """The scheduler's probe for a shorter saved tail: the first group whose keys are all loadable,
    from this pod's CPU tier or another pod's writes in Redis; a group with one key missing is not."""
    a, b = sidecar_factory("64Mi", [redis.url]), sidecar_factory("64Mi", [redis.url])
    ca, cb = client(a), client(b)
    chunks = {key(i): payload(1000, i) for i in range(3)}
    k0, k1, k2 = list(chunks)
    save(ca, chunks)
    wait_until(lambda: redis_stats(ca)["written"] == 3, 30, "write-behind of 3 chunks")
    missing = key(50)
    for c in (ca, cb):  # a from its arena, b through Redis
        assert c.first_whole([[missing], [k0, missing], [k1, k2], [k0]]) == 2
        assert c.first_whole([[missing], [k2, missing]]) is None
        # a lookup and the groups of where it may miss, in one round trip: asked when found is `at`
        assert c.lookup_then_first_whole([k0, missing, k1], 1, [[missing], [k1]]) == (1, 1)
        assert c.lookup_then_first_whole([k0, missing], 0, [[k1]]) == (1, None)
    assert ca.first_whole([]) is None

    def over_http(body: dict) -> dict:
        data = json.dumps(body).encode()
        req = urllib.request.Request(a.info["url"] + "/v1/lookup", data, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    # the lookup's alternatives are tried when every key was found, or `alternatives_at` were
    assert over_http({"keys": [missing], "alternatives": [[k0]]}) == {"hits": 0, "alternative": None}
    assert over_http({"keys": [missing], "alternatives": [[k0]], "alternatives_at": 0}) == {
        "hits": 0,
        "alternative": 0,
    }


def test_a_lookup_through_redis_counts_as_a_use_of_the_chunk(sidecar_factory, redis) -> None:
    """Redis evicts by recency (the chart's allkeys-lru): a chunk the pool's pods keep looking up is in
    use, or a hot shared prefix would be among the first evicted. A lookup asks Redis with TOUCH, which
    answers as EXISTS does and counts as a use."""
    a, b = sidecar_factory("16Mi", [redis.url]), sidecar_factory("16Mi", [redis.url])
    k = key(1, "hot")
    assert save(client(a), {k: payload(1000, 1)}) == [k]
    wait_until(lambda: redis_stats(client(a))["written"] == 1, 30, "the write-behind")

    def idle() -> int:  # seconds since Redis last saw the chunk used
        return int(redis_call(redis.port, "OBJECT", "IDLETIME", chunk_key(k))[1:].split(b"\r")[0])

    before = wait_until(lambda: (n := idle()) >= 3 and n, 30, "the chunk idle in Redis for 3 s")
    assert client(b).lookup([k, key(2, "absent")]) == 1  # b's CPU tier misses: Redis is asked
    assert idle() < before - 1


def test_a_redis_that_would_refuse_writes_once_full_is_refused_with_the_reason(sidecar_factory) -> None:
    """maxmemory with Redis's default noeviction: kvpool's chunks have no TTL, so once full every
    write is refused. The shard is refused at once, with what to change, and used once it is."""
    with redis_with("--maxmemory", "64mb") as (port, _):
        proc = sidecar_factory("16Mi", [f"redis://127.0.0.1:{port}/0"])
        c = client(proc)
        ready, reason = c.readyz()
        assert not ready and "maxmemory-policy noeviction" in reason and "allkeys-lru" in reason
        assert redis_stats(c)["shards_up"] == 0
        redis_call(port, "CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
        wait_until(lambda: c.readyz()[0], 30, "the shard used once its policy evicts")


def test_a_write_redis_refuses_for_memory_is_dropped_and_the_shard_keeps_serving(sidecar_factory) -> None:
    with redis_with("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru") as (port, _):
        proc = sidecar_factory("64Mi", [f"redis://127.0.0.1:{port}/0"])
        c = client(proc)
        small = {key(1, "oom"): payload(100_000, 1)}
        save(c, small)
        wait_until(lambda: redis_stats(c)["written"] == 1, 30, "the small chunk written behind")
        save(c, {key(2, "oom"): payload(8 * 2**20, 2)})  # more than maxmemory: OOM, whatever it evicts
        wait_until(lambda: redis_stats(c)["dropped"] == 1, 30, "the big chunk's write refused")
        stats = redis_stats(c)
        assert stats["shards_up"] == 1 and stats["write_errors"] == 0
        assert c.readyz() == (True, "ok")
        assert c.lookup([key(1, "oom")]) == 1


def mount_secret(directory: Path, data: dict[str, str]) -> None:
    """Writes `data` as the kubelet writes a Secret volume: the files in a new directory, the `..data`
    link swapped to it in one rename, each key a link through `..data`."""
    directory.mkdir(exist_ok=True)
    version = directory / f"..{time.time_ns()}"
    version.mkdir()
    for name, value in data.items():
        (version / name).write_text(value)
    swap = directory / "..data_tmp"
    swap.symlink_to(version.name)
    os.replace(swap, directory / "..data")
    for name in data:
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(f"..data/{name}")


def test_a_secret_made_again_reaches_a_running_sidecar_and_the_change_is_only_misses(
    sidecar_factory, tmp_path: Path
) -> None:
    """A deleted Secret is made again with a new value and the shards roll with it (#21, item 2): a running
    sidecar takes the new password and pool key from its mounted Secret, no restart, and until it has
    them the old ones only ever give misses, never an error to vLLM."""
    secret = tmp_path / "credentials"
    mount_secret(secret, {"redis-password": "old-password", "pool-key": "old-key"})
    files = ["--redis-password-file", str(secret / "redis-password"),
             "--pool-key-file", str(secret / "pool-key"), "--pool-key-required"]  # fmt: skip
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    before, during, after = key(1, "before"), key(2, "during"), key(3, "after")
    with redis_with(password="old-password", port=port):
        a = client(sidecar_factory("16Mi", [url], *files))
        wait_until(lambda: a.readyz()[0], 15, "the sidecar on the mounted password and key")
        save(a, {before: payload(30_000, 1)})
        wait_until(lambda: redis_stats(a)["written"] == 1, 30, "write-behind under the old credentials")
    # the shard rolled: a new process with the new password (empty, as a restarted shard is)
    with redis_with(password="new-password", port=port):
        wait_until(lambda: "auth" in a.readyz()[1].lower(), 15, "the old password refused")
        save(a, {during: payload(30_000, 2)})  # the CPU tier serves on; the write behind is dropped
        assert load(a, [during]) == {during: payload(30_000, 2)}
        new = {"KVPOOL_REDIS_PASSWORD": "new-password", "KVPOOL_POOL_KEY": "new-key"}
        b = client(sidecar_factory("16Mi", [url], "--pool-key-required", env=new))  # a pod started after
        wait_until(lambda: b.readyz()[0], 15, "a new pod on the new credentials")
        assert b.lookup([before]) == 0 and b.lookup([during]) == 0
        mount_secret(
            secret, {"redis-password": "new-password", "pool-key": "new-key"}
        )  # the kubelet's update
        wait_until(lambda: a.readyz()[0], 15, "the running sidecar on the new password")
        save(a, {after: payload(30_000, 3)})
        wait_until(lambda: redis_stats(a)["written"] == 2, 30, "write-behind under the new credentials")
        assert load(b, [after]) == {after: payload(30_000, 3)}  # the new key's MAC: one pool again
        assert redis_stats(b)["auth_failures"] == 0


def test_a_block_prefix_saved_on_one_pod_is_found_and_loaded_on_another_through_redis(
    sidecar_factory, redis
) -> None:
    """Prefix repetition across pods (#24 item 3): a chunk saved with the keys of its block prefixes
    is found on another pod by one of them, through Redis, and loads as the whole chunk (the reader
    takes its first blocks), as it would from the pod's own CPU tier. A planted alias, unsigned or
    naming another chunk, is never followed."""
    a, b = sidecar_factory("64Mi", [redis.url], env=POOL), sidecar_factory("64Mi", [redis.url], env=POOL)
    ca, cb = client(a), client(b)
    chunk, first_block, two_blocks = key(1, "doc"), key(1, "doc-1-block"), key(1, "doc-2-blocks")
    data = payload(64 * 1024, 1)
    slots = reserved(ca, [(chunk, len(data))], prefixes={chunk: [first_block, two_blocks]})
    arena = ca.arena()
    arena[slots[0].offset : slots[0].offset + len(data)] = data
    assert ca.commit([(slots[0], checksum(data))]) == [True]
    wait_until(lambda: redis_stats(ca)["written"] == 1, 30, "the write-behind")
    wait_until(lambda: b":1" in redis_call(redis.port, "EXISTS", alias_key(two_blocks)), 30, "the aliases")

    missing = key(2, "other-doc")
    assert cb.first_whole([[missing], [two_blocks]]) == 1  # b's CPU tier is empty: found in Redis
    pinned = cb.pin([first_block])
    try:
        assert [(s.key, s.length) for s in pinned.slots] == [(chunk, len(data))]
        (s,) = pinned.slots
        assert bytes(cb.arena()[s.offset : s.offset + s.length]) == data
    finally:
        cb.release(pinned.lease)
    assert cb.first_whole([[two_blocks]]) == 0 and load(cb, [chunk]) == {chunk: data}  # held now
    assert redis_stats(cb)["hits"] == 1  # one promotion, the whole chunk

    # an alias planted without the pool's key, and one of this pool's re-pointed at another prefix's
    # chunk, are misses (and deleted), never another chunk's blocks
    other = key(3, "doc")
    save(ca, {other: payload(64 * 1024, 3)})
    wait_until(lambda: redis_stats(ca)["written"] == 2, 30, "the second write-behind")
    fresh = client(sidecar_factory("64Mi", [redis.url], env=POOL))
    forged, moved = key(4, "forged"), key(5, "moved")
    redis_call(redis.port, "SET", alias_key(forged), alias_value(b"not-the-pool-key", forged, other))
    signed_for_two_blocks = alias_value(POOL["KVPOOL_POOL_KEY"].encode(), two_blocks, other)
    redis_call(redis.port, "SET", alias_key(moved), signed_for_two_blocks)
    assert load(fresh, [forged]) == {} and load(fresh, [moved]) == {}
    assert redis_stats(fresh)["auth_failures"] == 2 and fresh.stats()["chunks"] == 0
    assert b":0" in redis_call(redis.port, "EXISTS", alias_key(forged))
    # a chunk changed in Redis, reached through a good alias, is not served and is deleted
    prefix = key(6, "doc-1-block")
    redis_call(
        redis.port, "SET", alias_key(prefix), alias_value(POOL["KVPOOL_POOL_KEY"].encode(), prefix, other)
    )
    redis_call(redis.port, "HSET", chunk_key(other), "0", payload(64 * 1024, 99))
    assert load(fresh, [prefix]) == {} and fresh.stats()["corrupt_dropped"] == 1
    wait_until(
        lambda: b":0" in redis_call(redis.port, "EXISTS", chunk_key(other)), 30, "the changed chunk deleted"
    )
    # its alias now names nothing: the next load misses once and deletes it, so that the next chunk
    # saved with that prefix can name itself there (the first writer would hold it forever)
    assert fresh.lookup([prefix]) == 1 and load(fresh, [prefix]) == {}
    assert b":0" in redis_call(redis.port, "EXISTS", alias_key(prefix)) and fresh.lookup([prefix]) == 0
