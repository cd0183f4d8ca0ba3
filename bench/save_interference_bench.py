"""What kvpool's save thread costs vLLM's forward on a CPU engine (#24), in two parts.

1. OpenMP teams. A CPU engine sets torch's thread count to its compute cores, and a thread it starts
   takes that count, so each torch copy of more than a few KiB on kvpool's thread starts an OpenMP
   team that large on the cores left to the thread. Here: a save thread moved off core 0 in a
   process whose count is 2, saving 4 MiB chunks for 2 seconds as it starts, then after
   affinity.one_openmp_thread (what kvpool's threads now run first).

2. Where a save's cost to the forward comes from: the GIL the save thread shares with vLLM's thread,
   or the memory and caches the two cores share. A forward-like main thread is pinned to core 0: each
   step a stretch of Python (as vLLM's model runner between kernels) and 24 small float32 linear
   layers (torch calls that let go of the GIL). Beside it, three chunks of the `bench processes`
   model's layout (8 layers, 4 KV heads, head size 64, float32, 64-token blocks: 4 MiB a chunk,
   blocks partly scattered) are saved every PERIOD seconds, far more often than under `bench
   processes`, so that the cost of a save stands out of the noise. The arms take turns in slices of
   SLICE seconds, in a fresh order every round:
   - none: no saves (the baseline), and none again (an A/A control: the noise band);
   - thread: ChunkIO.save_cpu on a kvpool save thread (side_thread), as the worker runs it;
   - thread, one hash a chunk: the chunk gathered into a private buffer first, then hashed in one
     call and copied out in one: ten times fewer GIL hand-overs, one more copy (tried, not kept);
   - process: save_cpu in another process, which shares no GIL with the forward, only the machine;
   - kvpool worker, save thread / save process: the whole of kvpool's save, through a real sidecar
     (reserve, copy, commit), as vLLM's thread drives it: begin_step before each forward step, a
     step's three chunks to finish_step every WORKER_PERIOD seconds; `save_process` false (the
     chunks saved on the worker's save thread) and true (in the worker's save process, which reads
     the blocks out of this process's memory; the save thread only passes messages).
   Per arm: the median over rounds of its step time over none's in the same round, with a 95%
   bootstrap interval, and the forward time lost per chunk saved. Twice: with the other core idle,
   and with one busy process on it (under load it is busy: vLLM's scheduler and API server, the
   sidecar).
Run: `.venv/bin/python -m bench save_interference` (about 9 minutes; needs 2 cores).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path

import torch

from bench.stats import bootstrap, load_note
from kvpool_connector.affinity import one_openmp_thread, side_thread
from kvpool_connector.chunk_io import ChunkIO
from kvpool_connector.common import ChunkOp, SaveSpec, StepPlan
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.paged import PagedLayer, host_bytes
from kvpool_connector.worker import KVPoolWorker
from kvpool_demo.localrun import sidecar
from kvpool_demo.tinymodel import BENCH
from kvpool_sidecar.wire import checksum

BLOCK = 64
CHUNK_BLOCKS = 4
NUM_BLOCKS = 48
PERIOD = 0.01  # seconds between a round's three saves and the next three
SLICE = 0.5  # seconds an arm runs before the next takes over
ROUNDS = 60
# seconds between a step's three chunks and the next step's for kvpool's worker: the whole save
# (round trips to the sidecar too) costs it about three times save_cpu alone
WORKER_PERIOD = 0.03
FORWARD_CORE = 0
BLOCK_IDS = [[3, 4, 5, 6], [9, 10, 11, 12], [20, 21, 40, 41]]  # runs, and scattered blocks

Save = Callable[[ChunkOp], None]


class Saves:
    """Chunks of the BENCH model's layout saved from its paged layers into a private chunk buffer."""

    def __init__(self) -> None:
        head = BENCH.hidden // BENCH.heads
        shape = (NUM_BLOCKS, BENCH.kv_heads, BLOCK, 2 * head)  # vLLM CPU's [B, H, N, K+V], float32
        self.io = ChunkIO([PagedLayer(torch.randn(shape)) for _ in range(BENCH.layers)])
        size = self.io.chunk_bytes(CHUNK_BLOCKS)
        self.chunk = torch.empty(size, dtype=torch.uint8)
        self.staging = torch.empty(size, dtype=torch.uint8)
        self.ops = [ChunkOp(b"bench", CHUNK_BLOCKS, ids) for ids in BLOCK_IDS]

    def save_cpu(self, op: ChunkOp) -> None:
        self.io.save_cpu(self.chunk, op)

    def one_hash(self, op: ChunkOp) -> None:
        """The tried alternative: gathered into a private buffer, hashed in one call, copied out in one."""
        ids = self.io.ids(op)
        for i, layer in enumerate(self.io.layers):
            layer.gather(ids, self.io.rows(self.staging, op.chunk_blocks, i))
        checksum(host_bytes(self.staging))
        self.chunk.copy_(self.staging)


