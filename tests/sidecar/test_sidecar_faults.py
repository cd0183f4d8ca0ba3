"""Faults against the real sidecar process and a real redis-server: stale writers, a slow body, a
restart under a client, Redis evicting and hanging, two promotions of one key. Each case ends with
no wrong byte served: what a load returns is what was saved under that key, or nothing."""

from __future__ import annotations

import signal
import socket
import threading
import urllib.parse

from kvtest import auth_line, redis_call, redis_with, start_sidecar, wait_until
from sidecar_support import key, load, payload, redis_stats, reserved, save

from kvpool_sidecar.client import SidecarClient, checksum

CHUNK = 64 * 1024


def client(proc, timeout: float = 10) -> SidecarClient:
    return SidecarClient(proc.info["url"], timeout=timeout, shm_path=str(proc.info["arena_dir"]))


def test_a_writer_whose_reservation_expired_never_lands(sidecar_factory) -> None:
    """A writer stalls past its reservation; the extent goes to another chunk, which is written and
    committed; the stale writer then writes and commits. Its commit is refused, and the other
    chunk's bytes, overwritten in the arena, are never served as that chunk."""
    proc = sidecar_factory("64Ki", [], "--lease-seconds", "2")  # room for exactly one chunk
    stale, fresh = client(proc), client(proc)
    a, b = payload(CHUNK, 1), payload(CHUNK, 2)
    (slot_a,) = reserved(stale, [(key(1, "stale"), CHUNK)])
    wait_until(lambda: stale.stats()["reservations_expired"] == 1, 10, "the stalled reservation to expire")
    (slot_b,) = reserved(fresh, [(key(2, "fresh"), CHUNK)])
    assert (slot_b.offset, slot_b.length) == (slot_a.offset, slot_a.length)  # the same extent
    fresh.arena()[slot_b.offset : slot_b.offset + CHUNK] = b
    assert fresh.commit([(slot_b, checksum(b))]) == [True]
    stale.arena()[slot_a.offset : slot_a.offset + CHUNK] = a  # the stale writer wakes up
    assert stale.commit([(slot_a, checksum(a))]) == [False]  # fenced
    assert stale.stats()["refused_commits"] == 1
    assert fresh.get(key(1, "stale")) is None
    assert fresh.get(key(2, "fresh")) is None  # B's bytes are gone: a miss, never A's bytes as B
    assert fresh.stats()["corrupt_dropped"] == 1


def test_a_stale_write_before_the_owners_commit_is_caught_too(sidecar_factory) -> None:
    """The stale bytes land between the owner's copy and its commit: the owner's checksum is of its
    own source, so the chunk fails its check instead of being stored as valid."""
    proc = sidecar_factory("64Ki", [], "--lease-seconds", "2")
    stale, fresh = client(proc), client(proc)
    a, b = payload(CHUNK, 3), payload(CHUNK, 4)
    (slot_a,) = reserved(stale, [(key(3, "stale"), CHUNK)])
    wait_until(lambda: stale.stats()["reservations_expired"] == 1, 10, "the stalled reservation to expire")
    (slot_b,) = reserved(fresh, [(key(4, "fresh"), CHUNK)])
    fresh.arena()[slot_b.offset : slot_b.offset + CHUNK] = b
    stale.arena()[slot_a.offset : slot_a.offset + CHUNK] = a
    assert fresh.commit([(slot_b, checksum(b))]) == [True]
    assert load(fresh, [key(4, "fresh")]) == {}  # the sidecar's check refuses it
    assert fresh.get(key(4, "fresh")) is None


