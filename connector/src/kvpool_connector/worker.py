"""Worker half: loads chunks from the sidecar's arena into vLLM's paged KV buffer, saves them back.

Loads are asynchronous (vLLM's load_kv_async): a request whose chunks are loading waits, computing
nothing, while a background thread pins its chunks (promoting them from Redis when needed), copies
them into its blocks, checks each chunk's checksum over what it loaded and gives the pin back. The
request is reported finished (get_finished) together with the blocks that failed, in the same step,
so vLLM recomputes them before anything is computed over them: no step of this request, no other
request sharing its blocks through vLLM's prefix cache (which caches them only after the load), and
no other rank (vLLM waits for every rank's report) ever computes over a block that failed.

Saves run after the forward (wait_for_save): reserve, copy out, commit with the checksum of the
source blocks; the sidecar refuses a commit whose reservation is no longer this writer's. Nothing
here raises into vLLM: a cache failure is a miss or a recompute. On CUDA the copies go through private
pinned buffers on a side stream (see chunk_io.py); that path has not run here: no GPU was available.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvpool_sidecar.client import SidecarClient, SidecarError, SidecarRefused, SidecarTimeout, Slot, checksum

from .arena_mapping import ArenaMapping
from .breaker import Breaker
from .chunk_io import ChunkIO
from .common import ChunkOp, KVPoolMetadata, LoadSpec, SaveSpec
from .config import KVPoolConfig
from .keys import rank_key
from .logs import connector_logger
from .metrics import KVPoolStats
from .paged import PagedLayer
from .ratelimit import RateLimitedLog

log = connector_logger(__name__)
IDLE_WAIT_SECONDS = 0.02  # the longest an idle step waits for a load (new requests wait that long)


def _off_compute_cores() -> None:
    """Moves the copy thread off the cores the forward is bound to (it inherits their affinity),
    so on CPU the loads overlap the forward of the other requests."""
    mine = os.sched_getaffinity(0)
    others = set(range(os.cpu_count() or 1)) - mine
    if others:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, others)


@dataclass
class _Loaded:
    """What one request's load did (on this rank)."""

    req_id: str
    failed_blocks: list[int] = field(default_factory=list)
    chunks: int = 0
    blocks: int = 0
    corrupt: int = 0
    errors: int = 0
    seconds: float = 0.0


@dataclass
class _Save:
    op: ChunkOp
    key: str
    priority: int
    bounce: torch.Tensor | None = None  # CUDA: the chunk's bytes, filled layer by layer


