"""Sidecar figures: arena and HTTP save/load, the Redis tier, lookup latency, control transports.

Every throughput is a median with its range over 7 runs and a ratio to a memcpy of the same bytes
measured in the same run. Run: `.venv/bin/python -m bench sidecar`.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import redis
from redis._parsers import _RESP2Parser

from bench.stats import Compared, compare, latencies_ms, load_note

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kvtest import redis_server, start_sidecar

from kvpool_sidecar.arena import Arena
from kvpool_sidecar.client import SidecarClient, Slot, checksum
from kvpool_sidecar.redis_connect import ZeroCopyConnection
from kvpool_sidecar.redis_tier import RedisTier
from kvpool_sidecar.store import Store

MiB = 2**20
BATCH_BYTES = 64 * MiB  # one save or load batch: 16 x 4 MiB or 2 x 32 MiB


class Keys:
    """Fresh chunk keys, so every save stores new chunks."""

    def __init__(self) -> None:
        self.n = 0

    def take(self, count: int) -> list[str]:
        self.n += count
        return [f"{i:064x}" for i in range(self.n - count, self.n)]


def line(what: str, c: Compared) -> None:
    print(f"  {what:<46} {c}")


def _reserved(c: SidecarClient, items: list[tuple[str, int]]) -> list[Slot]:
    """Slots for every item: the bench's arena always has room, so a refusal is a broken run."""
    slots = c.reserve(items)
    if None in slots:
        raise RuntimeError(f"the sidecar reserved {len(slots) - slots.count(None)} of {len(items)} chunks")
    return [s for s in slots if s is not None]


def arena_and_http(c: SidecarClient, size: int, keys: Keys) -> None:
    count = BATCH_BYTES // size
    payloads = [os.urandom(1024) * (size // 1024) for _ in range(count)]
    print(f" {size // MiB} MiB chunks, batches of {count} ({count * size // MiB} MiB):")
    arena = c.arena()
    batch: list[str] = []

    def fresh() -> None:
        batch[:] = keys.take(count)

    def save() -> None:
        slots = _reserved(c, [(k, size) for k in batch])
        for s, data in zip(slots, payloads, strict=True):
            arena[s.offset : s.offset + s.length] = data
        c.commit([(s, checksum(d)) for s, d in zip(slots, payloads, strict=True)])

    line("arena save (reserve, copy in, commit)", compare(count * size, save, setup=fresh))
    dst = [memoryview(bytearray(size)) for _ in range(count)]  # memoryview: a plain memcpy on assignment

    def load() -> None:
        pinned = c.pin(batch)
        assert len(pinned.slots) == count
        for s, out in zip(pinned.slots, dst, strict=True):
            out[:] = arena[s.offset : s.offset + s.length]
        c.release(pinned.lease)

    line("arena load (pin+verify, copy out, release)", compare(count * size, load))

    def load_checked_by_caller() -> None:
        pinned = c.pin(batch, verify=False)
        for s, out in zip(pinned.slots, dst, strict=True):
            out[:] = arena[s.offset : s.offset + s.length]
            assert checksum(out) == s.checksum
        c.release(pinned.lease)

    line("arena load (pin, copy out, caller verifies)", compare(count * size, load_checked_by_caller))

    def put() -> None:
        for k, data in zip(batch, payloads, strict=True):
            assert c.put(k, data)

    line("HTTP PUT octet-stream", compare(count * size, put, setup=fresh))

    def get() -> None:
        for k in batch:
            assert c.get(k) is not None

    line("HTTP GET octet-stream", compare(count * size, get))


def lookup_and_control(c: SidecarClient, url: str, arena_dir: str, keys: Keys) -> None:
    batch = keys.take(64)
    slots = _reserved(c, [(k, 4096) for k in batch])
    c.commit([(s, checksum(bytes(4096))) for s in slots])  # a fresh arena holds zeros
    for mode in ("http", "socket"):
        cc = SidecarClient(url, timeout=10, shm_path=arena_dir, control=mode)
        p50, p99 = latencies_ms(functools.partial(cc.lookup, batch), 2000)
        print(f"  {'lookup 64 keys (all hits) over ' + mode:<44} p50 {p50:.3f} ms  p99 {p99:.3f} ms")

        def pin_release(cc: SidecarClient = cc) -> None:
            cc.release(cc.pin(batch[:16]).lease)

        p50, p99 = latencies_ms(pin_release, 2000)
        print(
            f"  {'pin+release 16 keys over ' + mode:<44} p50 {p50:.3f} ms  p99 {p99:.3f} ms (2 round trips)"
        )
        cc.close()


def _write_each(tier: RedisTier, keys: Iterable[str]) -> None:
    for k in keys:
        tier.write(k)


def redis_tier(redis_url: str, workdir: Path) -> None:
    """In-process: the tier's own write (SET pieces) and promotion (GET pieces into the arena)."""
    count = 8
    print(f" Redis tier, 32 MiB chunks ({count} per batch, 4 MiB pieces), one connection, in-process:")
    src = Store(Arena(workdir / "a", 256 * MiB))
    chunks = {f"{i:064x}": os.urandom(1024) * (32 * MiB // 1024) for i in range(count)}
    for k, v in chunks.items():
        src.put(k, v)
    plain = redis.Redis.from_url(redis_url)
    variants: dict[str, dict[str, Any]] = {
        "py packer+hiredis parser (chosen)": {"connection_class": ZeroCopyConnection},
        "hiredis packer+parser (default)": {},
        "py packer+py parser": {"connection_class": ZeroCopyConnection, "parser_class": _RESP2Parser},
    }
    nbytes = sum(map(len, chunks.values()))
    for name, kwargs in variants.items():
        writer = RedisTier(src, (redis_url,))
        writer.shards.current[0].client = redis.Redis.from_url(redis_url, **kwargs)
        writer.check_health()
        line(
            f"SET, {name}",
            compare(nbytes, functools.partial(_write_each, writer, chunks), setup=plain.flushall),
        )
        dst = Store(Arena(workdir / "b", 512 * MiB))
        reader = RedisTier(dst, (redis_url,))
        reader.shards.current[0].client = redis.Redis.from_url(redis_url, **kwargs)
        reader.check_health()
        dst.lower = reader

        def forget(d: Store = dst, reader: RedisTier = reader) -> None:
            d.lower = None  # delete locally only
            for k in chunks:
                d.delete(k)
            d.lower = reader

        def promote(d: Store = dst) -> None:
            with d.pinned(list(chunks)) as slots:
                assert len(slots) == len(chunks)

        line(f"promote, {name}", compare(nbytes, promote, setup=forget))
        for t in (writer, reader):
            for s in t.shards.current:
                if s.client is not None:
                    s.client.close()
        dst.arena.close()
    src.arena.close()


def main() -> None:
    print(f" {load_note()}; numpy {np.__version__}, redis-py {redis.__version__}")
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="kvpool-bench-") as d:
        workdir = Path(d)
        proc = start_sidecar(workdir, "1Gi", [], "--max-chunk-bytes", "64Mi", "--log-level", "warning")
        try:
            url, arena_dir = proc.info["url"], str(proc.info["arena_dir"])
            c = SidecarClient(url, timeout=30, shm_path=arena_dir)
            keys = Keys()
            for size in (4 * MiB, 32 * MiB):
                arena_and_http(c, size, keys)
            print(" latency:")
            lookup_and_control(c, url, arena_dir, keys)
            c.close()
        finally:
            proc.stop()
        with redis_server() as server:
            redis_tier(server.url, workdir)
