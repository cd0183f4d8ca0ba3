"""The worker half against the real sidecar process: save chunks from a paged cache, load them into
another one, bit-exact; a chunk the sidecar cannot serve becomes load errors, never bytes."""

from __future__ import annotations

import logging
import mmap
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from workerkit import Layers, chunk_ops, in_anonymous_memory, make_layers, run_loads, save

from kvpool_connector import save_process, saver
from kvpool_connector.affinity import SAVE_NICENESS
from kvpool_connector.breaker import BREAKER_SECONDS, Breaker
from kvpool_connector.common import ChunkOp, LoadSpec, SaveSpec, StepPlan
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.keys import rank_key
from kvpool_connector.saver import FENCE_SECONDS, SaveJob, SaveQueue
from kvpool_connector.shared_kv import on_huge_pages
from kvpool_connector.worker import KVPoolWorker
from kvpool_sidecar.client import SidecarClient


def _two_workers(url: str, seed: int, **config: Any) -> tuple[KVPoolWorker, KVPoolWorker, Layers, Layers]:
    """A worker whose cache holds random KV, and one whose cache is zeros, on the same sidecar."""
    cfg = KVPoolConfig(sidecar_url=url, chunk_size=64, **config)
    src, dst = KVPoolWorker(cfg, rank=0), KVPoolWorker(cfg, rank=0)
    src_layers, dst_layers = make_layers(seed), make_layers(None)
    src.register_kv_caches(src_layers)
    dst.register_kv_caches(dst_layers)
    return src, dst, src_layers, dst_layers


def test_save_then_load_is_exact_and_misses_become_load_errors(sidecar_factory) -> None:
    proc = sidecar_factory("16Mi")
    src, dst, src_layers, dst_layers = _two_workers(proc.info["url"], seed=1)

    saves = chunk_ops([[3, 7], [1, 12], [5, 6]])
    meta = StepPlan(saves=[SaveSpec("a", 0, saves)])
    save(src, meta)
    assert (src.take_stats() or {})["saved_chunks"] == 3

    # the third chunk disappears from the sidecar: its blocks must be reported, the rest loaded
    client = SidecarClient(proc.info["url"], timeout=5)
    assert client.delete(rank_key(saves[2].link, 0))
    loads = [ChunkOp(op.link, 2, ids) for op, ids in zip(saves, [[0, 2], [4, 8], [9, 10]], strict=True)]
    assert run_loads(dst, StepPlan(loads=[LoadSpec("b", loads)])) == {9, 10}
    for (_, s), (_, d) in zip(src_layers, dst_layers, strict=True):
        for sb, db in [(3, 0), (7, 2), (1, 4), (12, 8)]:
            assert torch.equal(s[sb], d[db])
        assert not d[9].any() and not d[10].any()

    # a load of the second block of a chunk only (behind vLLM's own prefix hit)
    meta = StepPlan(loads=[LoadSpec("c", [ChunkOp(saves[0].link, 2, [15], first_block=1)])])
    assert run_loads(dst, meta) == set()
    for (_, s), (_, d) in zip(src_layers, dst_layers, strict=True):
        assert torch.equal(s[7], d[15])


def test_other_rank_sees_nothing_and_dead_sidecar_is_errors_not_exceptions(sidecar_factory) -> None:
    proc = sidecar_factory("16Mi")
    cfg = KVPoolConfig(sidecar_url=proc.info["url"], chunk_size=64, timeout_ms=300)
    w0, w1 = KVPoolWorker(cfg, rank=0), KVPoolWorker(cfg, rank=1)
    w0.register_kv_caches(make_layers(2))
    w1.register_kv_caches(make_layers(None))
    ops = chunk_ops([[0, 1]])
    meta = StepPlan(saves=[SaveSpec("a", 0, ops)])
    save(w0, meta)
    meta = StepPlan(loads=[LoadSpec("a", ops)])
    assert run_loads(w1, meta) == {0, 1}  # rank 1's key differs from rank 0's
    proc.kill()
    assert run_loads(w0, meta) == {0, 1}
    save(w0, StepPlan(saves=[SaveSpec("x", 0, chunk_ops([[2, 3]]))]))  # no exception
    assert (w0.take_stats() or {})["sidecar_errors"] >= 2


