"""Loads, on one copy thread, which pins a request's chunks (promoting them from Redis when needed),
copies them into its blocks, checks each chunk's checksum over what it loaded and gives the pin back.
Beside the steps (vLLM's load_kv_async): the request waits, computing nothing, and is reported
finished (get_finished) together with the blocks that failed, in the same step, so vLLM recomputes
them before anything is computed over them. In the step (LoadSpec.in_step): the step's forward waits
for the load, and the blocks that failed go to vLLM with that step's output, which vLLM drops for
every request on them (the worker keeps none of the step's saves).

On CUDA the copy threads stage several chunks at once (arena -> private pinned buffer, hashed as it
lands), and each verified chunk's DMA and scatter are queued on the side stream in order while the
next ones are staged; the request is reported once its copies have run (one synchronize)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvpool_sidecar.client import SidecarClient, Slot
from kvpool_sidecar.client_errors import SidecarError

from .affinity import side_thread
from .arena_mapping import ArenaChanged, ArenaMapping
from .chunk_io import ChunkIO
from .common import ChunkOp, LoadSpec, StepPlan
from .counters import Counts
from .keys import rank_key
from .ratelimit import RateLimitedLog

IDLE_WAIT_SECONDS = 0.02  # the longest an idle step waits for a load (new requests wait that long)
STAGED_PER_THREAD = 2  # CUDA: chunks staged ahead of their DMA per copy thread (bounds the pinned memory)


@dataclass
class _Loaded:
    """What one request's load did (on this rank)."""

    req_id: str
    failed_blocks: list[int] = field(default_factory=list)
    chunks: int = 0
    bytes: int = 0
    corrupt: int = 0
    errors: int = 0
    seconds: float = 0.0


