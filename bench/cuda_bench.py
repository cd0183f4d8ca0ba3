"""The worker's CUDA path on a GPU (#26), through the real sidecar process.

1. Save and load GB/s for 256-token chunks of an 8B-class layout (32 layers, 8 KV heads, head 128, bf16,
   16-token blocks: 32 MiB a chunk), against a plain pinned cudaMemcpyAsync of the same bytes, timed
   alternately in the same run. A save is timed from its first layer's copy to its commit in the
   sidecar; a load from start_load to the request reported finished (its blocks on the device).
2. What a save adds to a step: a stand-in forward (two MLP matmuls a layer on 2,048 tokens, the step's
   KV written into its blocks, save_layer after each layer, then finish_step and a synchronize, as
   vLLM's step ends) with no saves, with saves on the save thread, and with saves inside the step.
   Section 1 runs at the default copy_threads (from the CPUs and GPUs here) and at 4.
3. The parts' own rates on this machine (hash, host copy, DMA from pinned, pageable and registered
   memory, cudaHostRegister), which bound what the path can reach.
4. Past the copy threads' CPU: raw pipelines over 16 chunks of an arena in shared memory registered
   with CUDA, with k hashing threads. load-now / save-now are what the path does (the CPU copies
   between the arena and a private pinned buffer and hashes that); load-dd DMAs the arena to the
   device and the device's bytes back to a private pinned buffer, which the CPU only hashes (the
   checksum still covers the bytes the device holds); save-dd DMAs the device's bytes to the arena
   and to a private pinned buffer, hashed there; load-arena hashes the arena in place beside its DMA
   (no private copy: what the checksum covers could change under it).

Needs a CUDA device: `python -m bench cuda` where one is lent; elsewhere it says so and stops.
KVPOOL_BENCH_DEVICE=cpu runs a small version on the CPU, to check the bench itself.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import mmap
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import torch

from bench.stats import Spread
from kvpool_connector.common import ChunkOp, LoadSpec, SaveSpec, StepPlan
from kvpool_connector.config import KVPoolConfig
from kvpool_connector.cpu_share import usable_cpus
from kvpool_connector.keys import chain
from kvpool_connector.worker import KVPoolWorker
from kvpool_demo.localrun import sidecar
from kvpool_sidecar.wire import checksum

DEVICE = os.environ.get("KVPOOL_BENCH_DEVICE", "cuda")
SMALL = DEVICE == "cpu"
LAYERS, KV_HEADS, HEAD, BLOCK = (4 if SMALL else 32), 8, 128, 16
CHUNK_TOKENS = 256
CHUNK_BLOCKS = CHUNK_TOKENS // BLOCK
BATCH = 2 if SMALL else 16  # chunks per timed save or load
REPEAT = 2 if SMALL else 5
STEP_TOKENS = 512 if SMALL else 2048
HIDDEN, FFN = (256, 512) if SMALL else (4096, 14336)
STEPS, ROUNDS = (3, 2) if SMALL else (8, 3)
GB = 1e9


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _layers(num_blocks: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    """vLLM's split layout, blocks first: [blocks, 2, block_size, kv_heads, head], random bf16."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = (num_blocks, 2, BLOCK, KV_HEADS, HEAD)
    return [
        (f"layer{i}", torch.randn(shape, generator=g, dtype=torch.bfloat16, device=DEVICE))
        for i in range(LAYERS)
    ]


def _chunks(blocks: list[int]) -> list[ChunkOp]:
    """Chunks over `blocks` (CHUNK_BLOCKS each) under fresh keys."""
    n = len(blocks) // CHUNK_BLOCKS
    links = chain(os.urandom(16), list(range(CHUNK_TOKENS * n)), CHUNK_TOKENS)
    return [
        ChunkOp(link, CHUNK_BLOCKS, blocks[i * CHUNK_BLOCKS : (i + 1) * CHUNK_BLOCKS])
        for i, link in enumerate(links)
    ]


def _block_lists(num_blocks: int, scattered: bool, seed: int) -> list[int]:
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    return order if scattered else list(range(num_blocks))