def openmp_team() -> tuple[float, float]:
    """ms a 4 MiB save takes on a thread moved off core 0 in a process whose torch count is 2: as the
    thread starts (it takes that count), and after one_openmp_thread."""
    saves, before = Saves(), torch.get_num_threads()
    torch.set_num_threads(2)  # as vLLM's CPU worker does for two compute cores

    def timed(setup: Callable[[], None], out: list[float]) -> None:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)) - {FORWARD_CORE})
        setup()
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < 2.0:
            saves.save_cpu(saves.ops[n % len(saves.ops)])
            n += 1
        out.append((time.perf_counter() - t0) / n * 1e3)

    results: list[float] = []
    try:
        for setup in (lambda: None, one_openmp_thread):
            thread = threading.Thread(target=timed, args=(setup, results))
            thread.start()
            thread.join()
    finally:
        torch.set_num_threads(before)
    return results[0], results[1]


def _save_loop(
    saves: Saves, save: Callable[[], Save | None], stop: Callable[[], bool], count: Callable[[], None]
) -> None:
    side_thread()
    while not stop():
        fn = save()
        if fn is not None:
            for op in saves.ops:
                fn(op)
                count()
        time.sleep(PERIOD)


def _in_process(flag: Synchronized, done: Synchronized) -> None:
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {FORWARD_CORE})  # as a thread of vLLM's; _save_loop moves it off
    saves = Saves()

    def count() -> None:
        with done.get_lock():
            done.value += 1

    _save_loop(saves, lambda: saves.save_cpu if flag.value == 1 else None, lambda: flag.value < 0, count)