def test_a_slow_put_past_its_reservation_stores_nothing_and_overwrites_nothing(sidecar_factory) -> None:
    proc = sidecar_factory("64Ki", [], "--lease-seconds", "2")
    c = client(proc)
    url = urllib.parse.urlsplit(proc.info["url"])
    slow, fast = payload(CHUNK, 5), payload(CHUNK, 6)
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        auth = auth_line(proc.info["arena_dir"])
        head = f"PUT /v1/chunks/{key(5, 'slow')} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {CHUNK}\r\n\r\n"
        s.sendall(head.encode() + slow[: CHUNK // 2])
        wait_until(lambda: c.stats()["reserved_chunks"] == 1, 10, "the PUT to reserve its slot")
        wait_until(lambda: c.stats()["reservations_expired"] == 1, 10, "the PUT's reservation to expire")
        assert c.put(key(6, "fast"), fast)  # the extent is another chunk's now
        s.sendall(slow[CHUNK // 2 :])
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408"), answer  # past its lease from the start: not stored
    assert c.get(key(5, "slow")) is None
    assert c.get(key(6, "fast")) == fast


def test_a_restart_under_a_client_refuses_its_old_reservations_and_pins(sidecar_factory) -> None:
    """The arena file outlives the sidecar; its header's epoch does not. A reservation from before
    the restart cannot be committed after it, and the client sees the new epoch in the file; the
    chunk committed before it is adopted, whole."""
    from kvpool_sidecar.wire import arena_epoch

    proc = sidecar_factory("1Mi", [], "--keep-arena")  # as in a pod: the file outlives the process
    c = client(proc)
    data = payload(CHUNK, 7)
    save(c, {key(7, "old"): data})
    pinned = c.pin([key(7, "old")])
    (slot,) = reserved(c, [(key(8, "old"), CHUNK)])
    arena = c.arena()
    assert arena_epoch(arena) == slot.epoch == pinned.slots[0].epoch
    proc.stop()
    again = start_sidecar(proc.info["arena_dir"].parent, "1Mi", [], "--keep-arena", port=proc.info["port"])
    try:
        assert arena_epoch(arena) not in (None, slot.epoch)  # the same mapping shows the new epoch
        arena[slot.offset : slot.offset + CHUNK] = data
        assert c.commit([(slot, checksum(data))]) == [False]
        assert c.lookup([key(8, "old")]) == 0
        assert c.stats()["refused_commits"] == 1
        assert c.get(key(7, "old")) == data
    finally:
        again.stop()


def test_redis_evicting_under_memory_pressure_never_leaves_a_chunk_that_fails(sidecar_factory) -> None:
    """allkeys-lru evicts keys one by one; a chunk is one key, so whatever a lookup finds loads whole."""
    with redis_with("--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru") as (port, _):
        url = f"redis://127.0.0.1:{port}/0"
        a, b = client(sidecar_factory("64Mi", [url])), client(sidecar_factory("64Mi", [url]))
        chunks = {key(i, "lru"): payload(300_000, 300 + i) for i in range(30)}  # 9 MB into 3 MB
        save(a, chunks)
        wait_until(
            lambda: redis_stats(a)["written"] + redis_stats(a)["write_errors"] >= 30, 60, "write-behind"
        )
        assert int(redis_call(port, "INFO", "stats").split(b"evicted_keys:")[1].split(b"\r")[0]) > 0
        found = 0
        for k, v in chunks.items():
            if b.lookup([k]) == 1:
                found += 1
                assert load(b, [k]) == {k: v}
        assert 0 < found < 30
        assert redis_stats(b)["read_errors"] == 0


def test_a_hung_redis_never_holds_a_lookup_past_its_budget(sidecar_factory, redis) -> None:
    """A lookup of a chunk not in the CPU tier asks Redis; with Redis hung it answers from the CPU tier
    within the client's 1 s timeout (a lookup may hold vLLM's scheduler only that long), and marks
    the shard down until it answers again."""
    proc = sidecar_factory("16Mi", [redis.url])
    c = client(proc, timeout=1.0)
    save(c, {key(1, "cpu"): b"c" * 4096})
    redis.proc.popen.send_signal(signal.SIGSTOP)
    try:
        for i in range(3):
            assert c.lookup([key(1, "cpu"), key(100 + i, "absent")]) == 1  # never a timeout
        assert "down" in c.readyz()[1] or not c.readyz()[0]
    finally:
        redis.proc.popen.send_signal(signal.SIGCONT)
    wait_until(lambda: c.readyz()[0], 30, "the shard to come back")


def test_two_promotions_of_one_key_at_once_both_get_it(sidecar_factory, redis) -> None:
    a, b = client(sidecar_factory("256Mi", [redis.url])), sidecar_factory("256Mi", [redis.url])
    chunks = {key(i, "twice"): payload(16 * 2**20, 400 + i) for i in range(3)}
    save(a, chunks)
    wait_until(lambda: redis_stats(a)["written"] == 3, 60, "write-behind")
    for k, v in chunks.items():
        results: list[dict] = []
        start = threading.Barrier(2)

        def promote(k: str, start: threading.Barrier, results: list[dict]) -> None:
            start.wait()
            results.append(load(client(b), [k]))

        threads = [threading.Thread(target=promote, args=(k, start, results)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [{k: v}, {k: v}]
    assert client(b).stats()["promotions"] == 3  # each fetched once


def test_a_pin_its_caller_gave_up_on_leaves_no_lease(sidecar_factory) -> None:
    """A client whose pin timed out releases the lease it named; should the release arrive before the
    sidecar got to the pin, the pin pins nothing, so no chunk stays pinned for --lease-seconds."""
    c = client(sidecar_factory("1Mi"))
    save(c, {key(1, "gave-up"): payload(CHUNK, 9)})
    lease = "ab" * 16
    c.release(lease)  # the client gave up first
    answer = c._control("pin", {"keys": [key(1, "gave-up")], "verify": True, "lease": lease})
    assert answer["slots"] == [] and c.stats()["pinned_leases"] == 0
    pinned = c.pin([key(1, "gave-up")])  # a pin under a new name works as ever
    assert [s.key for s in pinned.slots] == [key(1, "gave-up")]
    c.release(pinned.lease)
    assert c.stats()["pinned_leases"] == 0


def test_the_write_behind_keeps_every_rank_copy_of_a_chunk_or_none(tmp_path, redis) -> None:
    """The ranks of a TP engine commit their copies of a chunk one after another; with the backlog
    at its bound, a lone copy in Redis would be a miss that takes room. A group is admitted or
    dropped as a whole (the tier's queue, in process: its writer is not started)."""
    from kvpool_sidecar.arena import Arena
    from kvpool_sidecar.redis_tier import RedisTier
    from kvpool_sidecar.store import Store

    tier = RedisTier(Store(Arena(tmp_path / "arena", 2**20)), (redis.url,), queue_bytes=250)
    order = [("r0c0", "c0"), ("r0c1", "c1"), ("r1c0", "c0"), ("r1c1", "c1"), ("r0c2", "c2"), ("r1c2", "c2")]
    for name, group in order:  # 100 bytes each: by bytes alone, r1c0 and r1c1 would be dropped
        tier.saved(key(0, name), 100, key(0, group))
    queued = set()
    while not tier._queue.empty():
        queued.add(tier._queue.get_nowait()[1])
    assert queued == {key(0, n) for n in ("r0c0", "r1c0", "r0c1", "r1c1")}
    assert tier.counters.dropped == 2  # both copies of c2
    tier.close()


def test_lookups_are_answered_while_a_huge_batch_is_reserved(sidecar_factory) -> None:
    """A 65,536-key reserve (the largest batch) goes in frames of 4,096 keys, each decoded, run and
    answered off the event loop, taking the index's lock in slices: lookups, which run inside vLLM's
    schedule(), are answered within their 1 s timeout. (One 65,536-key frame held them ~1 s here.)"""
    proc = sidecar_factory("64Mi")
    c = client(proc, timeout=1.0)
    save(c, {key(1, "hot"): b"h" * 4096})
    big = client(proc, timeout=120)
    done = threading.Event()

    def reserve_all() -> None:
        try:
            big.reserve([(key(i, "huge"), 0) for i in range(65536)])
        finally:
            done.set()

    t = threading.Thread(target=reserve_all)
    t.start()
    answered = 0
    while not done.is_set():
        assert c.lookup([key(1, "hot")]) == 1  # never a timeout
        answered += 1
    t.join()
    assert answered > 0 and c.stats()["reserved_chunks"] == 65536