def _save(worker: KVPoolWorker, names: list[str], ops: list[ChunkOp], step: int) -> tuple[float, float]:
    """(seconds until finish_step returned, seconds until committed) for one step's saves."""
    meta = StepPlan(saves=[SaveSpec(f"save{step}", 0, ops)], step=step)
    _sync()
    t0 = time.perf_counter()
    for name in names:
        worker.save_layer(name, meta)
    worker.finish_step(meta)
    t1 = time.perf_counter()
    # The next step begins at once, as on a busy engine: a step's saves wait for that (or for the
    # saver's HOLD_SECONDS), and without it the timed save was 20 ms of waiting more.
    worker.begin_step(StepPlan(step=step + 1))
    assert worker.saver.drain(120), "the saves did not finish"
    t2 = time.perf_counter()
    counts = worker.take_stats() or {}
    assert counts.get("saved_chunks") == len(ops), f"saved {counts}"
    return t1 - t0, t2 - t0


def _load(worker: KVPoolWorker, ops: list[ChunkOp], name: str) -> float:
    meta = StepPlan(loads=[LoadSpec(name, ops)])
    _sync()
    t0 = time.perf_counter()
    worker.start_load(meta)
    while not worker.get_finished(wait=True):
        pass
    seconds = time.perf_counter() - t0
    assert not worker.take_load_errors(), "a load failed"
    return seconds


def _memcpy(dev: torch.Tensor, host: torch.Tensor, to_host: bool, piece: int) -> float:
    """A plain pinned cudaMemcpyAsync of the same bytes, in chunk-sized pieces, then a synchronize."""
    _sync()
    t0 = time.perf_counter()
    for lo in range(0, dev.numel(), piece):
        if to_host:
            host[lo : lo + piece].copy_(dev[lo : lo + piece], non_blocking=True)
        else:
            dev[lo : lo + piece].copy_(host[lo : lo + piece], non_blocking=True)
    _sync()
    return time.perf_counter() - t0


def _line(what: str, rates: list[float], ratios: list[float] | None = None) -> None:
    r = Spread.of(rates)
    extra = ""
    if ratios:
        q = Spread.of(ratios)
        extra = f" | {q.median:.2f}x [{q.low:.2f}-{q.high:.2f}]"
    else:
        extra = " | -"
    print(f"| {what} | {r.median:.2f} [{r.low:.2f}-{r.high:.2f}]{extra} |")