def test_a_hung_sidecar_costs_one_save_timeout_then_saves_skip_it_until_the_breaker_closes(
    sidecar_factory,
) -> None:
    """A step's saves run on the save thread: with the sidecar hung, one save waits out its timeout
    there; the next steps' saves are skipped without asking (else the queue would fill with waits)."""
    proc = sidecar_factory("16Mi")
    w = KVPoolWorker(KVPoolConfig(sidecar_url=proc.info["url"], chunk_size=64, timeout_ms=300), rank=0)
    w.register_kv_caches(make_layers(4))
    now = [0.0]
    w._save_breaker = Breaker(lambda: now[0])
    proc.popen.send_signal(signal.SIGSTOP)
    try:
        save(w, StepPlan(saves=[SaveSpec("a", 0, chunk_ops([[0, 1]]))]))
        stats = w.take_stats() or {}
        assert (stats["sidecar_errors"], stats.get("saved_chunks", 0)) == (1, 0)
        save(w, StepPlan(saves=[SaveSpec("b", 0, chunk_ops([[2, 3]]))]))
        stats = w.take_stats() or {}  # not asked: asking a stopped sidecar would have timed out again
        assert (stats.get("sidecar_errors", 0), stats["save_skipped_chunks"]) == (0, 1)
    finally:
        proc.popen.send_signal(signal.SIGCONT)
    now[0] += BREAKER_SECONDS
    save(w, StepPlan(saves=[SaveSpec("c", 0, chunk_ops([[4, 5]]))]))
    assert (w.take_stats() or {})["saved_chunks"] == 1


def test_a_step_reusing_blocks_waits_for_their_saves_and_a_hung_sidecars_saves_are_dropped(
    sidecar_factory,
) -> None:
    """Saves copy from vLLM's blocks on the save thread, after the step. Before a step writes blocks
    a save has not read yet (vLLM handed them out again), the fence waits for that save; with the
    sidecar hung it drops the save instead, so the blocks' new KV is never stored as the old chunk."""
    proc = sidecar_factory("16Mi")
    cfg = KVPoolConfig(sidecar_url=proc.info["url"], chunk_size=64, timeout_ms=10_000)
    src, dst = KVPoolWorker(cfg, rank=0), KVPoolWorker(cfg, rank=0)
    src_layers, dst_layers = make_layers(6), make_layers(None)
    src.register_kv_caches(src_layers)
    dst.register_kv_caches(dst_layers)
    before = [t.clone() for _, t in src_layers]

    def reuse(blocks: list[int]) -> None:  # the next step's forward writes other KV into them
        for _, t in src_layers:
            t[blocks] = torch.randn_like(t[blocks])

    kept, dropped = chunk_ops([[3, 7], [5, 6]])
    src.finish_step(StepPlan(saves=[SaveSpec("a", 0, [kept])], step=1))
    src.begin_step(StepPlan(fence=1, step=2))
    reuse([3, 7])
    proc.popen.send_signal(signal.SIGSTOP)
    try:
        src.finish_step(StepPlan(saves=[SaveSpec("b", 0, [dropped])], step=3))
        src.begin_step(StepPlan(fence=3, step=4))  # waits FENCE_SECONDS at most, then drops it
        reuse([5, 6])
    finally:
        proc.popen.send_signal(signal.SIGCONT)
    assert src.saver.drain(30)
    stats = src.take_stats() or {}
    assert (stats["saved_chunks"], stats["save_fenced_chunks"]) == (1, 1)
    assert stats["save_fence_seconds"] >= FENCE_SECONDS  # the hung sidecar's wait, on the step
    client = SidecarClient(proc.info["url"], timeout=5)
    assert client.lookup([rank_key(dropped.link, 0)]) == 0
    assert client.stats()["reserved_chunks"] == 0  # its reservation was given back
    meta = StepPlan(loads=[LoadSpec("c", [ChunkOp(kept.link, 2, [0, 1])])])
    assert run_loads(dst, meta) == set()
    for old, (_, d) in zip(before, dst_layers, strict=True):  # the KV of the step that saved it
        assert torch.equal(old[3], d[0]) and torch.equal(old[7], d[1])


