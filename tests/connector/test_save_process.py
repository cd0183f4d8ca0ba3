"""The save process's ways into the worker's memory: process_vm_readv, and /proc/<pid>/mem where a
runtime's default seccomp profile refuses that call (containerd's does without CAP_SYS_PTRACE). Both
read a chunk's pieces in order, the same bytes, and refuse what is not mapped."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvpool_connector.save_process import READERS, RemoteLayer, chunk_pieces

PAGE = 4096


def _source() -> tuple[np.ndarray, list[RemoteLayer]]:
    """Three layers of random bytes in this process: the first two with contiguous rows, the third
    with a gap after each row (as a cache whose block stride exceeds its page)."""
    src = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    base = src.ctypes.data
    layers = [RemoteLayer(base + i * (256 << 10), PAGE, PAGE) for i in range(2)]
    return src, [*layers, RemoteLayer(base + (512 << 10), PAGE, 2 * PAGE)]


def test_a_chunks_pieces_follow_its_layout_and_merge_consecutive_blocks() -> None:
    src, layers = _source()
    pieces = chunk_pieces(layers, [0, 2], [5, 6, 7, 1])
    base = src.ctypes.data
    assert [(a - base, n) for a, n in pieces] == [
        (5 * PAGE, 3 * PAGE),  # blocks 5-7 of layer 0 in one piece
        (1 * PAGE, PAGE),
        *[((512 << 10) + b * 2 * PAGE, PAGE) for b in (5, 6, 7, 1)],  # strided rows: a piece each
    ]


@pytest.mark.parametrize("reader", READERS, ids=lambda r: r.name)
def test_each_reader_reads_the_pieces_in_order_and_refuses_an_unmapped_address(reader) -> None:
    src, layers = _source()
    pieces = chunk_pieces(layers, [0, 1, 2], [9, 3, 4])
    base = src.ctypes.data
    expected = np.concatenate([src[a - base : a - base + n] for a, n in pieces])
    out = np.zeros(expected.size, dtype=np.uint8)
    reader(os.getpid()).read(out, pieces)
    assert np.array_equal(out, expected)
    with pytest.raises(OSError):
        reader(os.getpid()).read(np.zeros(PAGE, dtype=np.uint8), [(PAGE, PAGE)])  # page 1 is never mapped
