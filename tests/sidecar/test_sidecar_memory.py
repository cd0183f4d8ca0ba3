"""The operator's memory formula for the sidecar container against the real sidecar's memory.

The real sidecar runs with its arena on tmpfs (a pod's emptyDir with medium Memory), its index filled
to the --max-chunks default (chunks and block-prefix keys), a full chunk of --max-chunk-bytes stored
and read back; its peak resident memory (arena pages, libraries, heap) plus its page tables must fit
the limit the webhook gives it, or the kernel OOM-kills it and takes the cache down.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from kvtest import start_sidecar

from kvpool_operator.resources import (
    PAGE_TABLE_DIVISOR,
    SIDECAR_MAX_CHUNKS,
    arena_files_bytes,
    sidecar_memory_bytes,
)
from kvpool_sidecar.client import SidecarClient
from kvpool_sidecar.journal import budget_bytes
from kvpool_sidecar.settings import Settings

BATCH = 20_000


def memory(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmHWM", "VmRSS", "RssAnon", "RssShmem", "VmPTE"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def test_the_operator_counts_the_sidecars_own_defaults() -> None:
    assert Settings.max_chunks == SIDECAR_MAX_CHUNKS
    for capacity in (2**20, 2**30, 100 * 2**30):  # the emptyDir holds the arena's journal too
        assert arena_files_bytes(capacity) - capacity >= budget_bytes(capacity)


@pytest.mark.parametrize("capacity", ["256Mi", "2Gi"])
def test_the_sidecars_peak_memory_fits_the_limit_the_webhook_gives_it(capacity: str) -> None:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        proc = start_sidecar(Path(shm), capacity, [])
        try:
            client = SidecarClient(proc.info["url"], timeout=120, shm_path=str(proc.info["arena_dir"]))
            big = b"\x5a" * Settings.max_chunk_bytes
            assert client.put("ff" * 16, big) and client.get("ff" * 16) == big  # a largest chunk in flight
            del big
            keys = [(f"{i:032x}", 64) for i in range(SIDECAR_MAX_CHUNKS)]
            # each with a block prefix's key, of which the index also holds at most --max-chunks
            prefixes = {k: [f"{i + SIDECAR_MAX_CHUNKS:032x}"] for i, (k, _) in enumerate(keys)}
            for start in range(0, len(keys), BATCH):  # the index at its bound: tiny chunks
                slots = client.reserve(keys[start : start + BATCH], prefixes=prefixes)
                assert all(client.commit([(s, 0) for s in slots if s is not None]))
            assert client.stats()["chunks"] >= SIDECAR_MAX_CHUNKS - 1
            used = memory(proc.popen.pid)
        finally:
            proc.stop()
    arena = int(capacity[:-2]) * 2 ** {"Mi": 20, "Gi": 30}[capacity[-2:]]
    peak = used["VmHWM"] + used["VmPTE"]
    mib = {k: round(v / 2**20, 1) for k, v in used.items()}
    limit = sidecar_memory_bytes(arena) / 2**20
    print(f"\n{capacity}: peak RSS {mib['VmHWM']} MiB + page tables {mib['VmPTE']} MiB "
          f"(anon {mib['RssAnon']}, arena {mib['RssShmem']}); limit {limit:.1f} MiB")  # fmt: skip
    # the arena really is resident: it is what the formula is for (within 1 MiB: the kernel's RSS
    # counters in /proc are kept per thread and folded in lazily, so they lag by some pages)
    assert used["RssShmem"] >= arena - 2**20
    assert peak <= sidecar_memory_bytes(arena)
    # the page tables grow with the arena (2 MiB per GiB): no fixed overhead would hold at 100 GiB
    assert used["VmPTE"] <= arena // PAGE_TABLE_DIVISOR + 2**20
