"""A CPU worker's saves in a process of their own, so that they take no turn at vLLM's GIL.

On a CPU engine the forward runs Python between its kernels, and the save thread's copies and hashes
hand the GIL back and forth some 80 times a chunk: that cost the forward 2-3% where saves from another
process cost nothing (BENCHMARKS.md, "Where the save thread's CPU goes"). So the worker starts a child
that copies the blocks into the arena and hashes them where they lie, through its own mapping of the
worker's KV cache (shared_kv.py), with a sidecar client of its own. Where a block is not in that
mapping (an allocation's partial pages, or the worker could not share its cache) the child reads it
out of the worker's memory into a private copy, hashes that and writes it into the arena
(process_vm_readv: one call a chunk, the GIL's owner never involved; /proc/<pid>/mem where a seccomp
profile refuses that call). The worker's save thread keeps the queue and the fence (saver.py): per
step it sends the plan and answers two messages, when the child may start reading blocks and when it
has read them all.

Reading another process's memory needs ptrace's permission: same user, and where Yama restricts
ptrace (ptrace_scope 1) the worker names the child its tracer. Where the kernel or a seccomp profile
still refuses, or the child dies or stops answering, the worker says why once and saves on its own
thread as before: a save never fails a request and never waits on a dead child.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from .chunk_saves import ChunkSave, SaveOutcome
from .config import KVPoolConfig
from .counters import Counts
from .logs import connector_logger
from .shared_kv import SharedKV, SharedRegion

if TYPE_CHECKING:
    import numpy as np

    from .paged import PagedLayer

log = connector_logger(__name__)

# How long the worker waits for the child's next message (start-up, a sidecar call) before it kills the
# child and saves on its own thread: well past the sidecar client's own timeouts.
ANSWER_SECONDS = 30.0
# The same while the child reads vLLM's blocks: a step that reuses them waits on that read (saver.py's
# fence), and a read is memory speed (a 256 MiB step in about 0.1 s, a second at nice 10 beside a busy
# thread): a child that has not finished by then is stopped or stuck, and the step must not wait 30 s.
COPY_SECONDS = 5.0
# prctl(2): Yama's PR_SET_PTRACER, naming the one process that may read this one's memory
PR_SET_PTRACER = 0x59616D61
# what ps and top call the child
PROCESS_NAME = "kvpool-saves"
# process_vm_readv(2) takes at most this many pieces per call (the kernel's UIO_MAXIOV)
IOV_MAX = 1024


@dataclass(frozen=True)
class RemoteLayer:
    """Where a dense layer's blocks are in the worker's memory: block b at address + b * stride."""

    address: int
    page_bytes: int
    stride: int

    @classmethod
    def of(cls, layer: PagedLayer) -> RemoteLayer:
        return cls(layer.pages.data_ptr(), layer.page_bytes, layer.pages.stride(0))


@dataclass(frozen=True)
class Setup:
    cfg: KVPoolConfig
    rank: int
    pid: int  # the worker's
    layers: list[RemoteLayer]
    groups: list[list[int]]
    regions: tuple[SharedRegion, ...] = ()  # the child maps them: its blocks are read there


class SaveProcessGone(Exception):
    """The child exited, refused or stopped answering: the worker saves on its own thread from now on."""


class SaveProcess:
    """The worker's end: started with the worker's layers (SaveProcessGone when the child cannot read
    them), then used from the save thread alone."""

    def __init__(self, setup: Setup) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with mine, theirs:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "kvpool_connector.save_process", str(theirs.fileno())],
                pass_fds=(theirs.fileno(), *(r.fd for r in setup.regions)),
                stdin=subprocess.DEVNULL,
                # where the worker found kvpool, however it was put on its path
                env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            )
            self._conn = Connection(mine.detach())
        with contextlib.suppress(OSError, AttributeError):  # no Yama (EINVAL): same-user ptrace suffices
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, self._proc.pid, 0, 0, 0)
        self.pid = self._proc.pid
        self.reader = ""  # how it reads the worker's memory (READERS' names)
        try:  # once, as the engine starts: its first saves need not wait for the child's
            self._send(setup)
            answer = str(self._recv())
            if not answer.startswith("ready: "):
                raise SaveProcessGone(answer)
            self.reader = answer.removeprefix("ready: ")
        except SaveProcessGone:
            self.close()
            raise

    def _recv(self, seconds: float = ANSWER_SECONDS) -> Any:
        if not self._conn.poll(seconds):
            raise SaveProcessGone(f"no answer in {seconds:g} s")
        try:
            return self._conn.recv()
        except (EOFError, OSError) as e:
            raise SaveProcessGone(f"it exited ({self._proc.poll()})") from e

    def _send(self, message: Any) -> None:
        try:
            self._conn.send(message)
        except OSError as e:
            raise SaveProcessGone(f"it exited ({self._proc.poll()}): {e!r}") from e

    def save(
        self, saves: list[ChunkSave], start_copy: Callable[[], bool], end_copy: Callable[[], None]
    ) -> tuple[SaveOutcome, dict[str, float]]:
        """Saves one step's chunks in the child; returns what they came to and their counts. Raises
        SaveProcessGone (nothing of this step saved, the caller says why) with end_copy called."""
        copying = False
        try:
            self._send([(s.op, s.key, s.priority) for s in saves])
            while True:
                message = self._recv(COPY_SECONDS if copying else ANSWER_SECONDS)
                if message == "copy?":
                    copying = start_copy()
                    self._send(copying)
                elif message == "copied":
                    copying = False
                    end_copy()
                else:
                    outcome, counts = message
                    return outcome, counts
        except BaseException:
            if copying:  # it may still read blocks: no block is reused before it is gone
                self._kill()
                end_copy()
            raise

    def _kill(self) -> None:
        self._proc.kill()
        self._proc.wait()

    def close(self) -> None:
        """Ends the child (it exits when the connection closes; killed if it does not)."""
        self._conn.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._kill()


# --- the child ---------------------------------------------------------------------------------------


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [
    ctypes.c_int,
    ctypes.POINTER(_IOVec),
    ctypes.c_ulong,
    ctypes.POINTER(_IOVec),
    ctypes.c_ulong,
    ctypes.c_ulong,
]


class VMReader:
    """process_vm_readv(2): a chunk's pieces of the worker's memory in one call, straight into ours."""

    name = "process_vm_readv"

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def read(self, into: np.ndarray, pieces: list[tuple[int, int]]) -> None:
        """Reads `pieces` (address, length), one after another, into `into` (uint8, contiguous, their
        size). OSError when the kernel refuses or a piece is not mapped there."""
        at = into.ctypes.data
        for start in range(0, len(pieces), IOV_MAX):
            batch = pieces[start : start + IOV_MAX]
            length = sum(n for _, n in batch)
            remote = (_IOVec * len(batch))(*(_IOVec(address, n) for address, n in batch))
            local = _IOVec(at, length)
            got = _libc.process_vm_readv(self.pid, ctypes.byref(local), 1, remote, len(batch), 0)
            if got != length:
                err = ctypes.get_errno() if got < 0 else errno.EIO
                raise OSError(err, f"process_vm_readv read {got} of {length} bytes: {os.strerror(err)}")
            at += length


class ProcMemReader:
    """The worker's /proc/<pid>/mem, a pread a piece: the same permission as process_vm_readv, but
    read(2)'s syscall, which a runtime's default seccomp profile allows where it refuses
    process_vm_readv (containerd's RuntimeDefault allows it only with CAP_SYS_PTRACE). The kernel
    copies each page twice on this path."""

    name = "/proc/<pid>/mem"

    def __init__(self, pid: int) -> None:
        self.fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)

    def read(self, into: np.ndarray, pieces: list[tuple[int, int]]) -> None:
        view, pos = memoryview(into), 0  # type: ignore[arg-type]  # an ndarray is a buffer
        for address, n in pieces:
            got = os.preadv(self.fd, [view[pos : pos + n]], address)
            if got != n:
                raise OSError(errno.EIO, f"read {got} of {n} bytes at {address:#x} from /proc/<pid>/mem")
            pos += n


Reader = VMReader | ProcMemReader
READERS: tuple[type[VMReader] | type[ProcMemReader], ...] = (VMReader, ProcMemReader)  # fastest first


def chunk_pieces(
    layers: list[RemoteLayer], members: list[int], block_ids: list[int]
) -> list[tuple[int, int]]:
    """The pieces of the worker's memory that make a chunk's bytes (chunk_io's layout: each layer's
    blocks in order, layer after layer), consecutive blocks of a layer in one piece where its rows
    are contiguous."""
    pieces: list[tuple[int, int]] = []
    for i in members:
        lay = layers[i]
        for b in block_ids:
            address = lay.address + b * lay.stride
            last = pieces[-1] if pieces else None
            if last is not None and lay.stride == lay.page_bytes and last[0] + last[1] == address:
                pieces[-1] = (last[0], last[1] + lay.page_bytes)
            else:
                pieces.append((address, lay.page_bytes))
    return pieces


class _Child:
    def __init__(self, conn: Connection, setup: Setup) -> None:
        import numpy as np

        from .arena_mapping import ArenaMapping, arena_path
        from .chunk_saves import ChunkSaves
        from .config import sidecar_client
        from .ratelimit import RateLimitedLog

        self._np = np
        self.conn = conn
        self.setup = setup
        self.stats = Counts()
        self.client = sidecar_client(setup.cfg)
        self.mapping = ArenaMapping(lambda: arena_path(setup.cfg, self.client))
        self.saves = ChunkSaves(self.client, setup.rank, self._chunk_bytes, self.stats, RateLimitedLog(log))
        self.shared = SharedKV(setup.regions)
        self._buffer = np.empty(0, dtype=np.uint8)  # private: what is hashed is what no one else writes
        self._copying = False
        self.reader: Reader | None = None  # check() picks it

    def _chunk_bytes(self, op: Any) -> int:
        return op.chunk_blocks * sum(self.setup.layers[i].page_bytes for i in self.setup.groups[op.group])

    def check(self) -> str:
        """ "ready: <how>" once a block can be read from the worker, else why not."""
        if not self.setup.layers:
            return "no layers"
        lay = self.setup.layers[0]
        probe = self._np.empty(lay.page_bytes, dtype=self._np.uint8)
        refused = []
        for kind in READERS:
            try:
                reader = kind(self.setup.pid)
                reader.read(probe, [(lay.address, lay.page_bytes)])
            except OSError as e:
                refused.append(f"{kind.name}: {e}")
                continue
            self.reader = reader
            return f"ready: {'a shared mapping, else ' if self.setup.regions else ''}{kind.name}"
        return f"cannot read the worker's KV cache ({'; '.join(refused)})"

    def _start_copy(self) -> bool:
        self.conn.send("copy?")
        self._copying = bool(self.conn.recv())
        return self._copying

    def _end_copy(self) -> None:
        if self._copying:
            self._copying = False
            self.conn.send("copied")

    def _write_all(self, reserved: list[tuple[ChunkSave, Any]]) -> list[tuple[Any, int]]:
        """Chunk by chunk: copies its blocks into its slot and hashes them where they lie, in the shared
        mapping (vLLM writes no block before the fence lets it, as for the save thread's copies), or
        else reads them into the private buffer (one chunk: a long prompt's step must not double in
        memory here), hashes that copy and writes it. Tells the worker once it reads no block any more."""
        from kvpool_sidecar.wire import checksum, checksum_pieces

        reader = self.reader
        assert reader is not None, "the child serves once check() found a reader"
        written = []
        for i, (s, slot) in enumerate(reserved):
            pieces = chunk_pieces(self.setup.layers, self.setup.groups[s.op.group], s.op.block_ids)
            if sum(n for _, n in pieces) != slot.length:  # never read past the buffer
                raise ValueError(f"{len(s.op.block_ids)} blocks for a {s.op.chunk_blocks}-block chunk")
            last = i == len(reserved) - 1
            slot_bytes = self.mapping.slot_array(slot.epoch, slot.offset, slot.length)
            sources = self.shared.views(pieces)
            if sources is not None:
                written.append((slot, checksum_pieces(copied_pieces(sources, slot_bytes))))
                if last:
                    self._end_copy()
                continue
            if self._buffer.nbytes < slot.length:
                self._buffer = self._np.empty(slot.length, dtype=self._np.uint8)
            mine = self._buffer[: slot.length]
            reader.read(mine, pieces)
            if last:
                self._end_copy()
            slot_bytes[:] = mine
            written.append((slot, checksum(mine)))
        return written

    def serve(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except EOFError:  # the worker closed or died
                return
            saves = [ChunkSave(op, key, priority) for op, key, priority in message]
            try:
                outcome = self.saves.save(saves, self._write_all, self._start_copy, self._end_copy)
            except OSError as e:  # the worker's memory could not be read: a miss, said once a while
                self.saves.warn.warning("read", "kvpool: the save process read no blocks: %s", e)
                outcome = SaveOutcome()
            except Exception:  # a bug: a future miss, never a failed request
                self.saves.warn.exception("save-bug", "kvpool: saving %d chunks failed", len(saves))
                outcome = SaveOutcome()
            try:
                self.conn.send((outcome, self.stats.take() or {}))
            except OSError:  # the worker died meanwhile
                return


def copied_pieces(sources: list[np.ndarray], into: np.ndarray) -> Iterator[np.ndarray]:
    """Copies `sources` one after another into `into`, yielding each once it is copied: hashed next,
    it is read from the cache."""
    at = 0
    for piece in sources:
        into[at : at + piece.nbytes] = piece
        yield piece
        at += piece.nbytes


def main(fd: int) -> None:
    import logging

    from .affinity import below_vllm, name_native_thread, off_compute_cores

    name_native_thread(PROCESS_NAME)
    off_compute_cores()  # started from vLLM's thread: bound to the forward's cores until moved
    below_vllm()
    logging.basicConfig(format="%(levelname)s %(asctime)s [kvpool save process] %(message)s")
    conn = Connection(fd)
    try:
        setup = conn.recv()
    except EOFError:
        return
    assert isinstance(setup, Setup), f"expected the setup, got {type(setup)}"
    child = _Child(conn, setup)
    ready = child.check()
    conn.send(ready)
    if child.reader is not None:
        child.serve()


if __name__ == "__main__":  # the worker's messages name this module's classes by its package name
    from kvpool_connector import save_process

    save_process.main(int(sys.argv[1]))