class KVPoolWorker:
    def __init__(self, cfg: KVPoolConfig, rank: int):
        self.cfg = cfg
        self.rank = rank  # pipeline stage * TP size + TP rank: picks this worker's keys
        # Never replaced: a connection that failed is dropped by the client's pool, so the copy
        # thread and the engine thread may both use it at any time.
        self.client = SidecarClient(cfg.sidecar_url, timeout=cfg.timeout_ms / 1000, shm_path=cfg.shm_path)
        self.stats = KVPoolStats()
        self.io = ChunkIO([])
        self.layer_index: dict[str, int] = {}
        self._mapping = ArenaMapping(self._arena_path, cuda=False)
        self._stream: torch.cuda.Stream | None = None
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvpool-load", initializer=_off_compute_cores)
        self._loading: dict[str, Future[_Loaded]] = {}
        self._finished: set[str] = set()  # loads done, not yet reported
        self._failed_blocks: set[int] = set()  # their blocks that failed, reported with them
        self._saves: list[_Save] = []  # CUDA: this step's saves, copied out layer by layer
        self._saves_of: KVPoolMetadata | None = None  # the step _saves belong to
        self._layers_out: set[int] = set()  # layers of _saves already queued
        self._saves_refused = False  # the sidecar refused this worker's chunks: saving is off
        self._save_breaker = Breaker()  # a save waited out its timeout: the next steps do not wait
        self._warn = RateLimitedLog(log)

    # --- setup -----------------------------------------------------------------------------------

    def register_kv_caches(self, caches: list[tuple[str, torch.Tensor]], chunk_blocks: int = 0) -> None:
        """chunk_blocks: blocks per full chunk, to check at once that the sidecar takes such chunks."""
        layers = [PagedLayer(t) for _, t in caches]
        self.io = ChunkIO(layers)
        self.layer_index = {name: i for i, (name, _) in enumerate(caches)}
        if self.io.cuda:
            self._stream = torch.cuda.Stream()
            self._mapping = ArenaMapping(self._arena_path, cuda=True)
        self._loader.submit(torch.zeros(1).copy_, torch.ones(1)).result()  # started now, not in a request
        if chunk_blocks:
            self._check_chunk_size(self.io.chunk_bytes(chunk_blocks))
        log.info(
            "kvpool: %d layers, %d bytes per block, %s copies, device %s",
            len(layers),
            self.io.block_bytes,
            "byte-row" if all(layer.dense for layer in layers) else "logical",
            layers[0].device if layers else "-",
        )

    def chunk_bytes(self, num_blocks: int) -> int:
        return self.io.chunk_bytes(num_blocks)

    def _check_chunk_size(self, size: int) -> None:
        """Turns saving off at start, with one clear error, when the sidecar refuses chunks this big
        (a 70B model at TP 1 with 256-token chunks); a sidecar not up yet is checked at the first
        save instead (its refusal does the same)."""
        try:
            limit = int(self.client.arena_info()["max_chunk_bytes"])
        except (SidecarError, KeyError, ValueError, TypeError):
            return
        if size > limit:
            self._refused(SidecarRefused(f"a chunk is {size} bytes, the sidecar's --max-chunk-bytes {limit}"))

    def _arena_path(self) -> str:
        if self.cfg.shm_path:
            return os.path.join(self.cfg.shm_path, "arena")
        try:
            return str(self.client.arena_info()["path"])
        except KeyError as e:
            raise SidecarError(f"GET /v1/arena named no path: {e!r}") from e

    # --- loads (asynchronous) ----------------------------------------------------------------------

    def start_load(self, meta: KVPoolMetadata) -> None:
        """Hands this step's loads to the copy thread; returns at once."""
        for spec in meta.loads:
            self._loading[spec.req_id] = self._loader.submit(self._load, spec)

    def _load(self, spec: LoadSpec) -> _Loaded:
        """On the copy thread: one request's chunks, in order, up to the first that fails."""
        t0 = time.perf_counter()
        out = _Loaded(spec.req_id)
        ops = spec.chunks
        good = 0
        try:
            pinned = self.client.pin([rank_key(op.link, self.rank) for op in ops], verify=False)
            try:
                for op, slot in zip(ops, pinned.slots, strict=False):
                    if not self._load_chunk(op, slot):
                        out.corrupt += 1
                        break
                    good += 1
            finally:
                self._release(pinned.lease)
        except SidecarError as e:  # unreachable, refused, or restarted: a recompute
            out.errors += 1
            self._warn.warning("load", "kvpool: load of %s failed, vLLM recomputes it: %s", spec.req_id, e)
        except Exception:  # a bug: still only a recompute, never a failed request
            out.errors += 1
            self._warn.exception("load-bug", "kvpool: load of %s failed, vLLM recomputes it", spec.req_id)
        out.chunks = good
        out.blocks = sum(len(op.block_ids) for op in ops[:good])
        out.failed_blocks = [b for op in ops[good:] for b in op.block_ids]
        out.seconds = time.perf_counter() - t0
        return out

    def _load_chunk(self, op: ChunkOp, slot: Slot) -> bool:
        """Loads one pinned chunk; False (the sidecar told to drop it) when its bytes are wrong."""
        expected = self.io.chunk_bytes(op.chunk_blocks)
        if slot.length != expected:
            # found by a block prefix's key: the first blocks of a longer chunk
            blocks, rest = divmod(slot.length, self.io.block_bytes) if self.io.block_bytes else (0, 1)
            if rest or blocks < op.first_block + len(op.block_ids):
                self._warn.warning(
                    "geometry", "kvpool: chunk %s has %d bytes, expected %d", slot.key, slot.length, expected
                )
                return False
            op = dataclasses.replace(op, chunk_blocks=blocks)
        chunk = self._mapping.tensor(slot.epoch)[slot.offset : slot.offset + slot.length]
        if self._stream is None:
            ok = self.io.load_cpu(chunk, op) == slot.checksum
        else:
            bounce = self.io.bounce(op.chunk_blocks)
            bounce.copy_(chunk)
            ok = checksum(bounce.numpy()) == slot.checksum
            if ok:
                self.io.load_cuda(bounce, op, self._stream)
                self._stream.synchronize()
        if not ok:
            self._warn.warning("corrupt", "kvpool: chunk %s failed its checksum: dropped", slot.key)
            try:
                self.client.verify([slot.key])  # the sidecar re-checks and drops it
            except SidecarError as e:
                self._warn.warning("verify", "kvpool: could not have the sidecar drop %s: %s", slot.key, e)
        return ok

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
            loaded = self._loading.pop(req_id).result()
            self._finished.add(req_id)
            self._failed_blocks.update(loaded.failed_blocks)
            for name, value in (
                ("loaded_chunks", loaded.chunks),
                ("loaded_bytes", loaded.blocks * self.io.block_bytes),
                ("corrupt_chunks", loaded.corrupt),
                ("sidecar_errors", loaded.errors),
                ("load_failed_blocks", len(loaded.failed_blocks)),
                ("load_seconds", loaded.seconds),
            ):
                if value:
                    self.stats.add(name, value)
        done, self._finished = self._finished, set()
        return done

    def take_load_errors(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def _release(self, lease: str) -> None:
        with contextlib.suppress(SidecarError):  # a lease expires by itself
            self.client.release(lease)

    # --- saves -----------------------------------------------------------------------------------

    def _planned(self, saves: list[SaveSpec]) -> list[_Save]:
        return [
            _Save(op, rank_key(op.link, self.rank), save.priority) for save in saves for op in save.chunks
        ]

    def _copy_out_cuda(self, meta: KVPoolMetadata, layers: list[int]) -> None:
        """CUDA: queues `layers` of this step's saves into their bounce buffers, behind the forward."""
        assert self._stream is not None
        if self._saves_of is not meta:
            self._saves_of, self._layers_out = meta, set()
            self._saves = [] if self._saves_refused else self._planned(meta.saves)
            for s in self._saves:
                s.bounce = self.io.bounce(s.op.chunk_blocks)
        for i in layers:
            if i not in self._layers_out:
                for s in self._saves:
                    assert s.bounce is not None
                    self.io.save_layer_cuda(s.bounce, s.op, i, self._stream)
                self._layers_out.add(i)

    def save_layer(self, layer_name: str, meta: KVPoolMetadata) -> None:
        """Called inside the forward as each layer is written: on CUDA its copy starts at once.
        Never raises into vLLM."""
        if self._stream is None or not meta.saves or (i := self.layer_index.get(layer_name)) is None:
            return
        try:
            self._copy_out_cuda(meta, [i])
        except Exception:  # a bug or a CUDA error: no save this step, never a failed forward
            msg = "kvpool: copying out layer %s failed, no save this step"
            self._warn.exception("save-copy", msg, layer_name)
            self._saves = []

    def finish_step(self, meta: KVPoolMetadata) -> None:
        """Completes this step's saves: after this returns, no block is read any more."""
        if self._stream is not None:
            try:
                if meta.saves:
                    self._copy_out_cuda(meta, list(range(len(self.io.layers))))
            except Exception:
                self._warn.exception("save-copy", "kvpool: copying out failed, no save this step")
                self._saves = []
            self._stream.synchronize()  # the bounce buffers are complete: vLLM may reuse the blocks
            saves, self._saves, self._saves_of = self._saves, [], None
        else:
            saves = [] if self._saves_refused else self._planned(meta.saves)
        if not saves:
            return
        if self._save_breaker.open:  # the sidecar is hung: a step's end never waits on it again
            self.stats.add("save_skipped_chunks", len(saves))
            return
        t0 = time.perf_counter()
        try:
            self._save(saves)
        except Exception:  # a bug: a future miss, never a failed request
            self._warn.exception("save-bug", "kvpool: saving %d chunks failed", len(saves))
        self.stats.add("save_seconds", time.perf_counter() - t0)

    def _save(self, saves: list[_Save]) -> None:
        written: list[tuple[Slot, int]] = []
        reserved: list[Slot] = []
        try:
            for priority in dict.fromkeys(s.priority for s in saves):
                group = [s for s in saves if s.priority == priority]
                slots = self.client.reserve(
                    [(s.key, self.io.chunk_bytes(s.op.chunk_blocks)) for s in group],
                    priority=priority,
                    groups={s.key: s.op.link.hex() for s in group},  # every rank's copy: one group
                    prefixes={s.key: [rank_key(link, self.rank) for link in s.op.prefixes] for s in group},
                )
                for s, slot in zip(group, slots, strict=True):
                    if slot is None:
                        self.stats.add("save_skipped_chunks")  # stored already, or no room
                        continue
                    reserved.append(slot)
                    written.append((slot, self._write(s, slot)))
            committed = self.client.commit(written)
        except SidecarRefused as e:
            self._refused(e)
            committed = []
        except SidecarTimeout as e:
            self._save_breaker.trip()
            self.stats.add("sidecar_errors")
            seconds = self._save_breaker.seconds
            self._warn.warning("save-timeout", "kvpool: a save timed out, none for %.0f s: %s", seconds, e)
            committed = []
        except SidecarError as e:
            self.stats.add("sidecar_errors")
            self._warn.warning("save", "kvpool: saving %d chunks failed: %s", len(saves), e)
            committed = []
        if len(committed) < len(reserved) and not self._save_breaker.open:
            with contextlib.suppress(SidecarError):  # the reservations expire by themselves too
                self.client.abort(reserved)
        done = [slot for (slot, _), ok in zip(written, committed, strict=False) if ok]
        refused = sum(1 for ok in committed if not ok)
        if refused:
            self.stats.add("save_refused_chunks", refused)
            self._warn.warning(
                "refused", "kvpool: the sidecar refused %d commits (reservations expired)", refused
            )
        self.stats.add("saved_chunks", len(done))
        self.stats.add("saved_bytes", sum(slot.length for slot in done))

    def _write(self, s: _Save, slot: Slot) -> int:
        """Writes one chunk into its reserved slot; returns the checksum of its source bytes."""
        chunk = self._mapping.tensor(slot.epoch)[slot.offset : slot.offset + slot.length]
        if s.bounce is None:
            return self.io.save_cpu(chunk, s.op)
        digest = checksum(s.bounce.numpy())
        chunk.copy_(s.bounce)
        return digest

    def _refused(self, e: SidecarError) -> None:
        """The sidecar refuses our chunks as such (larger than its --max-chunk-bytes): say so once and
        stop saving; asking again every step would only repeat it."""
        self._saves_refused = True
        log.error(
            "kvpool: the sidecar refuses this worker's chunks (%s); saving is off for this worker. Give "
            "the sidecar a larger --max-chunk-bytes (the operator sizes it from the pool) or a smaller "
            "chunk_size.",
            e,
        )

    def take_stats(self) -> KVPoolStats | None:
        return self.stats.take()

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True)  # no copy reads the arena after this
        self._mapping.close()
        self.client.close()