class ChunkLoader:
    """One rank's loads. `io`, `mapping` and `stream` are the worker's (set when vLLM registers its KV
    caches); the copy thread is the only one that loads, so a request's chunks load in order."""

    def __init__(self, client: SidecarClient, rank: int, stats: Counts, warn: RateLimitedLog) -> None:
        self.client, self.rank, self.stats, self._warn = client, rank, stats, warn
        self.io = ChunkIO([])
        self.mapping: ArenaMapping | None = None
        self.stream: torch.cuda.Stream | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.staged_ahead = 0  # CUDA: chunks staged ahead of their DMA
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvpool-load", initializer=side_thread)
        self._loading: dict[str, Future[_Loaded]] = {}
        self._finished: set[str] = set()  # loads done, not yet reported
        self._failed_blocks: set[int] = set()  # their blocks that failed, reported with them
        self._failed_requests: set[str] = set()  # those of them with a block that failed

    def attach(
        self,
        io: ChunkIO,
        mapping: ArenaMapping,
        stream: torch.cuda.Stream | None,
        pool: ThreadPoolExecutor | None = None,
        threads: int = 0,
    ) -> None:
        """pool: CUDA's copy threads (`threads` of them), which stage chunks for the DMA."""
        self.io, self.mapping, self.stream, self.pool = io, mapping, stream, pool
        self.staged_ahead = STAGED_PER_THREAD * threads
        self._thread.submit(torch.zeros(1).copy_, torch.ones(1)).result()  # started now, not in a request

    def start(self, meta: StepPlan) -> bool:
        """Hands this step's loads to the copy thread, and waits for those the step computes over
        (in_step); True when one of those failed. On CUDA (called on vLLM's thread, before the forward)
        the loads' writes will wait for what vLLM has queued so far: a block handed to a load may still
        be read by the last step's kernels (vLLM may schedule ahead of the GPU)."""
        queued = None
        if meta.loads and self.stream is not None:
            queued = torch.cuda.Event()
            queued.record()  # on vLLM's current stream
        in_step = []
        for spec in meta.loads:
            future = self._thread.submit(self._load, spec, queued)
            if spec.in_step:
                in_step.append(future)
            else:
                self._loading[spec.req_id] = future
        # their failed blocks go to vLLM with this step's output; they are never reported finished.
        # A list, not a generator: every load's result is taken in, also after one that failed.
        return any([self._ended(f.result()) for f in in_step])

    def get_finished(self, wait: bool = False) -> set[str]:
        """Requests whose load has ended on this rank; their failed blocks are in take_load_errors()
        of this same step (vLLM asks for both after each step, in that order).
        wait: the step computed nothing, so the engine would only spin through empty steps until a
        load ends, each taking a core from the copy thread (measured: a 31 MiB load took 60-90 ms
        among the spinning steps against about 10 ms alone): wait for one, up to IDLE_WAIT_SECONDS."""
        if wait and self._loading:
            concurrent.futures.wait(
                list(self._loading.values()), IDLE_WAIT_SECONDS, concurrent.futures.FIRST_COMPLETED
            )
        for req_id in [r for r, f in self._loading.items() if f.done()]:
            if self._ended(self._loading.pop(req_id).result()):
                self._failed_requests.add(req_id)
            self._finished.add(req_id)
        done, self._finished = self._finished, set()
        return done

    def _ended(self, loaded: _Loaded) -> bool:
        """Takes in what a load did; True when a block of it failed."""
        self._failed_blocks.update(loaded.failed_blocks)
        for name, value in (
            ("loaded_chunks", loaded.chunks),
            ("loaded_bytes", loaded.bytes),
            ("corrupt_chunks", loaded.corrupt),
            ("sidecar_errors", loaded.errors),
            ("load_failed_blocks", len(loaded.failed_blocks)),
            ("load_seconds", loaded.seconds),
        ):
            if value:
                self.stats.add(name, value)
        return bool(loaded.failed_blocks)

    def take_load_errors(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def take_failed_requests(self) -> set[str]:
        """Requests whose load failed, for vLLM's failed_recving (a hybrid model's block ids are per
        group, so vLLM takes no block ids from it: the whole request recomputes)."""
        out, self._failed_requests = self._failed_requests, set()
        return out

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)  # no copy reads the arena after this

    # --- on the copy thread ------------------------------------------------------------------------

    def _load(self, spec: LoadSpec, queued: torch.cuda.Event | None = None) -> _Loaded:
        """One request's chunks, in order, up to the first that fails."""
        t0 = time.perf_counter()
        out = _Loaded(spec.req_id)
        ops = spec.chunks
        keys = [rank_key(op.link, self.rank) for op in ops]
        try:
            pinned = self.client.pin(keys, verify=False)
            try:
                if self._load_chunks(list(zip(ops, pinned.slots, strict=False)), queued, out):
                    out.corrupt += 1
                    # the sidecar re-checks this chunk and the rest (still pinned): a rogue
                    # write seldom hits one chunk alone, and the next lookup should not offer them
                    self._report(keys[out.chunks :])
            finally:
                with contextlib.suppress(SidecarError):  # a lease expires by itself
                    self.client.release(pinned.lease)
        except ArenaChanged as e:
            # The header is not the one the sidecar named: it restarted, or something wrote over the
            # header. Told, the sidecar checks its header and, if changed, drops every chunk and
            # writes a new epoch, so it stops offering hits no worker can load.
            out.errors += 1
            self._warn.warning("load", "kvpool: load of %s failed, vLLM recomputes it: %s", spec.req_id, e)
            self._report(keys[out.chunks : out.chunks + 1])
        except SidecarError as e:  # unreachable, refused, or restarted: a recompute
            out.errors += 1
            self._warn.warning("load", "kvpool: load of %s failed, vLLM recomputes it: %s", spec.req_id, e)
        except Exception:  # a bug: still only a recompute, never a failed request
            out.errors += 1
            self._warn.exception("load-bug", "kvpool: load of %s failed, vLLM recomputes it", spec.req_id)
        if self.stream is not None:
            try:
                self.stream.synchronize()  # the verified chunks' copies have run: reportable
            except Exception:  # a CUDA error: nothing this request queued counts as loaded
                out.errors += 1
                self._warn.exception("load-bug", "kvpool: load of %s failed, vLLM recomputes it", spec.req_id)
                out.chunks = 0
        good = out.chunks
        out.bytes = sum(len(op.block_ids) * self.io.block_bytes(op.group) for op in ops[:good])
        out.failed_blocks = [b for op in ops[good:] for b in op.block_ids]
        out.seconds = time.perf_counter() - t0
        return out

    def _load_chunks(
        self, chunks: list[tuple[ChunkOp, Slot]], queued: torch.cuda.Event | None, out: _Loaded
    ) -> bool:
        """Loads pinned chunks in order up to the first whose bytes are wrong, counting each loaded in
        out.chunks (also when a later one raises); True when one was wrong (the sidecar told to drop it)."""
        if self.stream is None or self.pool is None:
            for op, slot in chunks:
                fitted = self._geometry(op, slot)
                if fitted is None or not self._loaded_cpu(fitted, slot):
                    return True
                out.chunks += 1
            return False
        if queued is not None:
            self.stream.wait_event(queued)
        return self._load_chunks_cuda(chunks, self.stream, self.pool, out)

    def _load_chunks_cuda(
        self,
        chunks: list[tuple[ChunkOp, Slot]],
        stream: torch.cuda.Stream,
        pool: ThreadPoolExecutor,
        out: _Loaded,
    ) -> bool:
        """CUDA: the copy threads stage chunks ahead (a bounded window); each verified one's DMA is
        queued in order. Returns only once no thread reads the arena (the caller gives the pin back)."""
        ahead = iter(chunks)
        window: deque[Future[tuple[ChunkOp, torch.Tensor | None]]] = deque(
            pool.submit(self._stage, op, slot) for op, slot in itertools.islice(ahead, self.staged_ahead)
        )
        try:
            while window:
                op, bounce = window.popleft().result()
                if bounce is None:
                    return True
                self.io.load_cuda(bounce, op, stream)
                out.chunks += 1
                for op, slot in itertools.islice(ahead, 1):
                    window.append(pool.submit(self._stage, op, slot))
            return False
        finally:
            for f in window:
                f.cancel()
            concurrent.futures.wait(window)

    def _stage(self, op: ChunkOp, slot: Slot) -> tuple[ChunkOp, torch.Tensor | None]:
        """CUDA, on a copy thread: the chunk in a private pinned buffer, verified (None: wrong bytes)."""
        fitted = self._geometry(op, slot)
        if fitted is None:
            return op, None
        assert self.mapping is not None, "loads start only after the KV caches are registered"
        chunk = self.mapping.slot(slot.epoch, slot.offset, slot.length)
        bounce = self.io.bounce(fitted.chunk_blocks, fitted.group)
        if self.io.stage_load(chunk, bounce) != slot.checksum:
            self._warn.warning("corrupt", "kvpool: chunk %s failed its checksum: dropped", slot.key)
            return fitted, None
        return fitted, bounce

    def _loaded_cpu(self, op: ChunkOp, slot: Slot) -> bool:
        """CPU: loads one pinned chunk straight into the blocks; False when its bytes are wrong."""
        assert self.mapping is not None, "loads start only after the KV caches are registered"
        chunk = self.mapping.slot(slot.epoch, slot.offset, slot.length)
        if self.io.load_cpu(chunk, op) != slot.checksum:
            self._warn.warning("corrupt", "kvpool: chunk %s failed its checksum: dropped", slot.key)
            return False
        return True

    def _geometry(self, op: ChunkOp, slot: Slot) -> ChunkOp | None:
        """The op fitted to the slot's chunk: a block prefix's key finds the first blocks of a longer
        chunk. None (and the chunk deleted) when no worker of this engine can load it."""
        expected = self.io.chunk_bytes(op.chunk_blocks, op.group)
        if slot.length == expected:
            return op
        block_bytes = self.io.block_bytes(op.group)
        blocks, rest = divmod(slot.length, block_bytes) if block_bytes else (0, 1)
        if not rest and blocks >= op.first_block + len(op.block_ids):
            return dataclasses.replace(op, chunk_blocks=blocks)
        # whatever its checksum says, the sidecar would offer it again to every request: deleted
        self._warn.warning(
            "geometry", "kvpool: chunk %s has %d bytes, expected %d: deleted", slot.key, slot.length, expected
        )
        try:
            self.client.delete(slot.key)
        except SidecarError as e:
            self._warn.warning("verify", "kvpool: could not have the sidecar drop %s: %s", slot.key, e)
        return None

    def _report(self, keys: list[str]) -> None:
        """Has the sidecar check its arena's header and these chunks' bytes (its checksum decides) and
        drop what fails, so the next lookup does not offer them."""
        try:
            self.client.verify(keys)
        except SidecarError as e:
            self._warn.warning("verify", "kvpool: could not have the sidecar check %s: %s", keys[:1], e)
