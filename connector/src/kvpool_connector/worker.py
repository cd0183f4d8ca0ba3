"""Worker half: copies chunks between vLLM's paged KV buffer and the sidecar's shared-memory arena.

A chunk's bytes are, for each layer in order, its blocks' pages one after another. Loads pin their
chunks before the forward and copy them during it, layer by layer; a chunk that cannot be pinned
(evicted, sidecar gone) or whose bytes fail their checksum leaves its blocks in
get_block_ids_with_load_errors, so vLLM discards that step's output for the request and recomputes the
blocks. The checksum is checked here, on the copy thread after the copies, not by the sidecar at pin
time, where hashing every byte sat on the step's critical path. Saves reserve arena slots, copy, then
commit (the client checksums what it commits); they finish inside wait_for_save, so no block is
reused before its bytes are out.
On CUDA the arena is pinned with cudaHostRegister and copies run on a side stream: loads are queued
before the forward (whose stream waits for them on the GPU) while the copy thread checks the
checksums; each layer's save starts as soon as the forward has written it (save_kv_layer). That
path has not been run: no GPU was available to this work.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvpool_sidecar.client import SidecarClient, SidecarError, Slot, checksum

from .common import ChunkOp, KVPoolMetadata
from .config import KVPoolConfig
from .keys import rank_key
from .metrics import KVPoolStats
from .paged import PagedLayer

log = logging.getLogger(__name__)


def _off_compute_cores() -> None:
    """Moves the copy thread off the cores the forward is bound to (it inherits their affinity),
    so on CPU the copies of later layers overlap the forward's compute of earlier ones."""
    mine = os.sched_getaffinity(0)
    others = set(range(os.cpu_count() or 1)) - mine
    if others:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, others)


@dataclass
class _Load:
    req_id: str
    op: ChunkOp
    ids: torch.Tensor  # the op's block ids, on the cache's device
    slot: Slot  # where the pinned chunk is, and its checksum


@dataclass
class _LoadJob:
    """One step's loads, one per pinned chunk."""

    work: list[_Load] = field(default_factory=list)
    leases: list[str] = field(default_factory=list)
    done: list[threading.Event] = field(default_factory=list)  # per layer: its copies are in place
    corrupt: set[str] = field(default_factory=set)  # keys whose bytes failed their checksum
    future: Future | None = None
    error: BaseException | None = None
    seconds: float = 0.0


@dataclass
class _PendingSave:
    slot: Slot
    op: ChunkOp