def test_a_steps_saves_start_when_the_next_step_begins_not_as_it_ends(monkeypatch) -> None:
    """A step ends as the engine hands its output on and schedules the next one: a save thread starting
    then would take the GIL and a CPU from that. Its saves wait for the next step to begin (or, with no
    next step, for HOLD_SECONDS)."""
    monkeypatch.setattr(saver, "HOLD_SECONDS", 30.0)
    started = threading.Event()
    queue = SaveQueue(lambda job: started.set())
    queue.note(1)
    assert queue.put(SaveJob(1, ["a chunk"], reads_blocks=True))
    assert not started.wait(0.5)  # step 1 has ended, step 2 has not begun
    queue.begin(2)
    assert started.wait(10)
    assert queue.drain(10) and queue.saved_through() == 1
    queue.close()


def test_steps_that_queue_no_saves_leave_the_save_thread_asleep() -> None:
    """Each wake of the save thread is a turn at vLLM's GIL on the step's path, and every step begins
    and ends: only a step that queues saves, or one that lets held saves start, may wake it."""
    wakes: list[int] = []  # a return from Condition.wait on the save thread: it woke

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "return" and frame.f_code is threading.Condition.wait.__code__:
            wakes.append(1)

    threading.setprofile(profile)  # the save thread, started by the first put, runs under it
    try:
        queue = SaveQueue(lambda job: None)
        queue.note(1)
        assert queue.put(SaveJob(1, ["a chunk"], reads_blocks=True))
    finally:
        threading.setprofile(None)  # None removes it
    queue.begin(2)
    assert queue.drain(10)  # its last wake (step 2 began) came before the save it let start
    woke = len(wakes)
    for step in range(2, 202):  # decode steps: nothing to save
        queue.begin(step)
        queue.note(step)
    deadline = time.monotonic() + 0.5  # watched this long: a thread woken would have run by then
    while time.monotonic() < deadline and len(wakes) == woke:
        time.sleep(0.01)
    assert len(wakes) == woke, f"the save thread woke {len(wakes) - woke} times"
    assert queue.saved_through() == 201
    queue.close()


def test_corrupt_chunk_is_caught_by_the_copy_thread_and_dropped_by_the_sidecar(sidecar_factory) -> None:
    """The worker pins without the sidecar's check and verifies each chunk after copying it: a chunk
    changed in the arena (and the request's chunks after it) become load errors; the sidecar re-checks
    and drops it."""
    proc = sidecar_factory("16Mi")
    src, dst, src_layers, dst_layers = _two_workers(proc.info["url"], seed=3)
    saves = chunk_ops([[0, 1], [2, 3], [4, 5]])
    save(src, StepPlan(saves=[SaveSpec("a", 0, saves)]))
    client = SidecarClient(proc.info["url"], timeout=5)
    keys = [rank_key(op.link, 0) for op in saves]
    pinned = client.pin(keys)
    client.arena()[pinned.slots[1].offset + 100] ^= 0x01  # behind the sidecar's back
    client.release(pinned.lease)

    meta = StepPlan(loads=[LoadSpec("b", chunk_ops([[6, 7], [8, 9], [10, 11]]))])
    assert run_loads(dst, meta) == {8, 9, 10, 11}
    for (_, s), (_, d) in zip(src_layers, dst_layers, strict=True):
        assert torch.equal(s[0], d[6]) and torch.equal(s[1], d[7])
    stats = dst.take_stats() or {}
    assert stats["corrupt_chunks"] == 1 and stats["loaded_chunks"] == 1
    assert client.stats()["corrupt_dropped"] == 1
    assert client.lookup(keys) == 1


