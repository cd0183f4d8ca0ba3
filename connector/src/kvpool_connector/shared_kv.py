"""A CPU engine's KV cache moved into memory the save process maps as well, so that it copies and
hashes vLLM's blocks where they lie, at memcpy speed.

process_vm_readv pins each 4 KiB page it reads (the kernel's get_user_pages, under the worker's mmap
lock, which the forward's own allocations take too): 0.35 of the 0.50 ms of CPU that a 2 MiB chunk
cost the save process, against 0.11 for a memcpy, and its private copy moved each byte twice more.
So when the engine registers its KV cache, before its first step, the worker moves each allocation's
whole pages onto a memfd: a window at a time, the bytes are copied into the memfd (zeros are its own
already) and the memfd is mapped over them at the same addresses, so vLLM's tensors and kernels keep
the same memory. The save process maps the memfd read-only. An allocation's first and last partial
pages stay where they are, read with process_vm_readv.

An allocation that lies on transparent huge pages stays where it is: a memfd's pages are 4 KiB where
the node's shmem_enabled is "never" (the kernel's default), and vLLM's CPU attention read a decode
step's KV 3.5-4% slower from them (BENCHMARKS.md, "The KV cache's page size"), more than the save
process's reads through process_vm_readv cost the forward on the other core.

The pages stay on the memfd until the process exits, also after vLLM frees its cache: glibc and
tcmalloc (vLLM's CPU images preload it) clear what calloc hands out of reused memory.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass

import numpy as np

PAGE = mmap.PAGESIZE
# Bytes moved onto the memfd at a time: the most the move holds twice.
WINDOW = 64 << 20
# mmap(2)'s flags that Python's mmap module does not name: at this address, and every page in memory
# at once (as torch.zeros left them, so that no forward takes the faults)
MAP_FIXED, MAP_POPULATE = 0x10, 0x8000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,  # addr
    ctypes.c_size_t,  # length
    ctypes.c_int,  # prot
    ctypes.c_int,  # flags
    ctypes.c_int,  # fd
    ctypes.c_long,  # offset
]


@dataclass(frozen=True)
class SharedRegion:
    """Whole pages of the worker's KV cache that live on a memfd: fd is its number in the worker and,
    passed as is, in the save process."""

    address: int
    length: int
    fd: int


def _words(address: int, length: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint64 * (length // 8)).from_address(address))


def huge_page_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process's mappings that hold transparent huge pages
    (/proc/self/smaps' AnonHugePages: per mapping, not per page). Read once for a whole cache: the
    kernel walks every mapping's page tables to write smaps."""
    out: list[tuple[int, int]] = []
    mapping: tuple[int, int] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(" ", 1)[0]
            if line[0] in "0123456789abcdef" and "-" in head:
                low, high = head.split("-")
                mapping = (int(low, 16), int(high, 16))
            elif mapping and line.startswith("AnonHugePages:") and int(line.split()[1]) > 0:
                out.append(mapping)
    return out


def on_huge_pages(address: int, length: int, mappings: list[tuple[int, int]] | None = None) -> bool:
    """Whether [address, address + length) lies in a mapping of huge_page_mappings() (read now if
    not given)."""
    mappings = huge_page_mappings() if mappings is None else mappings
    return any(low < address + length and address < high for low, high in mappings)


def share(address: int, length: int, huge: list[tuple[int, int]] | None = None) -> SharedRegion | None:
    """Moves the whole pages of the allocation [address, address + length) onto a memfd, its bytes
    kept; None where it has no whole page or lies on huge pages (the module's docstring; `huge`:
    huge_page_mappings(), read now if not given). Only before the engine's first step: a write between
    a window's copy and its mapping would be lost. OSError where the kernel refuses (the windows moved
    before it keep their bytes; the caller closes nothing)."""
    start = -(-address // PAGE) * PAGE
    end = (address + length) // PAGE * PAGE
    if end <= start or on_huge_pages(start, end - start, huge):
        return None
    fd = os.memfd_create("kvpool-kv-cache", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, end - start)
        for offset in range(0, end - start, WINDOW):
            n = min(WINDOW, end - start - offset)
            at = start + offset
            if _words(at, n).any():  # else the memfd's zeros are the same bytes
                with mmap.mmap(fd, n, offset=offset) as window:
                    np.frombuffer(window, dtype=np.uint64)[:] = _words(at, n)
            prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | MAP_FIXED | MAP_POPULATE
            if _libc.mmap(at, n, prot, flags, fd, offset) != at:
                err = ctypes.get_errno()
                raise OSError(err, f"cannot map the KV cache's memfd at {at:#x}: {os.strerror(err)}")
    except BaseException:
        os.close(fd)
        raise
    return SharedRegion(start, end - start, fd)


class SharedKV:
    """The save process's read-only views of the worker's shared regions."""

    def __init__(self, regions: tuple[SharedRegion, ...]) -> None:
        self._views = []
        for r in regions:
            mapping = mmap.mmap(r.fd, r.length, mmap.MAP_SHARED, mmap.PROT_READ)  # the view keeps it
            self._views.append((r.address, r.address + r.length, np.frombuffer(mapping, dtype=np.uint8)))
            os.close(r.fd)

    def views(self, pieces: list[tuple[int, int]]) -> list[np.ndarray] | None:
        """The pieces (address, length) of the worker's memory as views; None where any lies outside."""
        out = []
        for address, n in pieces:
            for start, end, view in self._views:
                if start <= address and address + n <= end:
                    out.append(view[address - start : address - start + n])
                    break
            else:
                return None
        return out
