"""Save, lookup, load round trips against the real sidecar process: through the arena and over HTTP."""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import threading

import pytest
from kvtest import start_sidecar
from sidecar_support import key, payload, reserved

from kvpool_sidecar.client import SidecarClient, checksum, read_answered
from kvpool_sidecar.client_errors import SidecarError
from kvpool_sidecar.wire import ARENA_HEADER_BYTES


def test_arena_round_trip_gives_identical_bytes(sidecar_factory) -> None:
    proc = sidecar_factory("16Mi")
    with SidecarClient(proc.info["url"], shm_path=str(proc.info["arena_dir"])) as c:
        chunks = {key(i): payload(100_000 + i, i) for i in range(8)}
        keys = list(chunks)
        assert c.lookup(keys) == 0
        slots = reserved(c, [(k, len(v)) for k, v in chunks.items()], priority=0)
        arena = c.arena()
        for s in slots:
            arena[s.offset : s.offset + s.length] = chunks[s.key]
        assert c.commit([(s, checksum(chunks[s.key])) for s in slots]) == [True] * len(slots)
        assert c.lookup(keys) == len(keys)
        assert c.lookup([*keys[:3], key(99), *keys[3:]]) == 3  # a prefix, not a count
        pinned = c.pin(keys)
        try:
            assert [s.key for s in pinned.slots] == keys
            for s in pinned.slots:
                assert bytes(arena[s.offset : s.offset + s.length]) == chunks[s.key]
        finally:
            c.release(pinned.lease)
        # the same bytes over HTTP
        assert c.get(keys[0]) == chunks[keys[0]]
        # reserving a stored key gives None: nothing to write
        assert c.reserve([(keys[0], 10)]) == [None]
        stats = c.stats()
        assert stats["chunks"] == 8
        assert stats["stored_bytes"] == sum(map(len, chunks.values()))
        assert stats["pinned_leases"] == 0


def test_http_round_trip_gives_identical_bytes(sidecar_factory) -> None:
    proc = sidecar_factory("16Mi")
    c = SidecarClient(proc.info["url"])
    data = payload(3 * 2**20 + 7, 3)
    k = key(1, "b")
    assert c.get(k) is None
    assert c.put(k, data) is True
    assert c.put(k, data) is True  # already there
    assert c.lookup([k]) == 1
    assert c.get(k) == data
    assert c.delete(k) is True
    assert c.delete(k) is False
    assert c.get(k) is None
    assert c.put(k, b"") is True and c.get(k) == b""
    c.close()


def test_arena_path_found_through_v1_arena_and_http_control(sidecar_factory, tmp_path) -> None:
    """Without shm_path the client asks GET /v1/arena; both control transports give the same result."""
    proc = sidecar_factory("8Mi")
    c = SidecarClient(proc.info["url"])
    info = c._json("GET", "/v1/arena")
    assert (
        info["path"] == str(proc.info["arena_dir"] / "arena")
        and info["size"] == ARENA_HEADER_BYTES + 8 * 2**20
    )
    (slot,) = reserved(c, [(key(5), 1000)])
    c.arena()[slot.offset : slot.offset + 1000] = b"x" * 1000
    assert c.commit([(slot, checksum(b"x" * 1000))]) == [True]
    # the HTTP transport of the same operations
    answer = c._json("POST", "/v1/arena/pin", {"keys": [key(5)]})
    expected = {
        "key": key(5),
        "offset": slot.offset,
        "length": 1000,
        "gen": 0,  # a pinned slot is no reservation
        "checksum": checksum(b"x" * 1000),
    }
    assert answer["slots"] == [expected]
    assert c._json("POST", "/v1/arena/verify", {"keys": [key(5)]}) == {"dropped": []}
    c._json("POST", "/v1/arena/release", {"lease": answer["lease"]})
    assert c.get(key(5)) == b"x" * 1000
    over_http = SidecarClient(proc.info["url"], control="http")
    assert c.lookup([key(5), key(6)]) == over_http.lookup([key(5), key(6)]) == 1
    assert c._sock is not None and over_http._sock is None  # the first went over the Unix socket
    over_http.close()
    c.close()


