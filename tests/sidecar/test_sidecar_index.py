"""The CPU tier's index in process, with its clock in the test's hands: fencing by generation,
expiry, leases released before their pin, recency, priority, and the bound on chunks."""

from __future__ import annotations

from kvpool_sidecar.chunk_index import ChunkIndex
from kvpool_sidecar.wire import Slot


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def index(capacity: int = 64 * 1024, **kw) -> tuple[ChunkIndex, Clock]:
    clock = Clock()
    return ChunkIndex(capacity, 4096, lease_seconds=10.0, clock=clock, **kw), clock


def slot_of(e) -> Slot:
    return Slot(e.key, e.offset, e.length, gen=e.gen)


def test_a_commit_must_echo_the_reservation_it_was_given() -> None:
    idx, _ = index()
    e = idx.reserve("a" * 32, 1000, 0, set())
    assert e is not None and e.offset >= 4096  # chunks start after the arena's header
    assert idx.commit(Slot(e.key, e.offset, e.length, gen=e.gen + 1), 7) is None  # another generation
    assert idx.commit(Slot(e.key, e.offset + 64, e.length, gen=e.gen), 7) is None  # another place
    assert idx.counters.refused_commits == 2
    assert idx.commit(slot_of(e), 7) is e and idx.stored("a" * 32) is e


def test_an_expired_reservation_is_refused_before_the_reaper_runs_and_its_room_reused() -> None:
    idx, clock = index(capacity=1024)
    old = idx.reserve("a" * 32, 1024, 0, set())
    assert old is not None
    clock.now += 10.0  # its deadline
    assert not idx.renew(slot_of(old)) and idx.commit(slot_of(old), 1) is None
    idx.reap()
    new = idx.reserve("b" * 32, 1024, 0, set())
    assert new is not None and new.offset == old.offset and new.gen != old.gen
    assert idx.commit(slot_of(old), 1) is None  # the stale writer, again: still refused
    assert idx.commit(slot_of(new), 2) is new


def test_a_streamed_body_that_keeps_coming_keeps_its_reservation() -> None:
    idx, clock = index()
    e = idx.reserve("a" * 32, 100, 0, set())
    for _ in range(5):
        clock.now += 9.0
        assert idx.renew(slot_of(e))
    assert idx.commit(slot_of(e), 3) is e


def test_a_lease_released_before_its_pin_pins_nothing() -> None:
    idx, _ = index()
    assert idx.release("ab" * 16) is False
    assert idx.lease("ab" * 16, []) is None
    lease = idx.lease("cd" * 16, [])
    assert lease is not None and idx.lease("cd" * 16, []) is None  # a name in use
    e = idx.reserve("a" * 32, 100, 0, set())
    assert e is not None
    idx.commit(slot_of(e), 1)
    assert idx.pin_into(e, lease) and e.pins == 1
    assert idx.release("cd" * 16) and e.pins == 0
    assert not idx.pin_into(e, lease)  # a promotion finishing after the release pins nothing


def test_a_chunk_saved_again_counts_as_used() -> None:
    """A hot prefix that every request saves again stays recent, as one every request looks up does."""
    idx, _ = index(capacity=3 * 1024)
    keys = [c * 32 for c in "abc"]
    for i, k in enumerate(keys):
        idx.commit(slot_of(idx.reserve(k, 1024, 0, set())), i)
    assert idx.reserve(keys[0], 1024, 0, set()) is None  # stored: nothing to write, but now recent
    assert idx.reserve("d" * 32, 1024, 0, set()) is not None  # evicts keys[1], not the oldest saved
    assert idx.stored(keys[0]) and idx.stored(keys[1]) is None


def test_eviction_takes_the_worst_priority_then_the_least_recent_never_a_pinned_one() -> None:
    idx, _ = index(capacity=4 * 1024)
    keys = [c * 32 for c in "abcd"]
    for i, k in enumerate(keys):
        e = idx.reserve(k, 1024, 5 if i == 0 else 0, set())
        idx.commit(slot_of(e), i)
    pinned = idx.stored(keys[1])
    assert pinned is not None
    idx.pin(pinned)  # pinned: never evicted
    assert idx.prefix([keys[2]], touch=True) == 1  # a lookup: keys[2] is now the most recent
    assert idx.reserve("e" * 32, 1024, 0, set()) is not None  # evicts keys[0]: priority 5 goes first
    assert idx.stored(keys[0]) is None
    assert idx.reserve("f" * 32, 1024, 0, set()) is not None  # then keys[3]: keys[1] pinned, [2] recent
    assert idx.stored(keys[3]) is None and idx.stored(keys[1]) and idx.stored(keys[2])
    assert idx.counters.evictions >= 2


def test_the_index_holds_at_most_max_chunks() -> None:
    idx, _ = index(capacity=1 << 20, max_chunks=3)
    for c in "abcde":
        e = idx.reserve(c * 32, 0, 0, set())
        idx.commit(slot_of(e), 0)
    assert idx.snapshot()["chunks"] == 3 and idx.stored("a" * 32) is None and idx.stored("e" * 32)
    for c in "xyz":  # reservations count too: three, the stored ones evicted for them
        assert idx.reserve(c * 32, 0, 0, set()) is not None
    assert idx.reserve("w" * 32, 0, 0, set()) is None  # nothing left to evict: only reservations


def test_a_block_prefix_key_finds_the_stored_chunk_that_holds_it_until_that_chunk_goes() -> None:
    idx, _ = index(capacity=2048, max_chunks=4)
    full, p1, p2, p3, p4, p5 = "f" * 32, "1" * 32, "2" * 32, "3" * 32, "4" * 32, "5" * 32
    e = idx.reserve(full, 1024, 0, set(), prefixes=[p1, p2])
    assert e is not None and idx.loadable(p1) is None  # reserved: not loadable by any name yet
    idx.commit(slot_of(e), 7)
    assert idx.loadable(p1) is e and idx.loadable(p2) is e and idx.stored(p1) is None
    # the bound: prefix keys held, reserved or stored, are at most max_chunks (4): two more fit
    other = idx.reserve("o" * 32, 512, 0, set(), prefixes=[p1, p3, p4, p5])
    assert other is not None and other.prefixes == (p1, p3)
    idx.commit(slot_of(other), 8)
    assert idx.loadable(p1) is e  # the first chunk stored keeps the prefix
    assert other.prefixes == (p3,) and idx.loadable(p4) is None
    pending = idx.reserve("p" * 32, 0, 0, set(), prefixes=["6" * 32, "7" * 32])  # p1's place came back
    assert pending is not None and pending.prefixes == ("6" * 32,)
    full_up = idx.reserve("q" * 32, 0, 0, set(), prefixes=["8" * 32])
    assert full_up is not None and full_up.prefixes == ()  # reserved all the same, only without
    idx.drop(e)  # evicted or corrupt: its prefixes find nothing any more, and free their places
    assert idx.loadable(p1) is None and idx.loadable(p2) is None
    assert idx.loadable(p3) is other
    later = idx.reserve("r" * 32, 0, 0, set(), prefixes=[p4, p5, "9" * 32])
    assert later is not None and later.prefixes == (p4, p5)
