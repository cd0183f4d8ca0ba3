"""Capacity, eviction order, pins, leases and checksums, against the real sidecar process."""

from __future__ import annotations

import mmap
import os

from kvtest import wait_until
from sidecar_support import key, load, payload, save

from kvpool_sidecar.client import SidecarClient, Slot, checksum

CHUNK = 64 * 1024  # 16 of these fill 1 MiB exactly


def client(proc) -> SidecarClient:
    return SidecarClient(proc.info["url"], timeout=10, shm_path=str(proc.info["arena_dir"]))


def present(c: SidecarClient, keys: list[str]) -> set[str]:
    return {k for k in keys if c.lookup([k]) == 1}


def test_three_times_capacity_evicts_priority_then_age_and_never_a_pinned_chunk(sidecar_factory) -> None:
    proc = sidecar_factory("1Mi")
    c = client(proc)
    capacity = c.stats()["capacity_bytes"]
    pinned_key = key(0, "pinned")
    save(c, {pinned_key: payload(CHUNK, 0)}, priority=9)  # the worst priority, but pinned
    lease = c.pin([pinned_key])
    assert [s.key for s in lease.slots] == [pinned_key]

    low = [key(i, "low") for i in range(8)]
    high = [key(i, "high") for i in range(7)]
    for k in low:
        save(c, {k: payload(CHUNK, 1)}, priority=5)  # evicted first: a higher number is a lower priority
    for k in high:
        save(c, {k: payload(CHUNK, 2)}, priority=0)
    assert c.stats()["stored_bytes"] == capacity  # full

    written = 16 * CHUNK
    new = [key(i, "new") for i in range(40)]
    for i, k in enumerate(new):
        if i == 8:
            # priority first; and the lookups made every high chunk more recent than new[:8]
            assert present(c, low) == set() and present(c, high) == set(high)
        if i == 9:  # then the least recently used: new[0], not a chunk that was just looked up
            assert present(c, new[:1]) == set() and present(c, high) == set(high)
        assert save(c, {k: payload(CHUNK, 3 + i)}, priority=0) == [k]
        written += CHUNK
        stats = c.stats()
        assert stats["stored_bytes"] <= capacity
        assert pinned_key in present(c, [pinned_key])
    assert written >= 3 * capacity
    stats = c.stats()
    assert stats["evictions"] == 40 and stats["stored_bytes"] <= capacity
    arena = c.arena()
    (slot,) = lease.slots
    assert bytes(arena[slot.offset : slot.offset + slot.length]) == payload(CHUNK, 0)
    c.release(lease.lease)
    # released, it is the lowest priority left and goes next
    save(c, {key(1, "last"): payload(CHUNK, 99)})
    assert c.lookup([pinned_key]) == 0


def test_no_room_when_everything_is_pinned_or_reserved(sidecar_factory) -> None:
    proc = sidecar_factory("256Ki")
    c = client(proc)
    keys = [key(i, "full") for i in range(4)]
    save(c, {k: payload(CHUNK, i) for i, k in enumerate(keys)})
    lease = c.pin(keys)
    assert c.reserve([(key(9, "x"), CHUNK)]) == [None]
    assert c.put(key(9, "x"), b"y" * CHUNK) is False  # 507
    assert c.put(key(9, "x"), b"y" * (2**20)) is False  # larger than the whole arena
    c.release(lease.lease)
    assert c.put(key(9, "x"), b"y" * CHUNK) is True


def _three_saved(c: SidecarClient, tag: str) -> tuple[dict[str, bytes], list[str], list[Slot]]:
    """Three 100 kB chunks saved; their contents, keys and (pinned, then released) slots."""
    chunks = {key(i, tag): payload(100_000, i) for i in range(3)}
    keys = list(chunks)
    save(c, chunks)
    pinned = c.pin(keys)
    c.release(pinned.lease)
    return chunks, keys, pinned.slots


def _flip(proc, offset: int, mask: int) -> None:
    """Another process writes into the arena file, behind the sidecar's back."""
    fd = os.open(proc.info["arena_dir"] / "arena", os.O_RDWR)
    with mmap.mmap(fd, 0) as m:
        m[offset] ^= mask
    os.close(fd)