class KVPoolWorker:
    def __init__(self, cfg: KVPoolConfig, rank: int):
        self.cfg = cfg
        self.rank = rank  # pipeline stage * TP size + TP rank: picks this worker's keys
        self.client = SidecarClient(cfg.sidecar_url, timeout=cfg.timeout_ms / 1000, shm_path=cfg.shm_path)
        self.layers: list[PagedLayer] = []
        self.layer_index: dict[str, int] = {}
        self.stats = KVPoolStats()
        self._arena: torch.Tensor | None = None
        self._arena_id: tuple[str, int, int] | None = None  # (path, st_dev, st_ino) of the mapped file
        self._failed_blocks: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._pending: list[_PendingSave] = []
        self._cuda = False
        self._stream: torch.cuda.Stream | None = None
        self._staging: list[torch.Tensor] = []
        self._layers_done: set[int] = set()  # layers of this step's pending saves already copied
        self._reserved = False  # this step's saves were reserved before the forward (CUDA)
        self._loading: _LoadJob | None = None
        self._executor: ThreadPoolExecutor | None = None

    # --- setup -----------------------------------------------------------------------------------

    def register_kv_caches(self, caches: list[tuple[str, torch.Tensor]]) -> None:
        self.layers = [PagedLayer(t) for _, t in caches]
        self.layer_index = {name: i for i, (name, _) in enumerate(caches)}
        self._cuda = bool(self.layers) and self.layers[0].device.type == "cuda"
        if self._cuda:
            self._stream = torch.cuda.Stream()
        self._loader().submit(torch.zeros(1).copy_, torch.ones(1)).result()  # started now, not in a request
        dense = all(layer.dense for layer in self.layers)
        log.info(
            "kvpool: %d layers, %d bytes per block, %s copies, device %s",
            len(self.layers),
            self._block_bytes(),
            "byte-row" if dense else "logical",
            self.layers[0].device if self.layers else "-",
        )

    def _block_bytes(self) -> int:
        return sum(layer.page_bytes for layer in self.layers)

    def chunk_bytes(self, num_blocks: int) -> int:
        return num_blocks * self._block_bytes()

    def _arena_path(self) -> str:
        if self.cfg.shm_path:
            return os.path.join(self.cfg.shm_path, "arena")
        url = self.cfg.sidecar_url.rstrip("/") + "/v1/arena"
        try:
            with urllib.request.urlopen(url, timeout=self.cfg.timeout_ms / 1000) as r:
                return json.loads(r.read())["path"]
        except (OSError, ValueError, KeyError) as e:
            raise SidecarError(f"GET {url}: {e!r}") from e

    def _arena_is_live(self) -> bool:
        """False when the sidecar has restarted with a new arena file since we mapped ours: offsets it
        hands out then point into a file we no longer see, so reading them would load wrong bytes."""
        if self._arena_id is None:
            return False
        path, dev, ino = self._arena_id
        try:
            st = os.stat(path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == (dev, ino)

    def _reconnect(self) -> None:
        """Forgets the client and the mapping after a sidecar failure; the next call starts afresh."""
        self.client.close()
        self.client = SidecarClient(
            self.cfg.sidecar_url, timeout=self.cfg.timeout_ms / 1000, shm_path=self.cfg.shm_path
        )
        self._arena = None
        self._arena_id = None

    def _arena_tensor(self) -> torch.Tensor:
        """The sidecar's arena as a uint8 tensor, mapped once (and pinned for DMA on CUDA)."""
        if self._arena is None:
            path = self._arena_path()
            st = os.stat(path)
            arena = torch.frombuffer(self.client.arena(), dtype=torch.uint8)
            self._arena_id = (path, st.st_dev, st.st_ino)
            if self._cuda:
                err = torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 0)
                if int(err) != 0:
                    log.warning("kvpool: cudaHostRegister failed (%s); copies will not be DMA", err)
            self._arena = arena
        return self._arena

    def _rows(self, arena: torch.Tensor, offset: int, op: ChunkOp, layer: int) -> torch.Tensor:
        """The arena rows of `op`'s blocks for one layer."""
        start = offset + op.chunk_blocks * sum(lay.page_bytes for lay in self.layers[:layer])
        page = self.layers[layer].page_bytes
        region = arena[start : start + op.chunk_blocks * page].view(op.chunk_blocks, page)
        return region[op.first_block : op.first_block + len(op.block_ids)]

    def _ids(self, op: ChunkOp) -> torch.Tensor:
        return torch.tensor(op.block_ids, dtype=torch.int64, device=self.layers[0].device)

    # --- loads -----------------------------------------------------------------------------------

    def start_load(self, meta: KVPoolMetadata) -> None:
        """Pins every chunk this step loads, then copies them into the paged buffer: on CPU in a
        background thread, layer by layer, so the forward starts at once and each attention layer
        waits only for its own layer (wait_for_layer_load); on CUDA on the side stream."""
        job = _LoadJob()
        t0 = time.perf_counter()
        for load in meta.loads:
            ops = load.chunks
            usable = 0
            try:
                # checked against slot.checksum on the copy thread, off the critical path
                pinned = self.client.pin([rank_key(op.link, self.rank) for op in ops], verify=False)
                job.leases.append(pinned.lease)
                self._arena_tensor()
                if pinned.slots and not self._arena_is_live():
                    raise SidecarError("the sidecar's arena changed (restarted); remapping")
                for op, slot in zip(ops, pinned.slots, strict=False):
                    if slot.length != self.chunk_bytes(op.chunk_blocks):
                        log.warning(
                            "kvpool: chunk %s has %d bytes, expected %d",
                            slot.key,
                            slot.length,
                            self.chunk_bytes(op.chunk_blocks),
                        )
                        break
                    job.work.append(_Load(load.req_id, op, self._ids(op), slot))
                    usable += 1
            except Exception as e:  # a cache failure is a recompute, never a failed request
                self.stats.add("sidecar_errors")
                log.warning("kvpool: load of %s failed, vLLM recomputes it: %r", load.req_id, e)
                self._reconnect()
            if usable < len(ops):
                self._fail(load.req_id, [b for op in ops[usable:] for b in op.block_ids])
        self.stats.add("load_seconds", time.perf_counter() - t0)
        if not job.work:
            self._release(job.leases)
            return
        job.done = [threading.Event() for _ in self.layers]
        self._loading = job
        if self._cuda:  # queued on the side stream now; the forward's stream waits for them on the GPU
            try:
                self._copy_layers(job)
            except Exception as e:  # reported as load errors in this same step
                job.error = e
            torch.cuda.current_stream().wait_stream(self._stream)
        job.future = self._loader().submit(self._finish_in_background, job)

    def _copy_layers(self, job: _LoadJob) -> None:
        """Copies every chunk of the job into the paged buffer, layer by layer, signalling each layer."""
        arena = self._arena_tensor()
        for i, layer in enumerate(self.layers):
            if self._cuda:
                with torch.cuda.stream(self._stream):
                    for w in job.work:
                        rows = self._rows(arena, w.slot.offset, w.op, i)
                        layer.scatter(w.ids, rows.to(layer.device, non_blocking=True))
            else:
                for w in job.work:
                    layer.scatter(w.ids, self._rows(arena, w.slot.offset, w.op, i))
            job.done[i].set()

    def _finish_in_background(self, job: _LoadJob) -> None:
        """On the copy thread: the copies (CPU; on CUDA they are queued already), then the checksums,
        then the leases are given back once no copy reads the arena any more."""
        t0 = time.perf_counter()
        try:
            if not self._cuda:
                self._copy_layers(job)
            if job.error is None:
                job.corrupt = self._corrupt(job)
            if self._cuda:
                self._stream.synchronize()
        except Exception as e:  # reported as load errors in this same step
            job.error = e
        finally:
            for event in job.done:
                event.set()
            self._release(job.leases)
            job.seconds = time.perf_counter() - t0

    def _corrupt(self, job: _LoadJob) -> set[str]:
        """Keys of the chunks whose arena bytes no longer match the checksum they were saved with.
        The forward may already have read them: reported as load errors, vLLM discards that output
        and recomputes. The sidecar re-checks them itself and drops those that fail."""
        view = self._arena_tensor().numpy()  # the mapping the copies read
        bad = {
            w.slot.key
            for w in job.work
            if checksum(view[w.slot.offset : w.slot.offset + w.slot.length]) != w.slot.checksum
        }
        if bad:
            try:
                self.client.verify(sorted(bad))
            except SidecarError as e:
                log.warning("kvpool: could not have the sidecar drop corrupt chunks: %s", e)
        return bad

    def wait_layer(self, layer_name: str) -> None:
        job = self._loading
        if job is not None and (i := self.layer_index.get(layer_name)) is not None:
            job.done[i].wait()

    def _finish_load(self) -> None:
        """Waits for this step's copies; a copy that failed turns its chunks into load errors."""
        job, self._loading = self._loading, None
        if job is None:
            return
        if job.future is not None:
            job.future.result()
        self.stats.add("load_seconds", job.seconds)
        if job.error is not None:
            log.warning("kvpool: copying loaded chunks failed, vLLM recomputes them: %r", job.error)
            for w in job.work:
                self._fail(w.req_id, w.op.block_ids)
            return
        self.stats.add("corrupt_chunks", len(job.corrupt))
        loaded, failed = [], set()
        for w in job.work:  # a request's chunks after a corrupt one hang on it: recomputed as well
            if w.slot.key in job.corrupt:
                log.warning("kvpool: chunk %s failed its checksum", w.slot.key)
                failed.add(w.req_id)
            if w.req_id in failed:
                self._fail(w.req_id, w.op.block_ids)
            else:
                loaded.append(w)
        self.stats.add("loaded_chunks", len(loaded))
        self.stats.add("loaded_bytes", sum(len(w.op.block_ids) for w in loaded) * self._block_bytes())

    def _fail(self, req_id: str, blocks: list[int]) -> None:
        self._failed_blocks.update(blocks)
        self._failed_reqs.add(req_id)
        self.stats.add("load_failed_blocks", len(blocks))
        log.warning("kvpool: %d blocks of %s not loadable; vLLM recomputes them", len(blocks), req_id)

    def _release(self, leases: list[str]) -> None:
        for lease in leases:
            with contextlib.suppress(SidecarError):  # a lease expires by itself
                self.client.release(lease)

    def _loader(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                1, thread_name_prefix="kvpool-load", initializer=_off_compute_cores
            )
        return self._executor

    def take_load_errors(self) -> set[int]:
        self._finish_load()
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    # --- saves -----------------------------------------------------------------------------------

    def _reserve(self, meta: KVPoolMetadata) -> None:
        """Reserves arena slots for this step's saves (requests whose load failed save nothing now:
        their later chunks were computed over blocks that will be recomputed)."""
        for save in meta.saves:
            if save.req_id in self._failed_reqs:
                self.stats.add("save_skipped_chunks", len(save.chunks))
                continue
            items = [(rank_key(op.link, self.rank), self.chunk_bytes(op.chunk_blocks)) for op in save.chunks]
            try:
                slots = self.client.reserve(items, priority=save.priority)
            except SidecarError as e:
                self.stats.add("sidecar_errors")
                self.stats.add("save_skipped_chunks", len(items))
                log.warning("kvpool: save of %s skipped: %s", save.req_id, e)
                self._reconnect()
                continue
            for op, slot in zip(save.chunks, slots, strict=True):
                if slot is None:
                    self.stats.add("save_skipped_chunks")
                else:
                    self._pending.append(_PendingSave(slot, op))

    def begin_step(self, meta: KVPoolMetadata) -> None:
        """On CUDA, reserve before the forward so each layer's copy can start in save_kv_layer."""
        if self._cuda and meta.saves:
            self._reserve(meta)
            self._reserved = True

    def _copy_out(self, i: int) -> None:
        """Copies layer i of every pending chunk into its arena slot: on CPU at once, on CUDA queued on
        the side stream behind the work the forward has queued so far."""
        arena = self._arena_tensor()
        layer = self.layers[i]
        if not self._cuda:
            for p in self._pending:
                layer.gather(self._ids(p.op), self._rows(arena, p.slot.offset, p.op, i))
        else:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                for p in self._pending:
                    staging = torch.empty(
                        (len(p.op.block_ids), layer.page_bytes), dtype=torch.uint8, device=layer.device
                    )
                    layer.gather(self._ids(p.op), staging)
                    self._rows(arena, p.slot.offset, p.op, i).copy_(staging, non_blocking=True)
                    self._staging.append(staging)
        self._layers_done.add(i)

    def save_layer(self, layer_name: str) -> None:
        if self._cuda and self._pending and layer_name in self.layer_index:
            self._copy_out(self.layer_index[layer_name])

    def finish_step(self, meta: KVPoolMetadata) -> None:
        """Completes this step's saves: after this returns, every block's bytes are in the arena."""
        self._finish_load()  # saves read blocks the loads may still be writing
        t0 = time.perf_counter()
        try:
            if meta.saves and not self._reserved:
                self._reserve(meta)
            if self._pending:
                self._arena_tensor()
                if not self._arena_is_live():
                    raise SidecarError("the sidecar's arena changed (restarted); remapping")
                for i in range(len(self.layers)):
                    if i not in self._layers_done:
                        self._copy_out(i)
                if self._cuda:
                    self._stream.synchronize()  # the bytes are out: vLLM may reuse the blocks
                self.client.commit([p.slot for p in self._pending])
                self.stats.add("saved_chunks", len(self._pending))
                self.stats.add("saved_bytes", sum(p.slot.length for p in self._pending))
        except Exception as e:  # a failed save is a future miss, never a failed request
            self.stats.add("sidecar_errors")
            log.warning("kvpool: saving %d chunks failed: %r", len(self._pending), e)
            if self._cuda:
                self._stream.synchronize()
            with contextlib.suppress(SidecarError):  # the reservation's lease expires by itself
                self.client.abort([p.slot for p in self._pending])
            self._reconnect()
        finally:
            if meta.saves:
                self.stats.add("save_seconds", time.perf_counter() - t0)
            self._pending.clear()
            self._staging.clear()
            self._layers_done.clear()
            self._reserved = False
            self._failed_reqs.clear()

    def take_stats(self) -> KVPoolStats | None:
        return self.stats.take()

    def shutdown(self) -> None:
        self._finish_load()
        if self._executor is not None:
            self._executor.shutdown()
        self.client.close()
