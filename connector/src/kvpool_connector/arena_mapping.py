"""The worker's mapping of the sidecar's arena: mapped once, for the worker's life.

A copy in flight (on the load, save or copy threads) reads or writes the mapping, so no error path may
unmap it: a failed sidecar call drops the connection, never the mapping. Offsets are used
only in the arena whose epoch the sidecar named with them (wire.ARENA_HEADER): a restarted sidecar
writes a new epoch into the same file, which this mapping sees at once, so an offset handed out by
the old one is refused. When the path holds a new file (a new pod volume, a new --capacity), it is
mapped beside the old one; old mappings stay until shutdown, when nothing copies any more.

The mapping is not registered with CUDA (cudaHostRegister): no DMA reads or writes it. On a GPU every
byte passes through a private pinned buffer where it is hashed (chunk_io.py), so registering the arena
would only pin all of it (42 ms a GiB on an H100 host), and a failed registration leaves CUDA's last
error set, which the next CUDA call of the process then raised: every load failed (measured, #26).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool_sidecar.client import SidecarClient
from kvpool_sidecar.client_errors import SidecarError, SidecarUnavailable
from kvpool_sidecar.wire import arena_epoch, map_populated

if TYPE_CHECKING:
    import torch

    from .config import KVPoolConfig


def arena_path(cfg: KVPoolConfig, client: SidecarClient) -> str:
    """Where the sidecar's arena file is: in the pool's shared memory volume, else where it says."""
    if cfg.shm_path:
        return os.path.join(cfg.shm_path, "arena")
    try:
        return str(client.arena_info()["path"])
    except KeyError as e:
        raise SidecarError(f"GET /v1/arena named no path: {e!r}") from e


class ArenaChanged(SidecarUnavailable):
    """The sidecar named an epoch this worker's mapping does not show (it restarted meanwhile)."""


@dataclass(eq=False)
class _Mapped:
    mmap: mmap.mmap
    array: np.ndarray  # its bytes
    identity: tuple[int, int, int]  # (st_dev, st_ino, size) of the file mapped
    _tensor: Any = None

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            import torch  # here: the save process maps the arena and never imports torch

            self._tensor = torch.from_numpy(self.array)
        return self._tensor


class ArenaMapping:
    def __init__(self, path: Callable[[], str]) -> None:
        """path: where the arena file is (asked once, at the first use)."""
        self._path_of = path
        self._path: str | None = None
        self._current: _Mapped | None = None
        self._all: list[_Mapped] = []
        self._lock = threading.Lock()

    def slot(self, epoch: int, offset: int, length: int) -> torch.Tensor:
        """A slot's bytes in the arena of `epoch`; ArenaChanged when it is not in this mapping (a bug
        or a sidecar that named another file: never a short view, whose copy would fail or fault)."""
        arena = self._mapped(epoch)
        self._check(arena, offset, length)
        return arena.tensor[offset : offset + length]

    def slot_array(self, epoch: int, offset: int, length: int) -> np.ndarray:
        """slot() as a numpy array."""
        arena = self._mapped(epoch)
        self._check(arena, offset, length)
        return arena.array[offset : offset + length]

    @staticmethod
    def _check(arena: _Mapped, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > arena.array.nbytes:
            raise ArenaChanged(f"slot [{offset}, +{length}) is outside the {arena.array.nbytes}-byte arena")

    def tensor(self, epoch: int) -> torch.Tensor:
        """The arena as a uint8 tensor, if it is the arena of `epoch`; raises ArenaChanged if not."""
        return self._mapped(epoch).tensor

    def _mapped(self, epoch: int) -> _Mapped:
        with self._lock:
            current = self._current
            if current is not None and arena_epoch(current.array) == epoch:
                return current
            mapped = self._map()
            if arena_epoch(mapped.array) != epoch:
                raise ArenaChanged(f"the arena is not the one of epoch {epoch}: the sidecar restarted")
            return mapped

    def _map(self) -> _Mapped:
        """The file now at the path: the current mapping if it is the same file, else a new one."""
        if self._path is None:
            self._path = self._path_of()
        try:
            fd = os.open(self._path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise SidecarUnavailable(f"cannot open the arena {self._path}: {e!r}") from e
        try:
            st = os.fstat(fd)
            identity = (st.st_dev, st.st_ino, st.st_size)
            if self._current is not None and self._current.identity == identity:
                return self._current
            try:
                m = map_populated(fd, st.st_size)
            except (OSError, ValueError) as e:
                raise SidecarUnavailable(f"cannot map the arena {self._path}: {e!r}") from e
        finally:
            os.close(fd)
        mapped = _Mapped(m, np.frombuffer(m, dtype=np.uint8), identity)
        self._all.append(mapped)
        self._current = mapped
        return mapped

    def close(self) -> None:
        """At shutdown, after every copy has finished."""
        with self._lock:
            for mapped in self._all:
                with contextlib.suppress(BufferError):  # still exported: the OS unmaps at exit
                    mapped.mmap.close()
            self._all.clear()
            self._current = None