def test_bytes_changed_behind_the_sidecar_are_never_served_and_counted(sidecar_factory) -> None:
    proc = sidecar_factory("4Mi")
    c = client(proc)
    _, keys, slots = _three_saved(c, "cs")
    _flip(proc, slots[1].offset + 500, 0xFF)
    assert list(load(c, keys)) == keys[:1]  # the prefix stops before the changed chunk
    assert c.get(keys[1]) is None
    assert c.lookup(keys) == 1  # dropped from the index
    stats = c.stats()
    assert stats["corrupt_dropped"] == 1
    assert stats["stored_bytes"] == 200_000
    # the same through GET: change the first chunk, GET never returns it
    _flip(proc, slots[0].offset, 0x01)
    assert c.get(keys[0]) is None
    assert c.stats()["corrupt_dropped"] == 2


def test_pin_without_sidecar_check_hands_the_checksums_and_verify_drops_what_fails(sidecar_factory) -> None:
    """The connector's fast path: pin(verify=False) skips the sidecar's hash; the caller checks each
    slot against its checksum and sends the keys that fail to verify(), which drops and counts them."""
    proc = sidecar_factory("4Mi")
    c = client(proc)
    chunks, keys, slots = _three_saved(c, "cv")
    assert [s.checksum for s in slots] == [checksum(chunks[k]) for k in keys]
    _flip(proc, slots[1].offset + 7, 0xFF)
    arena = c.arena()
    fast = c.pin(keys, verify=False)
    assert [s.key for s in fast.slots] == keys  # handed out unchecked, with the saved checksums
    bad = [s.key for s in fast.slots if checksum(arena[s.offset : s.offset + s.length]) != s.checksum]
    assert bad == [keys[1]]
    assert c.verify(keys) == [keys[1]]  # the sidecar's own check decides, not the caller's word
    c.release(fast.lease)
    assert c.verify(keys) == []  # already gone
    stats = c.stats()
    assert stats["corrupt_dropped"] == 1 and stats["chunks"] == 2
    assert c.lookup(keys) == 1
    assert [s.key for s in c.pin(keys, verify=False).slots] == keys[:1]


def test_leases_and_reservations_expire_so_a_dead_client_leaks_nothing(sidecar_factory) -> None:
    proc = sidecar_factory("256Ki", [], "--lease-seconds", "2")
    c = client(proc)
    (slot,) = c.reserve([(key(1, "dead"), 256 * 1024)])  # the whole arena, never committed
    assert slot is not None
    assert c.reserve([(key(2, "dead"), CHUNK)]) == [None]
    wait_until(lambda: c.stats()["reservations_expired"] == 1, 10, "the reservation to expire")
    assert c.stats()["free_bytes"] == 256 * 1024
    assert c.commit([(slot, 0)]) == [False]  # too late: refused, nothing is committed
    assert c.stats()["refused_commits"] == 1
    assert c.lookup([key(1, "dead")]) == 0

    keys = [key(i, "pin") for i in range(4)]
    save(c, {k: payload(CHUNK, i) for i, k in enumerate(keys)})
    c.pin(keys)  # never released
    assert c.reserve([(key(5, "pin"), CHUNK)]) == [None]
    wait_until(lambda: c.stats()["leases_expired"] == 1, 10, "the lease to expire")
    assert c.reserve([(key(5, "pin"), CHUNK)])[0] is not None  # pins gone: evictable again


def test_the_index_is_bounded_in_chunks_not_only_in_bytes(sidecar_factory) -> None:
    """Tiny or empty chunks cost the index memory, not arena bytes: --max-chunks caps them. A flood of
    65,536 empty reservations in one batch gets at most that many, and later saves evict as usual."""
    proc = sidecar_factory("64Mi", [], "--max-chunks", "1000")
    c = client(proc)
    flood = c.reserve([(key(i, "flood"), 0) for i in range(65536)])
    assert sum(1 for s in flood if s is not None) == 1000
    c.abort([s for s in flood if s is not None])
    for batch in range(5):
        save(c, {key(batch * 1000 + i, "tiny"): b"t" for i in range(1000)})
    stats = c.stats()
    assert stats["chunks"] == 1000 and stats["evictions"] >= 4000
    assert c.lookup([key(4999, "tiny")]) == 1  # the newest stay
