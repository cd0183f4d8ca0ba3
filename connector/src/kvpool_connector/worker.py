"""Worker half: loads chunks from the sidecar's arena into vLLM's paged KV buffer, saves them back.

Loads run beside the steps (loader.py): no step of the loading request, no other request sharing
its blocks through vLLM's prefix cache (which caches them only after the load), and no other rank
(vLLM waits for every rank's report) ever computes over a block that failed. Or, on a CPU engine by
default, before the forward of the step the request computes in (config.sync_loads): one step sooner.
There vLLM drops the step's output of every request over a failed block and recomputes from it, and
the worker keeps none of that step's saves.

Saves leave the step (saver.py): at its end (wait_for_save) a step's chunks go to the save thread,
which, once the next step begins, reserves, copies out and commits them with the checksum of the source
blocks while vLLM runs on; the sidecar refuses a commit whose reservation is no longer this writer's. A
step that reuses blocks a save has not read yet waits for it first (begin_step, from vLLM's
handle_preemptions). Nothing here raises
into vLLM: a cache failure is a miss or a recompute.

On CUDA a step's saves are copied out on a side stream as vLLM writes each layer: one gather and one
DMA a layer into one private pinned buffer for all of the step's chunks. The step's end only makes
vLLM's stream wait (on the GPU) for the last copies, so no later kernel rewrites a block before it is
read; the save thread waits for them, then hashes and writes the chunks, several at once on the copy
threads. Measured on an H100 (BENCHMARKS.md, #26).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvpool_sidecar.client import Slot
from kvpool_sidecar.client_errors import SidecarError, SidecarRefused
from kvpool_sidecar.wire import ARENA_HEADER_BYTES

from .affinity import side_thread
from .arena_mapping import ArenaMapping, arena_path
from .breaker import Breaker
from .chunk_io import ChunkIO
from .chunk_saves import ChunkSave, ChunkSaves, SaveOutcome
from .common import ChunkOp, StepPlan
from .config import KVPoolConfig, sidecar_client
from .counters import Counts
from .cpu_share import default_copy_threads
from .keys import rank_key
from .loader import ChunkLoader
from .logs import connector_logger
from .paged import PagedLayer
from .ratelimit import RateLimitedLog
from .save_process import RemoteLayer, SaveProcess, SaveProcessGone, Setup
from .saver import SaveJob, SaveQueue
from .shared_kv import SharedRegion, huge_page_mappings, on_huge_pages, share

log = connector_logger(__name__)

# CUDA: pinned bytes the steps' saves may hold while the save thread is behind; past it a step's saves
# are skipped (a slow sidecar never makes the host pin more).
MAX_STAGED_BYTES = 2 * 2**30


@dataclass(eq=False)
class _Staged:
    """CUDA: one step's saves of one KV cache group, copied out of vLLM's blocks on the side stream
    into one private pinned buffer: rows(buf, total, layer) holds a layer's blocks, chunk after chunk."""

    ids: torch.Tensor  # the blocks, on the device
    buf: torch.Tensor  # pinned
    total: int
    done: torch.cuda.Event | None = None  # recorded on the side stream after the step's last copy