def transfer_rates(url: str, copy_threads: int | None = None) -> None:
    chunk_bytes = LAYERS * CHUNK_BLOCKS * 2 * BLOCK * KV_HEADS * HEAD * 2
    nbytes = BATCH * chunk_bytes
    num_blocks = 2 * BATCH * CHUNK_BLOCKS
    cfg = KVPoolConfig(sidecar_url=url, chunk_size=CHUNK_TOKENS)
    if copy_threads is not None:
        cfg = dataclasses.replace(cfg, copy_threads=copy_threads)
    src, dst = KVPoolWorker(cfg, rank=0), KVPoolWorker(cfg, rank=0)
    src_layers, dst_layers = _layers(num_blocks, 1), _layers(num_blocks, 2)
    src.register_kv_caches(src_layers, chunk_blocks=CHUNK_BLOCKS)
    dst.register_kv_caches(dst_layers, chunk_blocks=CHUNK_BLOCKS)
    names = [n for n, _ in src_layers]
    dev = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=DEVICE == "cuda")
    print(
        f"{LAYERS} layers x {KV_HEADS} KV heads x head {HEAD}, bf16, {BLOCK}-token blocks: "
        f"{chunk_bytes / 2**20:.0f} MiB a {CHUNK_TOKENS}-token chunk, {BATCH} chunks "
        f"({nbytes / 2**20:.0f} MiB) a timed save or load; {REPEAT} repetitions after a warm-up, "
        f"each alternating with the memcpy; median [range]; copy_threads {src.copy_threads}"
        + (
            ""
            if copy_threads
            else f" (the default here: {usable_cpus():g} CPUs, {torch.cuda.device_count()} GPU(s))"
        )
    )
    print("| path | GB/s | ÷ pinned cudaMemcpyAsync, same direction |")
    print("| --- | --- | --- |")
    for scattered in (False, True):
        blocks = _block_lists(num_blocks, scattered, 3)
        kind = "scattered blocks" if scattered else "consecutive blocks"
        d2h, h2d, save, save_step, load, load_ratio, save_ratio = [], [], [], [], [], [], []
        for rep in range(REPEAT + 1):
            ops = _chunks(blocks[: BATCH * CHUNK_BLOCKS])
            base_out = nbytes / _memcpy(dev, host, True, chunk_bytes) / GB
            in_step, total = _save(src, names, ops, 100 * scattered + rep + 1)
            targets = blocks[BATCH * CHUNK_BLOCKS :]
            loads = [
                ChunkOp(op.link, CHUNK_BLOCKS, targets[i * CHUNK_BLOCKS : (i + 1) * CHUNK_BLOCKS])
                for i, op in enumerate(ops)
            ]
            base_in = nbytes / _memcpy(dev, host, False, chunk_bytes) / GB
            seconds = _load(dst, loads, f"load{scattered}{rep}")
            if rep == 0:  # the warm-up: the arena is mapped, the pinned pools filled; checked once
                _sync()
                for (_, s), (_, d) in zip(src_layers, dst_layers, strict=True):
                    for op, lop in zip(ops, loads, strict=True):
                        assert torch.equal(s[op.block_ids], d[lop.block_ids])
                continue
            d2h.append(base_out)
            h2d.append(base_in)
            save.append(nbytes / total / GB)
            save_step.append(in_step * 1e3)
            save_ratio.append(save[-1] / base_out)
            load.append(nbytes / seconds / GB)
            load_ratio.append(load[-1] / base_in)
        _line(f"pinned cudaMemcpyAsync device->host ({kind})", d2h)
        _line(f"kvpool save, to committed ({kind})", save, save_ratio)
        _line(f"pinned cudaMemcpyAsync host->device ({kind})", h2d)
        _line(f"kvpool load, to finished ({kind})", load, load_ratio)
        in_step_ms = Spread.of(save_step)
        print(f"| (save, in the step: copies queued + finish_step, ms; {kind}) | {_ms(in_step_ms)} | - |")
    src.shutdown()
    dst.shutdown()


def step_cost(url: str) -> None:
    """Steps of a stand-in forward that save STEP_TOKENS tokens each, against the same steps saving
    nothing; arms alternate round by round, each step's saves under fresh keys."""
    blocks = STEP_TOKENS // BLOCK
    num_blocks = 2 * blocks
    layers = _layers(num_blocks, 4)
    w1 = torch.randn(HIDDEN, FFN, dtype=torch.bfloat16, device=DEVICE) / HIDDEN**0.5
    w2 = torch.randn(FFN, HIDDEN, dtype=torch.bfloat16, device=DEVICE) / FFN**0.5
    x = torch.randn(STEP_TOKENS, HIDDEN, dtype=torch.bfloat16, device=DEVICE)
    ids = torch.arange(blocks, device=DEVICE)
    arms = {"no saves": True, "saves on the save thread": True, "saves inside the step": False}
    workers = {
        arm: KVPoolWorker(
            KVPoolConfig(sidecar_url=url, chunk_size=CHUNK_TOKENS, async_saves=threaded), rank=0
        )
        for arm, threaded in arms.items()
    }
    for w in workers.values():
        w.register_kv_caches(layers, chunk_blocks=CHUNK_BLOCKS)
    step_no = [1000]

    def step(w: KVPoolWorker, saving: bool) -> float:
        step_no[0] += 1
        ops = _chunks(list(range(blocks))) if saving else []
        meta = StepPlan(saves=[SaveSpec(f"s{step_no[0]}", 0, ops)] if ops else [], step=step_no[0])
        _sync()
        t0 = time.perf_counter()
        w.begin_step(meta)  # vLLM's handle_preemptions: the last step's saves start
        h = x
        for name, t in layers:
            for _ in range(2):
                h = torch.relu(h @ w1) @ w2
            t.index_fill_(0, ids, float(step_no[0] % 7))  # this step's KV written into its blocks
            w.save_layer(name, meta)
        w.finish_step(meta)
        _sync()  # vLLM samples at the step's end
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {arm: [] for arm in workers}
    lag: list[float] = []
    for r in range(ROUNDS + 1):
        order = list(workers) if r % 2 == 0 else list(reversed(workers))
        for arm in order:
            w = workers[arm]
            ms = [1e3 * step(w, arm != "no saves") for _ in range(STEPS)]
            t = time.perf_counter()
            assert w.saver.drain(120)
            if arm == "saves on the save thread" and r:
                lag.append(1e3 * (time.perf_counter() - t))
            w.take_stats()
            if r:  # round 0 warms up
                times[arm].extend(ms)
    base = statistics.median(times["no saves"])
    print(
        f"{STEPS} steps an arm a round, {ROUNDS} rounds after a warm-up, arms alternating; a step saves "
        f"{STEP_TOKENS} tokens ({blocks // CHUNK_BLOCKS} chunks, "
        f"{blocks * LAYERS * 2 * BLOCK * KV_HEADS * HEAD * 2 / 2**20:.0f} MiB)"
    )
    print("| arm | step, ms, median [range] | added to the step, ms (median) |")
    print("| --- | --- | --- |")
    for arm, xs in times.items():
        s = Spread.of(xs)
        print(f"| {arm} | {s.median:.2f} [{s.low:.2f}-{s.high:.2f}] | {s.median - base:+.2f} |")
    if lag:
        s = Spread.of(lag)
        print(f"(the save thread finished the last step's saves {_ms(s)} ms after it)")
    for w in workers.values():
        w.shutdown()


