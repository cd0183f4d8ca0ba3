"""A restarted sidecar keeps its cache: the arena file outlives the process (a pod's emptyDir,
--keep-arena) and the journal beside it names the chunks in it. Killed with SIGKILL in the middle
of a save, after evictions, a delete and bytes changed behind it, the new process adopts exactly
the chunks that were held and are whole, and serves every one byte for byte."""

from __future__ import annotations

import os
import signal

from sidecar_support import key, payload, save

from kvpool_sidecar.chunk_index import ChunkIndex
from kvpool_sidecar.client import SidecarClient
from kvpool_sidecar.journal import JOURNAL_FILE, MIN_COMPACT_BYTES, Journal, Record, encode, replay

CHUNK = 100_000


def test_a_sidecar_killed_mid_save_adopts_what_it_held_whole_and_nothing_else(sidecar_factory) -> None:
    proc = sidecar_factory("1Mi", [], "--keep-arena")  # room for 10 chunks
    arena_dir = proc.info["arena_dir"]
    c = SidecarClient(proc.info["url"], timeout=10, shm_path=str(arena_dir))
    chunks = {key(i, "r"): payload(CHUNK, i) for i in range(14)}
    keys = list(chunks)
    for k in keys[:12]:  # one at a time: the first ones are evicted to make room for the last
        save(c, {k: chunks[k]})
    c.delete(keys[11])  # deleted: must never come back
    corrupt = keys[10]
    slot_of_corrupt = c.pin([corrupt]).slots[0]
    (torn,) = c.reserve([(keys[12], CHUNK)])  # a save in flight at the kill: half written, uncommitted
    assert torn is not None
    c.arena()[torn.offset : torn.offset + CHUNK // 2] = chunks[keys[12]][: CHUNK // 2]
    held = [k for k in keys if c.lookup([k]) == 1]
    assert c.stats()["evictions"] > 0 and keys[0] not in held and corrupt in held
    proc.stop(signal.SIGKILL)
    with open(arena_dir / "arena", "r+b") as f:  # a byte changed behind the sidecar while it was down
        f.seek(slot_of_corrupt.offset + 7)
        f.write(b"\xff" if chunks[corrupt][7] != 0xFF else b"\x00")

    again = sidecar_factory("1Mi", [], "--keep-arena", port=proc.info["port"])
    c = SidecarClient(again.info["url"], timeout=10, shm_path=str(arena_dir))
    stats = c.stats()
    adopted = [k for k in held if k != corrupt]
    assert (stats["adopted"], stats["adoption_refused"], stats["chunks"]) == (len(adopted), 1, len(adopted))
    for k in keys:
        assert c.get(k) == (chunks[k] if k in adopted else None), f"chunk {keys.index(k)}"

    # and it journals on: a second kill keeps what this run stored too
    assert save(c, {keys[13]: chunks[keys[13]]}) == [keys[13]]
    again.stop(signal.SIGKILL)
    third = sidecar_factory("1Mi", [], "--keep-arena", port=proc.info["port"])
    c = SidecarClient(third.info["url"], timeout=10, shm_path=str(arena_dir))
    assert c.get(keys[13]) == chunks[keys[13]]
    assert c.stats()["adopted"] >= 1


def test_a_sidecar_without_keep_arena_leaves_no_journal(sidecar_factory) -> None:
    proc = sidecar_factory("1Mi", [])
    arena_dir = proc.info["arena_dir"]
    save(SidecarClient(proc.info["url"], timeout=10, shm_path=str(arena_dir)), {key(1): payload(CHUNK, 1)})
    assert (arena_dir / JOURNAL_FILE).exists()
    proc.stop()
    assert not (arena_dir / JOURNAL_FILE).exists() and not (arena_dir / "arena").exists()


def test_a_torn_last_record_ends_the_replay_and_what_came_before_stands(tmp_path) -> None:
    a, b = Record("a" * 32, 4096, 10, 1, 0), Record("b" * 32, 8192, 10, 2, 0)
    whole = encode(1, a) + encode(1, b) + encode(2, a)
    assert replay(whole) == {b.key: b}
    assert replay(whole[:-3]) == {a.key: a, b.key: b}  # the drop of a was torn: a still stands
    assert replay(b"\x01" + whole) == {}  # garbage from the start: nothing


def test_the_journal_is_rewritten_to_its_live_records_and_given_up_past_its_budget(tmp_path) -> None:
    journal = Journal(tmp_path / JOURNAL_FILE, budget=4 * MIN_COMPACT_BYTES)
    idx = ChunkIndex(1 << 30, 4096, clock=lambda: 0.0)
    journal.rewrite(())
    idx.journal = journal
    for i in range(5000):  # each stored, then dropped: the file never outgrows its live records much
        e = idx.reserve(f"{i:032x}", 100, 0, set())
        assert e is not None
        idx.store(e, i)
        if i % 10:
            idx.drop(e)
    assert os.path.getsize(journal.path) <= max(
        2 * 500 * len(encode(1, Record("0" * 32, 0, 0, 0, 0))), MIN_COMPACT_BYTES
    )
    assert set(journal.read()) == {f"{i:032x}" for i in range(0, 5000, 10)}

    # adoption skips an extent out of line or taken twice
    fresh = ChunkIndex(1 << 20, 4096, clock=lambda: 0.0)
    records = [
        Record("a" * 32, 4096, 100, 1, 0),
        Record("b" * 32, 4096 + 64, 100, 2, 0),
        Record("c" * 32, 4100, 8, 3, 0),
    ]
    assert fresh.adopt(records) == 1 and fresh.stored("a" * 32) is not None

    small = Journal(tmp_path / "small", budget=1000)
    small.rewrite(())
    for i in range(20):
        small.stored(Record(f"{i:032x}", 4096, 10, i, 0))
    assert not small.on and not small.path.exists() and small.read() == {}
