"""The shared tier's default memory source: INFO memory from a real redis-server over RESP."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtest import RedisServer, redis_call, redis_server, redis_with, start_sidecar, wait_until

from kvpool_operator.names import MONITOR_USER
from kvpool_operator.objects import redis_statefulset
from kvpool_operator.pool import parse_pool
from kvpool_operator.scaling import redis_info_source, redis_memory_utilization
from kvpool_sidecar.client import SidecarClient

POOL = parse_pool("ns", "p", {"selector": {"matchLabels": {"a": "b"}}, "backend": "redis",
                              "redis": {"mode": "shared", "memory": "256Mi"}})  # fmt: skip
PASSWORD = "s3cret"


@contextlib.contextmanager
def shard() -> Iterator[int]:
    """A real redis-server with the shard StatefulSet's own --user (the monitor) and a password."""
    (container,) = redis_statefulset(POOL, {}, 1)["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    start = args.index("--user")
    end = next((i for i in range(start + 1, len(args)) if args[i].startswith("--")), len(args))
    with redis_with(*args[start:end], password=PASSWORD) as (port, _):
        yield port


def utilization(port: int, timeout: float = 2.0) -> float | None:
    return asyncio.run(redis_memory_utilization("127.0.0.1", port, timeout))


def test_utilization_follows_used_memory_read_as_the_monitor_user() -> None:
    with shard() as port:
        assert utilization(port) is None  # no maxmemory: unknown
        redis_call(port, "CONFIG", "SET", "maxmemory", str(64 * 2**20), password=PASSWORD)
        empty = utilization(port)
        assert empty is not None and 0 < empty < 10
        redis_call(port, "SET", "k", "x" * (16 * 2**20), password=PASSWORD)
        filled = utilization(port)
        assert filled is not None and 25 < filled < 40  # 16 MiB of 64 MiB, plus Redis's own few MiB


def test_the_monitor_user_reads_nothing_else(redis: RedisServer) -> None:
    """The operator never reads the password Secret: it asks INFO as a user that can do nothing more."""
    with shard() as port:
        for command in (("GET", "k"), ("KEYS", "*"), ("CONFIG", "GET", "requirepass")):
            assert b"NOPERM" in redis_call(port, *command, password="-", user=MONITOR_USER), command
    assert utilization(redis.port) is None  # a Redis without the user (not a kvpool shard): unknown


def test_unreachable_shard_is_unknown_and_the_source_reads_shard_pods() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # bound, never listening: connection refused
        assert utilization(dead, 1.0) is None
    with shard() as port:
        redis_call(port, "CONFIG", "SET", "maxmemory", str(64 * 2**20), password=PASSWORD)
        source = redis_info_source(1.0, port)
        pods = [{"status": {"podIP": "127.0.0.1"}}]

        async def ask(shard_pods: list[dict[str, Any]]) -> float | None:
            return await source(POOL, shard_pods)

        alone = asyncio.run(ask(pods))
        assert alone is not None and asyncio.run(ask([])) is None


def test_a_shard_under_kvpools_write_pattern_stays_under_its_memory_limit(tmp_path: Path) -> None:
    """A shard with the StatefulSet's own redis-server settings, written by a real sidecar four times
    over (chunks of 64 KiB to 5 MiB, evicting all along): its peak resident memory stays under the
    container's limit, where the kernel would OOM-kill it and the pool's tier with it."""
    limit = 256 * 2**20
    (container,) = redis_statefulset(POOL, {}, 1)["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["memory"] == "256Mi"
    args = container["args"]
    settings = {args[i]: args[i + 1] for i in range(0, len(args) - 1, 2) if args[i].startswith("--")}
    with redis_server() as server:
        for name in ("maxmemory", "maxmemory-policy"):
            redis_call(server.port, "CONFIG", "SET", name, settings[f"--{name}"])
        sidecar = start_sidecar(tmp_path, "64Mi", [server.url])
        try:
            client = SidecarClient(sidecar.info["url"], timeout=30)
            rng = random.Random(0)
            written = 0
            for i in itertools.count():
                if written >= 4 * limit:
                    break
                size = rng.choice([64 * 2**10, 512 * 2**10, 2 * 2**20, 5 * 2**20])
                client.put(f"{i:032x}", bytes([i % 251]) * size)
                written += size
                if i % 20 == 19:  # the write-behind keeps up (its backlog is bounded anyway)
                    wait_until(
                        lambda: client.stats()["tiers"]["redis"]["queued"] == 0, 60, "the write-behind"
                    )
            wait_until(lambda: client.stats()["tiers"]["redis"]["queued"] == 0, 60, "the write-behind")
        finally:
            sidecar.stop()
        assert server.proc is not None
        peak = next(
            int(line.split()[1]) * 1024
            for line in Path(f"/proc/{server.proc.popen.pid}/status").read_text().splitlines()
            if line.startswith("VmHWM:")
        )
        evicted = int(redis_call(server.port, "INFO", "stats").split(b"evicted_keys:")[1].split(b"\r")[0])
    print(f"\npeak RSS {peak / 2**20:.1f} MiB, {peak / limit:.3f} of the limit; {evicted} evicted")
    assert evicted > 0  # it was full, and evicting
    assert peak <= limit