def _ms(s: Spread) -> str:
    return f"{s.median:.2f} [{s.low:.2f}-{s.high:.2f}]"


def _rate(nbytes: int, run: Callable[[], object], repeat: int = 7) -> Spread:
    run()
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        run()
        out.append(nbytes / (time.perf_counter() - t) / GB)
    return Spread.of(out)


def parts() -> None:
    """The rates that bound the path, on this machine."""
    n = 32 * 2**20
    bufs = [torch.randint(0, 256, (n,), dtype=torch.uint8) for _ in range(16)]
    if DEVICE == "cuda":
        bufs = [b.pin_memory() for b in bufs]
    rows: list[tuple[str, Spread]] = []
    rows.append(("xxh3_64 of 32 MiB, one thread", _rate(n, lambda: checksum(bufs[0].numpy()))))

    def hash_in(k: int) -> None:
        ts = [threading.Thread(target=checksum, args=(bufs[i].numpy(),)) for i in range(k)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    rows.append(("xxh3_64 of 4 x 32 MiB, four threads, together", _rate(4 * n, lambda: hash_in(4))))
    rows.append(
        (
            "host copy of 32 MiB, torch copy_ (1 thread, as in vLLM's workers)",
            _rate(n, lambda: bufs[1].copy_(bufs[2])),
        )
    )

    def stage_in(k: int) -> None:  # what a copy thread does to a chunk: copy it, hash the copy
        def one(i: int) -> None:
            bufs[i].copy_(bufs[i + 8])
            checksum(bufs[i].numpy())

        ts = [threading.Thread(target=one, args=(i,)) for i in range(k)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    for k in (1, 2, 4, 8):
        rows.append(
            (
                f"copy + xxh3_64 of {k} x 32 MiB, {k} thread(s) together",
                _rate(k * n, functools.partial(stage_in, k)),
            )
        )
    if DEVICE == "cuda":
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        pageable = torch.randint(0, 256, (n,), dtype=torch.uint8)

        def h2d(src: torch.Tensor) -> Callable[[], None]:
            def copy() -> None:
                dev.copy_(src, non_blocking=True)
                torch.cuda.synchronize()

            return copy

        rows.append(("host->device 32 MiB from pinned (cudaMallocHost)", _rate(n, h2d(bufs[3]))))
        rows.append(("host->device 32 MiB from pageable", _rate(n, h2d(pageable))))
        with _shared_memory(2**30) as (region, err, reg_ms):
            print(f"(cudaHostRegister of a 1 GiB shared-memory mapping: {reg_ms:.1f} ms, result {err})")
            if _registered(err):
                rows.append(("host->device 32 MiB from a registered mapping", _rate(n, h2d(region[:n]))))
    print("| part | GB/s, median [range] of 7 |")
    print("| --- | --- |")
    for what, s in rows:
        print(f"| {what} | {s.median:.2f} [{s.low:.2f}-{s.high:.2f}] |")


@contextlib.contextmanager
def _shared_memory(size: int) -> Iterator[tuple[torch.Tensor, object, float]]:
    """`size` bytes of a file in /dev/shm (where a pod's arena lives), paged in, and on a GPU registered
    with CUDA for as long as it is used: (the bytes, cudaHostRegister's result or None on the CPU, the
    milliseconds it took). _registered() says whether it took."""
    with tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
        f.truncate(size)
        m = mmap.mmap(f.fileno(), size)
        region = torch.frombuffer(m, dtype=torch.uint8)
        region.fill_(1)
        err, ms = None, 0.0
        if DEVICE == "cuda":
            t = time.perf_counter()
            err = torch.cuda.cudart().cudaHostRegister(region.data_ptr(), size, 0)
            ms = 1e3 * (time.perf_counter() - t)
        try:
            yield region, err, ms
        finally:
            if _registered(err):
                torch.cuda.cudart().cudaHostUnregister(region.data_ptr())
            del region
            with contextlib.suppress(BufferError):  # the caller's views: the OS unmaps at exit
                m.close()


def _registered(err: object) -> bool:
    return err is not None and int(err) == 0  # type: ignore[call-overload]  # a cudaError enum


class _Pipelines:
    """Section 4's pipelines over N chunks of an arena in shared memory (registered with CUDA)."""

    N = 16

    def __init__(self, arena: torch.Tensor, registered: bool) -> None:
        self.size = arena.numel() // self.N
        self.arena, self.registered = arena, registered
        self.arena.copy_(torch.randint(0, 256, (self.N * self.size,), dtype=torch.uint8))
        self.dev = torch.randint(0, 256, (self.N * self.size,), dtype=torch.uint8, device=DEVICE)
        self.pinned = [
            torch.empty(self.size, dtype=torch.uint8, pin_memory=DEVICE == "cuda") for _ in range(self.N)
        ]
        self.expect = [checksum(self.chunk(self.arena, i).numpy()) for i in range(self.N)]
        self.h2d = torch.cuda.Stream() if DEVICE == "cuda" else None
        self.d2h = torch.cuda.Stream() if DEVICE == "cuda" else None

    def chunk(self, t: torch.Tensor, i: int) -> torch.Tensor:
        return t[i * self.size : (i + 1) * self.size]

    def _copy(
        self, stream: torch.cuda.Stream | None, dst: torch.Tensor, src: torch.Tensor
    ) -> torch.cuda.Event | None:
        """dst.copy_(src) queued on `stream` (at once on the CPU); the event that marks it done."""
        if stream is None:
            dst.copy_(src)
            return None
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            return stream.record_event()

    def _hashed(self, i: int, after: torch.cuda.Event | None) -> int:
        if after is not None:
            after.synchronize()
        return checksum(self.pinned[i].numpy())

    def load_now(self, pool: ThreadPoolExecutor) -> None:
        def stage(i: int) -> int:
            self.pinned[i].copy_(self.chunk(self.arena, i))
            return checksum(self.pinned[i].numpy())

        futures = [pool.submit(stage, i) for i in range(self.N)]
        for i, f in enumerate(futures):
            assert f.result() == self.expect[i]
            self._copy(self.h2d, self.chunk(self.dev, i), self.pinned[i])

    def load_dd(self, pool: ThreadPoolExecutor) -> None:
        futures = []
        for i in range(self.N):
            landed = self._copy(self.h2d, self.chunk(self.dev, i), self.chunk(self.arena, i))
            if self.d2h is not None and landed is not None:
                self.d2h.wait_event(landed)
            back = self._copy(self.d2h, self.pinned[i], self.chunk(self.dev, i))
            futures.append(pool.submit(self._hashed, i, back))
        assert [f.result() for f in futures] == self.expect

    def load_arena(self, pool: ThreadPoolExecutor) -> None:
        futures = [pool.submit(checksum, self.chunk(self.arena, i).numpy()) for i in range(self.N)]
        for i in range(self.N):
            self._copy(self.h2d, self.chunk(self.dev, i), self.chunk(self.arena, i))
        assert [f.result() for f in futures] == self.expect

    def save_now(self, pool: ThreadPoolExecutor) -> None:
        def write(i: int, after: torch.cuda.Event | None) -> int:
            digest = self._hashed(i, after)
            self.chunk(self.arena, i).copy_(self.pinned[i])
            return digest

        out = [self._copy(self.d2h, self.pinned[i], self.chunk(self.dev, i)) for i in range(self.N)]
        concurrent.futures.wait([pool.submit(write, i, e) for i, e in enumerate(out)])

    def save_dd(self, pool: ThreadPoolExecutor) -> None:
        futures = []
        for i in range(self.N):
            self._copy(self.h2d, self.chunk(self.arena, i), self.chunk(self.dev, i))
            futures.append(
                pool.submit(self._hashed, i, self._copy(self.d2h, self.pinned[i], self.chunk(self.dev, i)))
            )
        concurrent.futures.wait(futures)

    def memcpy(self, to_host: bool) -> Callable[[ThreadPoolExecutor], None]:
        def run(_: ThreadPoolExecutor) -> None:
            for i in range(self.N):
                dev, host = self.chunk(self.dev, i), self.pinned[i]
                if to_host:
                    host.copy_(dev, non_blocking=True)
                else:
                    dev.copy_(host, non_blocking=True)

        return run


def pipelines() -> None:
    with _shared_memory(_Pipelines.N * (4 if SMALL else 32) * 2**20) as (arena, err, _):
        p = _Pipelines(arena, _registered(err))
        cases: dict[str, Callable[[ThreadPoolExecutor], None]] = {
            "pinned cudaMemcpyAsync host->device": p.memcpy(False),
            "load-now (copy + hash on the CPU, then DMA)": p.load_now,
            "load-dd (DMA in, DMA back, hash on the CPU)": p.load_dd,
            "load-arena (DMA in, hash the arena in place)": p.load_arena,
            "pinned cudaMemcpyAsync device->host": p.memcpy(True),
            "save-now (DMA out, copy + hash on the CPU)": p.save_now,
            "save-dd (DMA to the arena and back, hash on the CPU)": p.save_dd,
        }
        print(
            f"{p.N} chunks of {p.size >> 20} MiB; arena registered with CUDA: {p.registered}; "
            f"GB/s, median [range] of {REPEAT} after a warm-up, cases alternating"
        )
        print("| pipeline | k hashing threads | GB/s |")
        print("| --- | --- | --- |")
        for k in (4, 8):
            rates: dict[str, list[float]] = {c: [] for c in cases}
            with ThreadPoolExecutor(k) as pool:
                for rep in range(REPEAT + 1):
                    for name, run in cases.items():
                        _sync()
                        t = time.perf_counter()
                        run(pool)
                        _sync()
                        if rep:
                            rates[name].append(p.N * p.size / (time.perf_counter() - t) / GB)
            for name, xs in rates.items():
                s = Spread.of(xs)
                print(f"| {name} | {k} | {s.median:.2f} [{s.low:.2f}-{s.high:.2f}] |")
        _sync()
        assert torch.equal(p.chunk(p.arena, 3).to(DEVICE), p.chunk(p.dev, 3)), "save-dd wrote other bytes"


def main() -> None:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run `python -m bench cuda` where a GPU is lent")
        return
    # vLLM's workers run torch on one thread (OMP_NUM_THREADS=1): host copies here do too
    torch.set_num_threads(1)
    if DEVICE == "cuda":
        print(
            f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
            "torch on 1 thread as in vLLM's workers"
        )
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvpool-cuda-bench-", dir=shm)))
        url = stack.enter_context(sidecar(work, capacity="1Gi" if SMALL else "4Gi"))
        print("### 1. Save and load")
        transfer_rates(url)
        transfer_rates(url, copy_threads=4)
        print("### 2. What a save adds to a step")
        step_cost(url)
    print("### 3. The parts")
    parts()
    print("### 4. Past the copy threads' CPU: raw pipelines")
    pipelines()