def test_an_in_step_load_lands_before_the_forward_and_a_failed_one_keeps_none_of_the_steps_saves(
    sidecar_factory,
) -> None:
    """sync_loads: start_load returns once the step's loads have landed (the forward reads them next);
    their failed blocks go to vLLM with this step's output and the request is never reported finished.
    The step computed over the failed blocks (vLLM drops its output for the requests on them), so none
    of its saves is kept, a prefix hit's sharing a block included."""
    proc = sidecar_factory("16Mi")
    src, dst, src_layers, dst_layers = _two_workers(proc.info["url"], seed=4)
    saves = chunk_ops([[0, 1], [2, 3]])
    save(src, StepPlan(saves=[SaveSpec("a", 0, saves)], step=1))
    client = SidecarClient(proc.info["url"], timeout=5)

    good = StepPlan(loads=[LoadSpec("b", chunk_ops([[6, 7]]), in_step=True)], step=1)
    dst.start_load(good)
    for (_, s), (_, d) in zip(src_layers, dst_layers, strict=True):  # landed, no get_finished needed
        assert torch.equal(s[0], d[6]) and torch.equal(s[1], d[7])
    assert dst.get_finished() == set() and dst.take_load_errors() == set()

    keys = [rank_key(op.link, 0) for op in saves]
    pinned = client.pin(keys)
    client.arena()[pinned.slots[1].offset + 100] ^= 0x01  # behind the sidecar's back
    client.release(pinned.lease)
    written = chunk_ops([[12, 13], [14, 15], [8, 9]])[2:]  # a chunk the step computes, after the load
    bad = StepPlan(
        loads=[LoadSpec("c", chunk_ops([[8, 9], [10, 11]]), in_step=True)],
        saves=[SaveSpec("c", 0, written)],
        step=2,
    )
    dst.start_load(bad)
    assert dst.get_finished() == set()
    assert dst.take_load_errors() == {10, 11}
    save(dst, bad)
    assert client.lookup([rank_key(written[0].link, 0)]) == 0, (
        "a save of the step that failed to load was kept"
    )
    assert (dst.take_stats() or {})["save_skipped_chunks"] == 1
    save(dst, StepPlan(saves=[SaveSpec("d", 0, written)], step=3))  # the next step saves again
    assert client.lookup([rank_key(written[0].link, 0)]) == 1


def _save_and_load_threads(url: str, seed: int) -> tuple[int, int, int]:
    """Saves a chunk with one worker and loads it with another, as vLLM's thread would; the native ids
    of the save thread and the load thread that did it, and the save process's pid."""
    src, dst, _, _ = _two_workers(url, seed)
    saves = chunk_ops([[0, 1]])
    save(src, StepPlan(saves=[SaveSpec("a", 0, saves)], step=1))
    assert run_loads(dst, StepPlan(loads=[LoadSpec("b", saves)])) == set()
    (loader,) = dst.loader._thread._threads
    saver = src.saver._thread
    assert saver is not None and saver.native_id is not None and loader.native_id is not None
    assert src._save_process is not None
    return saver.native_id, loader.native_id, src._save_process.pid


def test_the_save_and_load_threads_leave_the_cores_the_forward_is_bound_to(sidecar_factory) -> None:
    """A CPU engine binds vLLM's thread to its compute cores (VLLM_CPU_OMP_THREADS_BIND) and the
    threads it starts inherit that: kvpool's must move off them, or its copies take turns with the
    forward instead of overlapping it."""
    assert len(os.sched_getaffinity(0)) >= 2, "needs two cores, as CI has"
    proc = sidecar_factory("16Mi")
    allowed = os.sched_getaffinity(0)
    compute = min(allowed)
    os.sched_setaffinity(0, {compute})  # as vLLM binds its thread
    try:
        names = ("save thread", "load thread", "save process")
        for name, tid in zip(names, _save_and_load_threads(proc.info["url"], seed=5), strict=True):
            assert compute not in os.sched_getaffinity(tid), f"the {name} runs on the compute core"
    finally:
        os.sched_setaffinity(0, allowed)


def test_the_save_and_load_threads_are_named_where_the_os_shows_threads(sidecar_factory) -> None:
    """`top -H` and /proc tell kvpool's threads from vLLM's: without a name of their own, every thread
    of a vLLM process is "python"."""
    proc = sidecar_factory("16Mi")
    saver, loader, _ = _save_and_load_threads(proc.info["url"], seed=9)
    comm = {tid: Path(f"/proc/{os.getpid()}/task/{tid}/comm").read_text().strip() for tid in (saver, loader)}
    assert comm == {saver: "kvpool-save", loader: "kvpool-load_0"}


