"""What a chunk costs the save process's CPU, by how it reaches vLLM's blocks (#24): read out of the
worker's memory into a private copy (process_vm_readv, then the copy hashed and written into the
arena: the way before shared_kv.py, and still the way for blocks outside the shared mapping), or copied
into the arena and hashed where they lie, through the shared mapping.

One process plays both sides: a KV cache of the BENCH model's layout (8 layers, 64-token blocks of
64 KiB a layer, 256-token chunks: 2 MiB), its whole pages moved onto a memfd by shared_kv.share, and
an arena on /dev/shm. process_vm_readv on one's own pid pins pages as it does across processes. Rounds
of CHUNKS chunks alternate between the two ways; the figure is the median over rounds of CPU ms a
chunk, and of the rounds' ratios with a 95% bootstrap interval, for blocks scattered over the cache
and for consecutive ones. Run: `.venv/bin/python -m bench save_read` (about a minute); writes
bench/results/save-read.txt.
"""

from __future__ import annotations

import mmap
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench.stats import bootstrap
from kvpool_connector.save_process import RemoteLayer, VMReader, chunk_pieces, copied_pieces
from kvpool_connector.shared_kv import SharedKV, share
from kvpool_sidecar.wire import checksum, checksum_pieces

LAYERS, BLOCKS, PAGE_BYTES, CHUNK_BLOCKS = 8, 1024, 64 << 10, 4
CHUNKS, ROUNDS = 50, 21
ARENA_BYTES = 256 << 20
OUT = Path(__file__).parent / "results" / "save-read.txt"


def main() -> None:
    cache = torch.randint(0, 256, (LAYERS, BLOCKS, PAGE_BYTES), dtype=torch.uint8)
    region = share(cache.data_ptr(), cache.nbytes)
    assert region is not None
    shared = SharedKV((region,))
    layers = [RemoteLayer(cache[i].data_ptr(), PAGE_BYTES, PAGE_BYTES) for i in range(LAYERS)]
    reader = VMReader(os.getpid())
    chunk_bytes = LAYERS * CHUNK_BLOCKS * PAGE_BYTES
    private = np.empty(chunk_bytes, dtype=np.uint8)
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as f:
        f.truncate(ARENA_BYTES)
        arena = np.frombuffer(mmap.mmap(f.fileno(), ARENA_BYTES), dtype=np.uint8)
        arena[:] = 0  # its pages in memory, as a sidecar's arena after a while

        def slot(c: int) -> np.ndarray:
            at = c * chunk_bytes % (ARENA_BYTES - chunk_bytes)
            return arena[at : at + chunk_bytes]

        def private_copy(pieces: list[tuple[int, int]], into: np.ndarray) -> int:
            reader.read(private, pieces)
            into[:] = private
            return checksum(private)

        def in_place(pieces: list[tuple[int, int]], into: np.ndarray) -> int:
            views = shared.views(pieces)
            assert views is not None
            return checksum_pieces(copied_pieces(views, into))

        ways: dict[str, Callable[[list[tuple[int, int]], np.ndarray], int]] = {
            "private copy (process_vm_readv)": private_copy,
            "in place (shared mapping)": in_place,
        }
        lines = [
            f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: .venv/bin/python -m bench save_read"
        ]
        rng = random.Random(0)
        for blocks in ("scattered", "consecutive"):
            plans = []
            for _ in range(CHUNKS):
                if blocks == "scattered":
                    ids = rng.sample(range(1, BLOCKS - 1), CHUNK_BLOCKS)
                else:
                    first = rng.randrange(1, BLOCKS - CHUNK_BLOCKS - 1)
                    ids = list(range(first, first + CHUNK_BLOCKS))
                plans.append(chunk_pieces(layers, list(range(LAYERS)), ids))
            assert private_copy(plans[0], slot(0)) == in_place(plans[0], slot(1))
            ms: dict[str, list[float]] = {name: [] for name in ways}
            for r in range(ROUNDS):
                order = list(ways.items()) if r % 2 == 0 else list(reversed(ways.items()))
                for name, way in order:
                    t = time.process_time()
                    for c, pieces in enumerate(plans):
                        way(pieces, slot(c))
                    ms[name].append((time.process_time() - t) / CHUNKS * 1e3)
            base, new = ms.values()
            ratios = [n / b for n, b in zip(new, base, strict=True)]
            low, high = bootstrap(ratios, statistics.median)
            lines.append(f"## {blocks} blocks: CPU ms a 2 MiB chunk, median over {ROUNDS} rounds of {CHUNKS}")
            lines += [f"{name}: {statistics.median(v):.3f}" for name, v in ms.items()]
            lines.append(f"in place / private copy: {statistics.median(ratios):.3f} ({low:.3f}-{high:.3f})")
    print("\n".join(lines))
    OUT.write_text("\n".join(lines) + "\n")