class KVPoolWorker:
    def __init__(self, cfg: KVPoolConfig, rank: int, saves: bool = True):
        self.cfg = cfg
        self.rank = rank  # pipeline stage * TP size + TP rank: picks this worker's keys
        self.saves = saves  # False: another TP rank saves the same KV (MLA), this one only loads
        # Never replaced: a connection that failed is dropped by the client's pool, so the copy
        # thread and the engine thread may both use it at any time.
        self.client = sidecar_client(cfg)
        self.stats = Counts()
        self.io = ChunkIO([])
        self.layer_index: dict[str, int] = {}
        self._mapping = ArenaMapping(self._arena_path)
        self._stream: torch.cuda.Stream | None = None
        self._pool: ThreadPoolExecutor | None = None  # CUDA: the copy threads
        self.copy_threads = 0  # CUDA: how many (the config's, or cpu_share's default)
        self._saves: list[ChunkSave] = []  # CUDA: this step's saves, copied out layer by layer
        self._saves_of: StepPlan | None = None  # the step _saves belong to
        self._staged: dict[int, _Staged] = {}  # their pinned copies, by KV cache group
        self._layers_out: set[int] = set()  # layers of _saves already queued
        self._staged_bytes = 0  # pinned bytes held by saves not finished yet
        self._staged_lock = threading.Lock()
        self._saves_refused = False  # the sidecar refused this worker's chunks: saving is off
        self._unsaved_step = -1  # a step whose in-step load failed: none of its saves is kept
        self._save_breaker = Breaker()  # a save waited out its timeout: the next steps do not wait
        self._warn = RateLimitedLog(log)
        self.loader = ChunkLoader(self.client, rank, self.stats, self._warn)
        self.saver = SaveQueue(self._run_save, threaded=cfg.async_saves)
        self._chunk_saves = ChunkSaves(self.client, rank, self._chunk_bytes, self.stats, self._warn)
        self._save_process: SaveProcess | None = None  # CPU: where the save thread's saves run

    # --- setup -----------------------------------------------------------------------------------

    def register_kv_caches(
        self,
        caches: list[tuple[str, torch.Tensor]],
        chunk_blocks: int = 0,
        groups: list[list[int]] | None = None,
    ) -> None:
        """chunk_blocks: blocks per full chunk, to check at once that the sidecar takes such chunks.
        groups: the indices in `caches` of each KV cache group's layers (default: one group)."""
        layers = [PagedLayer(t) for _, t in caches]
        self.io = ChunkIO(layers, groups)
        self.layer_index = {name: i for i, (name, _) in enumerate(caches)}
        if self.io.cuda:
            self._stream = torch.cuda.Stream()
            self.copy_threads = self.cfg.copy_threads or default_copy_threads(torch.cuda.device_count())
            self._pool = ThreadPoolExecutor(
                self.copy_threads, thread_name_prefix="kvpool-copy", initializer=side_thread
            )
        self.loader.attach(self.io, self._mapping, self._stream, self._pool, self.copy_threads)
        self._start_save_process(layers)
        if chunk_blocks:
            self._check_chunk_size(chunk_blocks * self.io.max_block_bytes)
        log.info(
            "kvpool: %d layers, %d bytes per block, %d KV cache group(s), %s copies, device %s%s, "
            "keys of rank %d%s%s",
            len(layers),
            self.io.max_block_bytes,
            len(self.io.groups),
            "byte-row" if all(layer.dense for layer in layers) else "logical",
            layers[0].device if layers else "-",
            f" ({self.copy_threads} copy threads)" if self.copy_threads else "",
            self.rank,
            "" if self.saves else " (loads only: another TP rank saves the same KV)",
            f", saves in process {sp.pid} ({sp.reader})" if (sp := self._save_process) else "",
        )

    def _start_save_process(self, layers: list[PagedLayer]) -> None:
        """CPU: starts the process the saves run in (save_process.py), where the config allows and every
        layer's blocks are byte rows; it reads vLLM's blocks where they are, through a shared mapping
        of the KV cache where the worker can move it onto one (shared_kv.py)."""
        if self._save_process is not None:  # the engine's KV cache was allocated again
            self._save_process.close()
            self._save_process = None
        cfg = self.cfg
        if self.io.cuda or not (self.saves and cfg.save_process and cfg.async_saves):
            return
        if not layers or not all(layer.dense for layer in layers):
            return
        remote = [RemoteLayer.of(layer) for layer in layers]
        regions = _shared_regions(layers)
        try:
            setup = Setup(cfg, self.rank, os.getpid(), remote, self.io.groups, regions)
            self._save_process = SaveProcess(setup)
        except (OSError, SaveProcessGone) as e:  # it cannot read the worker's memory, or never started
            log.warning("kvpool: saves run on the worker's own thread: no save process (%s)", e)
        finally:
            for r in regions:  # the child has its own copy of each; the mappings stay
                os.close(r.fd)

    def _check_chunk_size(self, size: int) -> None:
        """Turns saving off at start, with one clear error, when the sidecar refuses chunks this big
        (a 70B model at TP 1 with 256-token chunks) or its arena cannot hold one (every save would be
        skipped, silently); a sidecar not up yet is checked at the first save instead (its refusal
        does the same)."""
        try:
            info = self.client.arena_info()
            limit, capacity = int(info["max_chunk_bytes"]), int(info["size"]) - ARENA_HEADER_BYTES
        except (SidecarError, KeyError, ValueError, TypeError):
            return
        for bound, what in ((limit, "--max-chunk-bytes"), (capacity, "arena (--capacity)")):
            if size > bound:
                self._refused(SidecarRefused(f"a chunk is {size} bytes, the sidecar's {what} {bound}"))
                return

    def _arena_path(self) -> str:
        return arena_path(self.cfg, self.client)

    # --- loads (loader.py) -----------------------------------------------------------------------

    def start_load(self, meta: StepPlan) -> None:
        if self.loader.start(meta):
            # The step computes over blocks that failed to load. Which requests read them (a prefix
            # hit shares blocks) is vLLM's to know, so none of what the step writes is saved.
            self._unsaved_step = meta.step

    def get_finished(self, wait: bool = False) -> set[str]:
        return self.loader.get_finished(wait)

    def take_load_errors(self) -> set[int]:
        return self.loader.take_load_errors()

    def take_failed_requests(self) -> set[str]:
        return self.loader.take_failed_requests()

    # --- saves -----------------------------------------------------------------------------------

    def _planned(self, meta: StepPlan) -> list[ChunkSave]:
        if self._saves_refused or not self.saves:
            return []
        saves = [
            ChunkSave(op, rank_key(op.link, self.rank), s.priority) for s in meta.saves for op in s.chunks
        ]
        if saves and meta.step == self._unsaved_step:
            self.stats.add("save_skipped_chunks", len(saves))
            return []
        return saves

    def _copy_out_cuda(self, meta: StepPlan, layers: list[int]) -> None:
        """CUDA: queues `layers` of this step's saves into their pinned buffer, behind the forward."""
        assert self._stream is not None
        if self._saves_of is not meta:
            self._stage(meta)
        for i in layers:
            staged = self._staged.get(self.io.group_of[i])
            if staged is not None and i not in self._layers_out:
                self.io.copy_out_layer(staged.buf, staged.total, staged.ids, i, self._stream)
            self._layers_out.add(i)

    def _stage(self, meta: StepPlan) -> None:
        """CUDA, at a step's first copy: one pinned buffer per KV cache group for all its saves."""
        assert self._stream is not None
        self._saves_of, self._layers_out, self._staged = meta, set(), {}
        self._saves = self._planned(meta)
        need = sum(self._bytes(s) for s in self._saves)
        with self._staged_lock:
            if self._saves and self._staged_bytes + need > MAX_STAGED_BYTES:
                self.stats.add("save_skipped_chunks", len(self._saves))  # the save thread is this far behind
                self._saves = []
                return
        for group in dict.fromkeys(s.op.group for s in self._saves):
            saves = [s for s in self._saves if s.op.group == group]
            blocks = [b for s in saves for b in s.op.block_ids]
            ids = self.io.device_ids(blocks, self._stream)
            staged = _Staged(ids, self.io.bounce(len(blocks), group), len(blocks))
            first = 0
            for s in saves:
                s.staged, s.first = staged, first
                first += len(s.op.block_ids)
            with self._staged_lock:  # counted as staged, given back by _unstage
                self._staged_bytes += sum(self._bytes(s) for s in saves)
            self._staged[group] = staged

    def _bytes(self, s: ChunkSave) -> int:
        return self._chunk_bytes(s.op)

    def _chunk_bytes(self, op: ChunkOp) -> int:
        return self.io.chunk_bytes(op.chunk_blocks, op.group)

    def _unstage(self, saves: list[ChunkSave]) -> None:
        """Gives back the pinned bytes of saves that finished or were dropped (those given a buffer)."""
        with self._staged_lock:
            self._staged_bytes -= sum(self._bytes(s) for s in saves if s.staged)

    @property
    def copies_layers(self) -> bool:
        """Whether save_layer has any work: CUDA copies each layer out inside the forward."""
        return self._stream is not None

    def save_layer(self, layer_name: str, meta: StepPlan) -> None:
        """Called inside the forward as each layer is written: on CUDA its copy starts at once.
        Never raises into vLLM."""
        if self._stream is None or not meta.saves or (i := self.layer_index.get(layer_name)) is None:
            return
        try:
            self._copy_out_cuda(meta, [i])
        except Exception:  # a bug or a CUDA error: no save this step, never a failed forward
            msg = "kvpool: copying out layer %s failed, no save this step"
            self._warn.exception("save-copy", msg, layer_name)
            self._drop_step_saves()

    def _drop_step_saves(self) -> None:
        self._unstage(self._saves)
        self._saves, self._staged = [], {}

    def finish_step(self, meta: StepPlan) -> None:
        """Hands this step's saves to the save thread. On CUDA no kernel vLLM queues after this rewrites
        a block before the step's copies have read it (vLLM's stream waits for them on the GPU; the host
        goes on); on the CPU the save thread's reads are fenced (fence)."""
        if self._stream is not None:
            try:
                if meta.saves:
                    self._copy_out_cuda(meta, list(range(len(self.io.layers))))
                if self._staged:
                    done = torch.cuda.Event()
                    done.record(self._stream)
                    torch.cuda.current_stream().wait_event(done)
                    for staged in self._staged.values():
                        staged.done = done
            except Exception:
                self._warn.exception("save-copy", "kvpool: copying out failed, no save this step")
                self._drop_step_saves()
            saves, self._saves, self._saves_of, self._staged = self._saves, [], None, {}
        else:
            saves = self._planned(meta)
        self.saver.note(meta.step)
        if not saves:
            return
        if self._save_breaker.open:  # the sidecar is hung: its saves are skipped, not queued
            self.stats.add("save_skipped_chunks", len(saves))
            self._unstage(saves)
            return
        if not self.saver.put(SaveJob(meta.step, saves, reads_blocks=self._stream is None)):
            self.stats.add("save_skipped_chunks", len(saves))  # the sidecar is this far behind
            self._unstage(saves)

    def begin_step(self, meta: StepPlan) -> None:
        """Before the step touches a block (handle_preemptions): the earlier steps' saves may start
        (saver.py), and no save of a step <= meta.fence reads a block the step reuses any more. Saves a
        slow sidecar kept from copying in time are dropped: a future miss."""
        self.saver.begin(meta.step)
        if meta.fence:
            t0 = time.perf_counter()
            fenced = self.saver.fence(meta.fence)
            self.stats.add("save_fence_seconds", time.perf_counter() - t0)  # the saves' cost on the step
            if fenced:
                self.stats.add("save_fenced_chunks", sum(len(job.saves) for job in fenced))

    def saved_through(self) -> int:
        return self.saver.saved_through()

    def _run_save(self, job: SaveJob) -> None:
        """One step's saves, on the save thread."""
        t0 = time.perf_counter()
        try:
            if self._save_breaker.open:  # tripped by an earlier step's save while this one was queued
                self.stats.add("save_skipped_chunks", len(job.saves))
                return
            outcome = self._save(job)
            if outcome.timed_out is not None:
                self._save_breaker.trip()
                seconds = self._save_breaker.seconds
                msg = "kvpool: a save timed out, none for %.0f s: %s"
                self._warn.warning("save-timeout", msg, seconds, outcome.timed_out)
            if outcome.refused is not None:
                self._refused(outcome.refused)
        except Exception:  # a bug: a future miss, never a failed request
            self._warn.exception("save-bug", "kvpool: saving %d chunks failed", len(job.saves))
        finally:
            self._unstage(job.saves)
        self.stats.add("save_seconds", time.perf_counter() - t0)

    def _save(self, job: SaveJob) -> SaveOutcome:
        """One step's saves: in the save process where there is one, else on this thread."""
        start_copy, end_copy = (lambda: self.saver.start_copy(job)), (lambda: self.saver.end_copy(job))
        if self._save_process is not None:
            try:
                outcome, counts = self._save_process.save(job.saves, start_copy, end_copy)
            except SaveProcessGone as e:
                self.stats.add("save_skipped_chunks", len(job.saves))
                log.warning("kvpool: the save process is gone (%s); saves run on the worker's thread", e)
                self._save_process.close()
                self._save_process = None
                return SaveOutcome()
            for name, value in counts.items():
                self.stats.add(name, value)
            return outcome
        return self._chunk_saves.save(job.saves, self._write_all, start_copy, end_copy)

    def _write_all(self, reserved: list[tuple[ChunkSave, Slot]]) -> list[tuple[Slot, int]]:
        """Writes the reserved chunks: on CUDA several at once on the copy threads (each hashes and
        copies); returns once none writes any more."""
        if self._pool is None or len(reserved) < 2:
            return [(slot, self._write(s, slot)) for s, slot in reserved]
        futures = [self._pool.submit(self._write, s, slot) for s, slot in reserved]
        concurrent.futures.wait(futures)
        return [(slot, f.result()) for (_, slot), f in zip(reserved, futures, strict=True)]

    def _write(self, s: ChunkSave, slot: Slot) -> int:
        """Writes one chunk into its reserved slot; returns the checksum of its source bytes."""
        chunk = self._mapping.slot(slot.epoch, slot.offset, slot.length)
        if s.staged is None:
            return self.io.save_cpu(chunk, s.op)
        assert s.staged.done is not None, "a step's saves are queued only after its copies"
        s.staged.done.synchronize()  # the step's copies into the pinned buffer have run
        st = s.staged
        return self.io.save_staged(chunk, st.buf, st.total, s.first, s.op.chunk_blocks, s.op.group)

    def _refused(self, e: SidecarError | str) -> None:
        """The sidecar refuses our chunks as such (larger than its --max-chunk-bytes): say so once and
        stop saving; asking again every step would only repeat it."""
        self._saves_refused = True
        log.error(
            "kvpool: the sidecar refuses this worker's chunks (%s); saving is off for this worker. Give "
            "the sidecar a larger --max-chunk-bytes or --capacity (the pool's capacity), or use a "
            "smaller chunk_size.",
            e,
        )

    def take_stats(self) -> dict[str, float] | None:
        return self.stats.take()

    def shutdown(self) -> None:
        self.saver.close()  # queued saves dropped; none writes the arena after this
        if self._save_process is not None:
            self._save_process.close()
        self.loader.shutdown()  # no copy reads the arena after this
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._mapping.close()
        self.client.close()


def _shared_regions(layers: list[PagedLayer]) -> tuple[SharedRegion, ...]:
    """The KV cache's allocations moved onto memfds for the save process (shared_kv.py); none where
    the kernel refuses (a seccomp profile without memfd_create): it reads them out of this process."""
    storages = {(st := lay.cache.untyped_storage()).data_ptr(): st.nbytes() for lay in layers}
    regions: list[SharedRegion] = []
    huge, kept = huge_page_mappings(), 0
    try:
        for address, length in storages.items():
            if (region := share(address, length, huge)) is not None:
                regions.append(region)
            elif on_huge_pages(address, length, huge):
                kept += 1
    except OSError as e:
        log.warning("kvpool: the save process reads the KV cache out of this process, not shared (%s)", e)
        for r in regions:
            os.close(r.fd)
        return ()
    if kept:
        log.info(
            "kvpool: %d of the KV cache's %d allocations stay on their transparent huge pages, which a "
            "memfd's 4 KiB pages would slow vLLM's attention against; the save process reads them out "
            "of this process",
            kept,
            len(storages),
        )
    return tuple(regions)