def test_arena_dir_too_deep_for_a_unix_socket_falls_back_to_http_control(tmp_path) -> None:
    """AF_UNIX paths stop at ~107 bytes: the sidecar then serves without the socket, never crashes."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    proc = start_sidecar(deep, "8Mi")
    try:
        c = SidecarClient(proc.info["url"], shm_path=str(proc.info["arena_dir"]))
        assert c._json("GET", "/v1/arena")["socket"] is None
        data = payload(5000, 7)
        (slot,) = reserved(c, [(key(9), len(data))])
        c.arena()[slot.offset : slot.offset + len(data)] = data
        c.commit([(slot, checksum(data))])
        assert c.lookup([key(9), key(10)]) == 1  # POST /v1/lookup when there is no socket
        pinned = c.pin([key(9)])
        assert [bytes(c.arena()[s.offset : s.offset + s.length]) for s in pinned.slots] == [data]
        c.release(pinned.lease)
        c.close()
    finally:
        proc.stop()


def test_abort_frees_the_reservation(sidecar_factory) -> None:
    proc = sidecar_factory("1Mi")
    c = SidecarClient(proc.info["url"])
    (slot,) = c.reserve([(key(1), 2**20)])
    assert slot is not None
    assert c.reserve([(key(2), 2**20)]) == [None]  # the reserved chunk is never evicted
    c.abort([slot])
    assert c.lookup([key(1)]) == 0
    assert c.reserve([(key(2), 2**20)])[0] is not None
    c.close()


def rank_workload(url: str, r: int) -> None:
    """What one tensor-parallel rank does: save a batch (one key shared by all ranks), pin, check, release."""
    c = SidecarClient(url, timeout=10)
    arena = c.arena()
    for round_ in range(20):
        keys = [key(r * 1000 + round_ * 10 + j, "c") for j in range(4)] + [key(round_, "d")]
        data = {k: (k.encode() * 200)[: 4096 + j] for j, k in enumerate(keys)}
        slots = c.reserve([(k, len(v)) for k, v in data.items()])
        for s in slots:
            if s is not None:
                arena[s.offset : s.offset + s.length] = data[s.key]
        c.commit([(s, checksum(data[s.key])) for s in slots if s is not None])
        pinned = c.pin(keys[:4])
        assert [s.key for s in pinned.slots] == keys[:4]
        for s in pinned.slots:
            assert checksum(arena[s.offset : s.offset + s.length]) == checksum(data[s.key])
        c.release(pinned.lease)
    c.close()


def test_many_clients_at_once_threads_and_processes(sidecar_factory) -> None:
    """One client per TP rank: 3 threads here and 3 other processes, saving and loading at once."""
    proc = sidecar_factory("32Mi")
    url = proc.info["url"]
    errors: list[BaseException] = []

    def thread_rank(r: int) -> None:
        try:
            rank_workload(url, r)
        except BaseException as e:
            errors.append(e)

    ctx = multiprocessing.get_context("spawn")
    processes = [ctx.Process(target=rank_workload, args=(url, r)) for r in range(3, 6)]
    threads = [threading.Thread(target=thread_rank, args=(r,)) for r in range(3)]
    for p in processes:
        p.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in processes:
        p.join(60)
    assert not errors, errors
    assert [p.exitcode for p in processes] == [0, 0, 0]
    stats = SidecarClient(url).stats()
    assert (
        stats["chunks"] == 6 * 20 * 4 + 20 and stats["pinned_leases"] == 0 and stats["reserved_chunks"] == 0
    )


def test_unreachable_sidecar_is_a_sidecar_error() -> None:
    from kvtest import free_port

    c = SidecarClient(f"http://127.0.0.1:{free_port()}", timeout=0.5)
    assert c.healthz() is False
    with pytest.raises(SidecarError):
        c.lookup([key(1)])
    with pytest.raises(SidecarError):
        c.reserve([(key(1), 10)])


def test_client_survives_a_sidecar_restart(sidecar_factory) -> None:
    """A restarted sidecar keeps the arena file (--keep-arena, as the operator injects it) and the
    chunks in it, has a new socket: the same client carries on."""
    from kvtest import start_sidecar

    proc = sidecar_factory("8Mi", (), "--keep-arena")
    arena_dir = proc.info["arena_dir"]
    c = SidecarClient(proc.info["url"], timeout=5, shm_path=str(arena_dir))
    (slot,) = reserved(c, [(key(1, "e"), 1000)])
    c.arena()[slot.offset : slot.offset + 1000] = b"1" * 1000
    c.commit([(slot, checksum(b"1" * 1000))])
    inode = os.stat(arena_dir / "arena").st_ino
    proc.stop()
    with pytest.raises(SidecarError):
        c.lookup([key(1, "e")])
    again = start_sidecar(arena_dir.parent, "8Mi", [], "--keep-arena", port=proc.info["port"])
    try:
        assert os.stat(arena_dir / "arena").st_ino == inode  # the same file: mappings stay valid
        assert c.get(key(1, "e")) == b"1" * 1000  # adopted: the journal names it, its checksum holds
        (slot,) = reserved(c, [(key(2, "e"), 1000)])
        c.arena()[slot.offset : slot.offset + 1000] = b"2" * 1000
        assert c.commit([(slot, checksum(b"2" * 1000))]) == [True]
        pinned = c.pin([key(2, "e")])
        s = pinned.slots[0]
        assert bytes(c.arena()[s.offset : s.offset + s.length]) == b"2" * 1000
        c.release(pinned.lease)
        assert c.get(key(2, "e")) == b"2" * 1000
    finally:
        again.stop()


def test_engine_reports_are_kept_for_stats_latest_first_and_bounded(api) -> None:
    """What each vLLM engine says of itself at start (kvpool on or off, shared or not) is in /stats for
    the operator; a restarted engine replaces its report; bad reports are refused."""

    def report(engine: str, body: dict) -> int:
        return api.put(f"/v1/engines/{engine}", json=body).status_code

    assert api.get("/stats").json()["engines"] == {}
    assert report("dp0", {"cache": "off", "reason": "MambaSpec", "model": "q"}) == 204
    assert report("dp0", {"cache": "on", "shared": False, "reason": "weights unread", "model": "m"}) == 204
    assert api.get("/stats").json()["engines"] == {
        "dp0": {"cache": "on", "shared": False, "reason": "weights unread", "model": "m"}
    }
    for engine, body in (
        ("dp%200", {"cache": "on"}),
        ("dp1", {"cache": "maybe"}),
        ("dp1", {"cache": "on", "x": 1}),
    ):
        assert report(engine, body) == 422
    for i in range(70):
        report(f"dp{i}", {"cache": "on"})
    engines = api.get("/stats").json()["engines"]
    assert len(engines) == 64 and "dp69" in engines and "dp0" not in engines


def test_a_connection_the_sidecar_closed_while_idle_is_tried_once_more_on_a_new_one(tmp_path) -> None:
    """The client keeps idle connections (HTTP and the control socket); after the sidecar restarts they
    are dead, and the next call finds out only when it sends. That one call is tried again on a new
    connection (the client's one retry policy), so a restart costs no error."""
    directory = tmp_path / "kept"
    proc = start_sidecar(tmp_path, "1Mi", [], "--arena-dir", str(directory), "--keep-arena")
    port = proc.info["port"]
    c = SidecarClient(proc.info["url"], timeout=5, shm_path=str(directory))
    try:
        assert c.put(key(1, "before"), b"x") and c.lookup([key(1, "before")]) == 1  # both pools hold one
    finally:
        proc.stop()
    proc = start_sidecar(tmp_path, "1Mi", [], "--arena-dir", str(directory), port=port)
    try:
        assert c.lookup([key(1, "before")]) == 1  # over the socket: the new sidecar adopted it
        assert c.put(key(2, "after"), b"y")  # over HTTP
    finally:
        c.close()
        proc.stop()


def test_sent_lookups_answered_so_far_are_read_ahead_without_waiting_for_the_rest(tmp_path) -> None:
    """read_answered reads the answers already in their sockets and waits for no other: a sidecar that
    has not answered yet (stopped here) leaves its lookup to be read when asked. An answer read ahead
    is the one answer() gives; a failure read ahead (the sidecar killed) is raised by answer()."""
    proc = start_sidecar(tmp_path, "1Mi")
    c = SidecarClient(proc.info["url"], timeout=5, shm_path=str(proc.info["arena_dir"]))
    keys, tails = [key(1, "r"), key(2, "r")], [[key(3, "r")], [key(1, "r")]]
    try:
        assert c.put(key(1, "r"), b"x")
        answered = c.send_lookup(keys, 1, tails)
        assert answered is not None
        assert select.select([answered], [], [], 5)[0]  # its answer is in the socket
        proc.popen.send_signal(signal.SIGSTOP)
        waiting = c.send_lookup(keys, 0, [])  # the stopped sidecar answers nothing
        assert waiting is not None
        read_answered([answered, waiting])
        assert answered.answered and not waiting.answered
        proc.popen.send_signal(signal.SIGCONT)
        assert answered.answer() == (1, 1)
        assert select.select([waiting], [], [], 5)[0]
        read_answered([waiting])
        assert waiting.answered and waiting.answer() == (1, None)
        proc.popen.send_signal(signal.SIGSTOP)
        failing = c.send_lookup(keys, 1, tails)  # never answered
        assert failing is not None
        proc.kill()
        assert select.select([failing], [], [], 5)[0]  # the closed socket is readable
        read_answered([failing])
        assert failing.answered
        with pytest.raises(SidecarError):
            failing.answer()
    finally:
        proc.popen.send_signal(signal.SIGCONT)
        c.close()
        proc.stop()


def test_a_sent_lookup_is_answered_while_the_caller_works_and_a_restart_costs_no_error(tmp_path) -> None:
    """send_lookup returns once the lookup is sent; its answer waits in the socket until read. A lookup
    dropped unread costs its connection, not the client's next call. One sent on a connection the
    sidecar closed while idle (a restart) is asked again on a new one: the same answer."""
    directory = tmp_path / "kept"
    proc = start_sidecar(tmp_path, "1Mi", [], "--arena-dir", str(directory), "--keep-arena")
    port = proc.info["port"]
    c = SidecarClient(proc.info["url"], timeout=5, shm_path=str(directory))
    keys, tails = [key(1, "a"), key(2, "a")], [[key(3, "a")], [key(1, "a")]]
    try:
        assert c.put(key(1, "a"), b"x")
        sent = c.send_lookup(keys, 1, tails)
        assert sent is not None
        assert sent.answer() == (1, 1) == c.lookup_then_first_whole(keys, 1, tails)
        c.send_lookup(keys, 1, tails).drop()  # type: ignore[union-attr]
        assert c.lookup(keys) == 1
    finally:
        proc.stop()
    proc = start_sidecar(tmp_path, "1Mi", [], "--arena-dir", str(directory), port=port)
    try:
        sent = c.send_lookup(keys, 1, tails)  # on the connection the old sidecar closed
        assert sent is not None and sent.answer() == (1, 1)
    finally:
        c.close()
        proc.stop()