def test_the_save_thread_yields_the_cpu_to_vllms_threads_the_load_thread_does_not(sidecar_factory) -> None:
    """A save waits for nothing in the step, so on cores it shares with vLLM's API server and engine
    (a CPU engine's other cores) it runs below them: the first token reaches the client first. A load
    is on a returning user's TTFT and keeps vLLM's priority."""
    proc = sidecar_factory("16Mi")
    saver, loader, process = _save_and_load_threads(proc.info["url"], seed=7)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert os.getpriority(os.PRIO_PROCESS, saver) == min(19, mine + SAVE_NICENESS)
    assert os.getpriority(os.PRIO_PROCESS, process) == min(19, mine + SAVE_NICENESS)
    assert os.getpriority(os.PRIO_PROCESS, loader) == mine


def test_the_save_and_load_threads_copy_on_one_thread_not_the_forwards_openmp_team(sidecar_factory) -> None:
    """A CPU engine sets torch's thread count to its compute cores, and a thread it starts takes that
    count: each of kvpool's copies would then start an OpenMP team that large on the one core left to
    it (a 4 MiB save took over 250 ms instead of about 1). kvpool's threads copy on themselves alone, and
    vLLM's thread keeps its team."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # as vLLM's CPU worker does for two compute cores
    try:
        proc = sidecar_factory("16Mi")
        src, dst, _, _ = _two_workers(proc.info["url"], seed=6, save_process=False)  # saves on the thread
        seen: dict[str, int] = {}
        save_cpu = src.io.save_cpu

        def counted(chunk: torch.Tensor, op: ChunkOp) -> int:
            seen["save"] = torch.get_num_threads()
            return save_cpu(chunk, op)

        src.io.save_cpu = counted  # type: ignore[method-assign]
        saves = chunk_ops([[0, 1]])
        save(src, StepPlan(saves=[SaveSpec("a", 0, saves)], step=1))
        assert run_loads(dst, StepPlan(loads=[LoadSpec("b", saves)])) == set()
        seen["load"] = dst.loader._thread.submit(torch.get_num_threads).result()
        assert seen == {"save": 1, "load": 1}
        assert torch.get_num_threads() == 2, "vLLM's own thread lost its team"
    finally:
        torch.set_num_threads(before)


def test_chunks_larger_than_the_sidecar_takes_turn_saving_off_with_one_error(sidecar_factory, caplog) -> None:
    """A 70B model at TP 1 with 256-token chunks exceeds a small --max-chunk-bytes: one clear error,
    then no more asking (and no warning per step)."""
    proc = sidecar_factory("16Mi", [], "--max-chunk-bytes", "65536")
    cfg = KVPoolConfig(sidecar_url=proc.info["url"], chunk_size=64)
    # told its chunk size at registration (the connector does): checked there, before any request;
    # not told (or the sidecar not up yet then): checked by the first save's refusal
    for chunk_blocks in (2, 0):
        caplog.clear()
        w = KVPoolWorker(cfg, rank=0)
        w.register_kv_caches(make_layers(5), chunk_blocks=chunk_blocks)
        assert w.io.chunk_bytes(2, 0) > 65536
        for step in range(3):
            ops = chunk_ops([[2 * step, 2 * step + 1]])
            save(w, StepPlan(saves=[SaveSpec(f"r{step}", 0, ops)]))
        errors = [r for r in caplog.records if r.levelname == "ERROR" and "max-chunk-bytes" in r.getMessage()]
        assert len(errors) == 1
        assert SidecarClient(proc.info["url"]).stats()["reserved_chunks"] == 0
        stats = w.take_stats() or {}
        assert stats is None or stats.get("saved_chunks", 0) == 0
        w.shutdown()


def test_an_arena_smaller_than_one_chunk_turns_saving_off_with_one_error(sidecar_factory, caplog) -> None:
    """Every save would be skipped, silently, as if stored already: said once, at registration."""
    proc = sidecar_factory("64Ki")
    w = KVPoolWorker(KVPoolConfig(sidecar_url=proc.info["url"], chunk_size=64), rank=0)
    w.register_kv_caches(make_layers(5), chunk_blocks=2)
    assert w.io.chunk_bytes(2, 0) > 65536
    save(w, StepPlan(saves=[SaveSpec("r", 0, chunk_ops([[0, 1]]))]))
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "--capacity" in errors[0]
    assert SidecarClient(proc.info["url"]).stats()["reserved_chunks"] == 0
    w.shutdown()


def test_a_block_prefix_key_loads_the_first_blocks_of_the_chunk_that_holds_them(sidecar_factory) -> None:
    proc = sidecar_factory("16Mi")
    src, dst, src_layers, dst_layers = _two_workers(proc.info["url"], seed=3)
    (op,) = chunk_ops([[4, 9]])
    prefix_link = b"p" * 16  # the link of its first block alone (the scheduler computes it)
    op.prefixes = [prefix_link]
    save(src, StepPlan(saves=[SaveSpec("a", 0, [op])]))
    # a one-block span found by that key: the sidecar pins the two-block chunk, the worker loads its
    # first block and checks the whole chunk's checksum
    meta = StepPlan(loads=[LoadSpec("b", [ChunkOp(prefix_link, 1, [11])])])
    assert run_loads(dst, meta) == set()
    for (_, s), (_, d) in zip(src_layers, dst_layers, strict=True):
        assert torch.equal(s[4], d[11])
    # a key that names no chunk and no prefix is a load error, as ever
    meta = StepPlan(loads=[LoadSpec("c", [ChunkOp(b"q" * 16, 1, [12])])])
    assert run_loads(dst, meta) == {12}


def test_a_cpu_workers_saves_run_in_a_process_of_their_own_that_reads_its_blocks(sidecar_factory) -> None:
    """On a CPU engine the forward runs Python between its kernels, and a save thread's copies and
    hashes take turns at its GIL: the saves run in a child process that reads the blocks out of the
    worker's memory. A stopped child holds the step's saves (they are its, not the thread's); once it
    runs on, they land bit-exact."""
    proc = sidecar_factory("16Mi")
    src, dst, src_layers, dst_layers = _two_workers(proc.info["url"], seed=10)
    child = src._save_process
    assert child is not None and child.pid != os.getpid()
    assert Path(f"/proc/{child.pid}/comm").read_text().strip() == save_process.PROCESS_NAME
    saves = chunk_ops([[3, 7], [1, 12]])
    os.kill(child.pid, signal.SIGSTOP)
    try:
        src.finish_step(StepPlan(saves=[SaveSpec("a", 0, saves)], step=1))
        src.begin_step(StepPlan(step=2))
        assert not src.saver.drain(1.0), "the saves ran without the save process"
    finally:
        os.kill(child.pid, signal.SIGCONT)
    assert src.saver.drain(30)
    assert (src.take_stats() or {})["saved_chunks"] == 2
    assert run_loads(dst, StepPlan(loads=[LoadSpec("b", chunk_ops([[0, 2], [4, 8]]))])) == set()
    for (_, s), (_, d) in zip(src_layers, dst_layers, strict=True):
        for sb, db in [(3, 0), (7, 2), (1, 4), (12, 8)]:
            assert torch.equal(s[sb], d[db])


def _past_a_page_boundary(layers: Layers) -> Layers:
    """The same layers, each one 100 bytes past a page boundary in memory of its own: its first and
    last blocks lie partly in pages it shares with nothing, which stay out of the shared mapping."""
    out = []
    for name, t in layers:
        memory = np.frombuffer(mmap.mmap(-1, t.nbytes + 2 * mmap.PAGESIZE), dtype=np.uint8)
        moved = torch.from_numpy(memory[100 : 100 + t.nbytes]).view(t.dtype).view(t.shape)
        out.append((name, moved.copy_(t)))
    return out


def test_the_save_process_copies_blocks_where_they_lie_and_reads_those_in_partial_pages(
    sidecar_factory,
) -> None:
    """The worker moves each KV cache allocation's whole pages onto a memfd that the save process maps
    (shared_kv.py), keeping every byte; the child copies and hashes those blocks in place and reads
    the others (an allocation's first and last partial pages) out of the worker. One step saving
    blocks of both kinds lands bit-exact, and so do the loads into a cache moved while all zeros."""
    proc = sidecar_factory("16Mi")
    cfg = KVPoolConfig(sidecar_url=proc.info["url"], chunk_size=64)
    src, dst = KVPoolWorker(cfg, rank=0), KVPoolWorker(cfg, rank=0)
    src_layers, dst_layers = _past_a_page_boundary(make_layers(13)), make_layers(None)
    before = [t.clone() for _, t in src_layers]
    src.register_kv_caches(src_layers)
    dst.register_kv_caches(dst_layers)
    assert all(torch.equal(t, b) for (_, t), b in zip(src_layers, before, strict=True))
    assert src._save_process is not None and src._save_process.reader.startswith("a shared mapping")
    saves = chunk_ops([[0, 1], [7, 8], [14, 15]])  # the first and last blocks straddle a partial page
    save(src, StepPlan(saves=[SaveSpec("a", 0, saves)], step=1))
    assert (src.take_stats() or {})["saved_chunks"] == 3
    assert run_loads(dst, StepPlan(loads=[LoadSpec("b", saves)])) == set()
    for (_, s), (_, d) in zip(src_layers, dst_layers, strict=True):
        assert torch.equal(s[[0, 1, 7, 8, 14, 15]], d[[0, 1, 7, 8, 14, 15]])


def test_a_cache_on_huge_pages_stays_on_them_and_the_save_process_reads_it_out_of_the_worker(
    sidecar_factory, caplog
) -> None:
    """A KV cache on transparent huge pages is not moved onto the memfd's 4 KiB pages (vLLM's CPU
    attention ran 3.5-4% slower over them): the worker says so, its save process reads the blocks out
    of the worker, and they land bit-exact."""
    proc = sidecar_factory("16Mi")
    cfg = KVPoolConfig(sidecar_url=proc.info["url"], chunk_size=64)
    src, dst = KVPoolWorker(cfg, rank=0), KVPoolWorker(cfg, rank=0)
    src_layers = [(name, in_anonymous_memory(t, huge=True)) for name, t in make_layers(17)]
    dst_layers = make_layers(None)
    assert all(on_huge_pages(t.data_ptr(), t.nbytes) for _, t in src_layers), "the kernel gave no huge page"
    with caplog.at_level(logging.INFO, logger="vllm.kvpool_connector"):
        src.register_kv_caches(src_layers)
    dst.register_kv_caches(dst_layers)
    assert all(on_huge_pages(t.data_ptr(), t.nbytes) for _, t in src_layers)
    assert src._save_process is not None and src._save_process.reader == "process_vm_readv"
    assert "3 of the KV cache's 3 allocations stay on their transparent huge pages" in caplog.text
    saves = chunk_ops([[0, 1], [7, 8], [14, 15]])
    save(src, StepPlan(saves=[SaveSpec("a", 0, saves)], step=1))
    assert (src.take_stats() or {})["saved_chunks"] == 3
    assert run_loads(dst, StepPlan(loads=[LoadSpec("b", saves)])) == set()
    for (_, s), (_, d) in zip(src_layers, dst_layers, strict=True):
        assert torch.equal(s[[0, 1, 7, 8, 14, 15]], d[[0, 1, 7, 8, 14, 15]])


def test_a_killed_save_process_costs_one_steps_saves_then_the_worker_saves_on_its_own_thread(
    sidecar_factory, caplog
) -> None:
    proc = sidecar_factory("16Mi")
    src, dst, src_layers, dst_layers = _two_workers(proc.info["url"], seed=11)
    child = src._save_process
    assert child is not None
    os.kill(child.pid, signal.SIGKILL)
    first, second = chunk_ops([[0, 1], [2, 3]])
    save(src, StepPlan(saves=[SaveSpec("a", 0, [first])], step=1))
    assert (src.take_stats() or {})["save_skipped_chunks"] == 1
    assert "the save process is gone" in caplog.text and src._save_process is None
    save(src, StepPlan(saves=[SaveSpec("a", 0, [second])], step=2))
    assert (src.take_stats() or {})["saved_chunks"] == 1
    assert run_loads(dst, StepPlan(loads=[LoadSpec("b", [ChunkOp(second.link, 2, [5, 6])])])) == set()
    for (_, s), (_, d) in zip(src_layers, dst_layers, strict=True):
        assert torch.equal(s[2], d[5]) and torch.equal(s[3], d[6])


def test_a_save_process_stopped_while_it_reads_the_blocks_is_killed_before_the_step_waits_long(
    sidecar_factory, monkeypatch, caplog
) -> None:
    """A step that reuses blocks waits for the saves still reading them (the fence): it cannot drop a
    read already under way. A child stopped mid-read held that step for ANSWER_SECONDS (30 s); after
    COPY_SECONDS it is killed, its saves are skipped (a future miss) and the next run on the thread."""
    monkeypatch.setattr(save_process, "COPY_SECONDS", 0.5)
    proc = sidecar_factory("16Mi")
    src, dst, src_layers, dst_layers = _two_workers(proc.info["url"], seed=12)
    child = src._save_process
    assert child is not None
    reading, save_in_child = threading.Event(), child.save

    def stopped_once_reading(saves: Any, start_copy: Callable[[], bool], end_copy: Callable[[], None]) -> Any:
        def start() -> bool:
            allowed = start_copy()
            os.kill(child.pid, signal.SIGSTOP)  # told it may read vLLM's blocks, it reads no further
            reading.set()
            return allowed

        return save_in_child(saves, start, end_copy)

    monkeypatch.setattr(child, "save", stopped_once_reading)
    first, second = chunk_ops([[0, 1], [2, 3]])
    src.finish_step(StepPlan(saves=[SaveSpec("a", 0, [first])], step=1))
    src.begin_step(StepPlan(step=2))
    assert reading.wait(30)
    step = threading.Thread(target=src.begin_step, args=(StepPlan(fence=1, step=3),), daemon=True)
    step.start()  # it reuses blocks 0 and 1
    step.join(timeout=save_process.ANSWER_SECONDS / 2)
    assert not step.is_alive(), "the step waited on the stopped save process"
    assert src.saver.drain(30)  # the save thread lets the step go before it says why and drops the child
    assert child._proc.poll() is not None and src._save_process is None
    assert "the save process is gone (no answer in 0.5 s)" in caplog.text
    assert (src.take_stats() or {})["save_skipped_chunks"] == 1
    save(src, StepPlan(saves=[SaveSpec("a", 0, [second])], step=4))
    assert (src.take_stats() or {})["saved_chunks"] == 1
    assert run_loads(dst, StepPlan(loads=[LoadSpec("b", [ChunkOp(second.link, 2, [5, 6])])])) == set()
    for (_, s), (_, d) in zip(src_layers, dst_layers, strict=True):
        assert torch.equal(s[2], d[5]) and torch.equal(s[3], d[6])


def test_a_save_process_that_cannot_read_the_workers_memory_leaves_the_saves_on_its_thread(
    sidecar_factory, caplog, monkeypatch
) -> None:
    """Where the kernel refuses the read (ptrace's rules, a seccomp profile), the child says so at
    start and the worker saves as before. Here the child is pointed at an unmapped address (EFAULT)."""
    unmapped = classmethod(lambda cls, layer: cls(4096, layer.page_bytes, layer.page_bytes))
    monkeypatch.setattr(save_process.RemoteLayer, "of", unmapped)
    proc = sidecar_factory("16Mi")
    src, dst, src_layers, dst_layers = _two_workers(proc.info["url"], seed=12)
    assert src._save_process is None
    assert "cannot read the worker's KV cache" in caplog.text
    saves = chunk_ops([[4, 5]])
    save(src, StepPlan(saves=[SaveSpec("a", 0, saves)], step=1))
    assert (src.take_stats() or {})["saved_chunks"] == 1
    assert run_loads(dst, StepPlan(loads=[LoadSpec("b", saves)])) == set()
    for (_, s), (_, d) in zip(src_layers, dst_layers, strict=True):
        assert torch.equal(s[4], d[4]) and torch.equal(s[5], d[5])