class Forward:
    """A step: Python holding the GIL, then small torch calls that let go of it."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.x = torch.randn(2, 1024)
        self.weights = [torch.randn(1024, 1024) for _ in range(3)]

    def step(self) -> None:
        held = [i * 3 for i in range(20000)]  # about a millisecond of Python
        h = self.x
        for _ in range(8):
            for w in self.weights:
                h = torch.nn.functional.silu(torch.nn.functional.linear(h, w) * 0.03)
        del held


@contextlib.contextmanager
def _busy_other_core(busy: bool) -> Iterator[None]:
    others = set(range(os.cpu_count() or 1)) - {FORWARD_CORE}
    code = f"import os\nos.sched_setaffinity(0, {others!r})\nwhile True: pass"
    hog = subprocess.Popen([sys.executable, "-c", code]) if busy else None
    try:
        yield
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


class WorkerSaves:
    """kvpool's worker over the Saves' layers, its steps driven from the forward's thread as vLLM's."""

    def __init__(self, saves: Saves, url: str, save_process: bool) -> None:
        cfg = KVPoolConfig(sidecar_url=url, chunk_size=CHUNK_BLOCKS * BLOCK, save_process=save_process)
        self.worker = KVPoolWorker(cfg, rank=0)
        self.worker.register_kv_caches([(f"layer{i}", lay.cache) for i, lay in enumerate(saves.io.layers)])
        assert (self.worker._save_process is not None) == save_process, "no save process here"
        self.step = 0
        self.due = 0.0

    def begin(self) -> None:
        self.step += 1
        self.worker.begin_step(StepPlan(step=self.step))

    def end(self) -> None:
        if time.perf_counter() < self.due:
            return
        self.due = time.perf_counter() + WORKER_PERIOD
        chunks = [ChunkOp(os.urandom(16), CHUNK_BLOCKS, ids) for ids in BLOCK_IDS]  # never stored before
        self.worker.finish_step(StepPlan(saves=[SaveSpec("bench", 0, chunks)], step=self.step))

    def saved(self) -> int:
        """Chunks saved since the last call, once the queued ones have finished."""
        self.worker.saver.drain(30)
        return int((self.worker.take_stats() or {}).get("saved_chunks", 0))


def gil(busy: bool, url: str) -> dict[str, tuple[list[float], float]]:
    """Per arm: its step time over none's, round by round, and the forward time lost per chunk saved
    (ms, from the medians)."""
    torch.set_num_threads(1)  # one compute thread, as the engines here
    os.sched_setaffinity(0, {FORWARD_CORE})  # as vLLM binds its thread; the save thread moves off
    saves, forward = Saves(), Forward()
    arms: dict[str, Save | str | WorkerSaves | None] = {
        "none": None,
        "none again": None,
        "thread": saves.save_cpu,
        "thread, one hash a chunk": saves.one_hash,
        "process": "process",
        "kvpool worker, save thread": WorkerSaves(saves, url, save_process=False),
        "kvpool worker, save process": WorkerSaves(saves, url, save_process=True),
    }
    current: dict[str, object] = {"save": None, "stop": False}
    counted = [0]
    spawn = mp.get_context("spawn")  # a fork would copy torch's thread pools
    flag, done = spawn.Value("i", 0), spawn.Value("i", 0)
    child = spawn.Process(target=_in_process, args=(flag, done), daemon=True)
    child.start()
    thread = threading.Thread(
        target=_save_loop,
        args=(
            saves,
            lambda: current["save"] if callable(current["save"]) else None,
            lambda: bool(current["stop"]),
            lambda: counted.__setitem__(0, counted[0] + 1),
        ),
        daemon=True,
    )
    thread.start()
    step_ms: dict[str, list[float]] = {a: [] for a in arms}
    chunks: dict[str, int] = dict.fromkeys(arms, 0)
    steps: dict[str, int] = dict.fromkeys(arms, 0)
    names = list(arms)
    try:
        with _busy_other_core(busy):
            for rnd in range(ROUNDS):
                random.Random(rnd).shuffle(names)
                for name in names:
                    arm = arms[name]
                    current["save"], flag.value = arm, int(arm == "process")
                    worker = arm if isinstance(arm, WorkerSaves) else None
                    forward.step()
                    before = counted[0] + done.value
                    t0, n = time.perf_counter(), 0
                    while time.perf_counter() - t0 < SLICE:
                        if worker is not None:
                            worker.begin()
                        forward.step()
                        if worker is not None:
                            worker.end()
                        n += 1
                    step_ms[name].append((time.perf_counter() - t0) / n * 1e3)
                    chunks[name] += counted[0] + done.value - before
                    if worker is not None:  # its last saves finish before the next arm's slice
                        chunks[name] += worker.saved()
                    steps[name] += n
    finally:
        current["stop"], flag.value = True, -1
        thread.join()
        child.join(timeout=10)
        for arm in arms.values():
            if isinstance(arm, WorkerSaves):
                arm.worker.shutdown()
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    out: dict[str, tuple[list[float], float]] = {}
    base = step_ms["none"]
    for name in arms:
        ratios = [a / b for a, b in zip(step_ms[name], base, strict=True)]
        lost = (statistics.median(step_ms[name]) - statistics.median(base)) * steps[name]
        out[name] = (ratios, lost / chunks[name] if chunks[name] else float("nan"))
    return out


def main() -> None:
    if (os.cpu_count() or 1) < 2:
        print("bench save_interference needs 2 cores: the forward's and the save thread's")
        return
    print(load_note())
    inherited, alone = openmp_team()
    print("1. a 4 MiB save on a thread moved off core 0, torch's thread count 2 in the process:")
    print(f"   as the thread starts (an OpenMP team of 2 on one core): {inherited:.2f} ms")
    print(f"   after one_openmp_thread: {alone:.2f} ms")
    print(
        f"\n2. the forward pinned to core {FORWARD_CORE}; three 4 MiB chunks saved every "
        f"{PERIOD * 1e3:.0f} ms; {ROUNDS} rounds of {SLICE} s slices, arms in a fresh order each round"
    )
    print(f"   (kvpool's worker: three chunks every {WORKER_PERIOD * 1e3:.0f} ms, a real sidecar)")
    with (
        tempfile.TemporaryDirectory(prefix="kvpool-bench-", dir="/dev/shm") as d,
        sidecar(Path(d) / "sidecar", "2Gi") as url,  # started before the forward's pinning: both cores
    ):
        for busy in (False, True):
            print(f"\nthe other core {'busy (one spinning process)' if busy else 'idle'}:")
            table(gil(busy, url))


def table(arms: dict[str, tuple[list[float], float]]) -> None:
    print("| arm | forward step / none's, median (95% interval) | forward lost per chunk saved |")
    print("| --- | --- | --- |")
    for name, (ratios, lost) in arms.items():
        if name == "none":
            continue
        low, high = bootstrap(ratios, statistics.median)
        per_chunk = "-" if name == "none again" else f"{lost:.2f} ms"
        print(f"| {name} | {statistics.median(ratios):.3f} ({low:.3f}-{high:.3f}) | {per_chunk} |")
