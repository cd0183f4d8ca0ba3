"""What the arena's journal costs, and how long a restarted sidecar takes to adopt a full arena.

In process, on tmpfs (/dev/shm, as a pod's emptyDir with medium Memory):
- the commit path: reserve + commit of 256 KiB chunks into a 1 GiB arena, a store with the journal
  against one without, timed alternately (each run starts from an empty store, so half of the
  commits also evict and journal a drop), as a ratio per pair;
- adoption: a 1 GiB arena filled with 256 KiB chunks (4,096), then a new Store over the same file,
  which reads the journal and checks every chunk's checksum before it serves, against one over the
  same file that starts empty (the pre-journal start), alternately.
Run: `.venv/bin/python -m bench restart`.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from bench.stats import Spread
from kvpool_sidecar.arena import Arena
from kvpool_sidecar.journal import JOURNAL_FILE, Journal, budget_bytes
from kvpool_sidecar.store import Store
from kvpool_sidecar.wire import checksum

CAPACITY = 1 << 30
CHUNK = 256 * 1024
PAIRS = 15


def _store(directory: Path, journal: bool) -> Store:
    j = Journal(directory / JOURNAL_FILE, budget_bytes(CAPACITY)) if journal else None
    return Store(Arena(directory, CAPACITY), journal=j)


def _fill(store: Store, count: int, tag: str) -> float:
    """Seconds to reserve and commit `count` chunks (their bytes are already in place: the copy is the
    same with and without the journal, so only the index's and the journal's work is timed)."""
    digest = checksum(bytes(CHUNK))
    t0 = time.perf_counter()
    for i in range(count):
        (slot,) = store.reserve([(f"{tag}{i:060x}", CHUNK)])
        assert slot is not None
        store.commit([(slot, digest)])
    return time.perf_counter() - t0


def commit_cost() -> None:
    count = 2 * CAPACITY // CHUNK  # twice the arena: the second half evicts
    ratios, with_us, without_us = [], [], []
    for i in range(PAIRS):
        times = {}
        for journal in (True, False) if i % 2 == 0 else (False, True):
            d = Path(tempfile.mkdtemp(dir="/dev/shm"))
            try:
                store = _store(d, journal)
                times[journal] = _fill(store, count, f"{i:02x}")
                store.arena.close()
            finally:
                shutil.rmtree(d)
        ratios.append(times[True] / times[False])
        with_us.append(times[True] / count * 1e6)
        without_us.append(times[False] / count * 1e6)
    w, wo, r = Spread.of(with_us), Spread.of(without_us), Spread.of(ratios)
    print(f"commit of a 256 KiB chunk ({count} a run, {PAIRS} alternating pairs, median [min-max]):")
    print(f"  with the journal    {w.median:6.2f} us [{w.low:.2f}-{w.high:.2f}]")
    print(f"  without             {wo.median:6.2f} us [{wo.low:.2f}-{wo.high:.2f}]")
    print(f"  ratio               {r.median:6.3f} [{r.low:.3f}-{r.high:.3f}]")


def adoption() -> None:
    adopting: list[float] = []
    empty: list[float] = []
    for i in range(5):
        d = Path(tempfile.mkdtemp(dir="/dev/shm"))
        try:
            first = _store(d, journal=True)
            _fill(first, CAPACITY // CHUNK, "a")
            held = first.snapshot()["chunks"]
            first.arena.close()  # as a kill: nothing is written at exit
            for journal in (True, False) if i % 2 == 0 else (False, True):
                t0 = time.perf_counter()
                again = _store(d, journal=journal)  # without: the same file, nothing adopted
                (adopting if journal else empty).append(time.perf_counter() - t0)
                assert again.counters.adopted == (held if journal else 0)
                again.arena.close()
        finally:
            shutil.rmtree(d)
    a, e = Spread.of(adopting), Spread.of(empty)
    print(f"a sidecar's store over a full 1 GiB arena ({CAPACITY // CHUNK} chunks), 5 alternating runs:")
    print(f"  adopting every chunk (checksums checked)  {a.median:.3f} s [{a.low:.3f}-{a.high:.3f}]")
    print(f"  starting empty (fallocate and mapping only)  {e.median:.3f} s [{e.low:.3f}-{e.high:.3f}]")


def main() -> None:
    commit_cost()
    adoption()
