"""The shared tier's default memory source: INFO memory from a real redis-server over RESP."""

from __future__ import annotations

import asyncio
import itertools
import random
import socket
from pathlib import Path

from kvtest import RedisServer, redis_server, start_sidecar, wait_until

from kvpool_operator.objects import redis_statefulset
from kvpool_operator.pool import parse_pool
from kvpool_operator.scaling import redis_info_source, redis_memory_utilization
from kvpool_sidecar.client import SidecarClient


def redis_command(port: int, *parts: str) -> bytes:
    wire = f"*{len(parts)}\r\n".encode() + b"".join(f"${len(p)}\r\n{p}\r\n".encode() for p in parts)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(wire)
        return s.recv(65536)


def test_utilization_follows_used_memory(redis: RedisServer) -> None:
    assert (
        asyncio.run(redis_memory_utilization("127.0.0.1", redis.port, None, 2.0)) is None
    )  # no maxmemory: unknown
    redis_command(redis.port, "CONFIG", "SET", "maxmemory", str(64 * 2**20))
    empty = asyncio.run(redis_memory_utilization("127.0.0.1", redis.port, None, 2.0))
    assert empty is not None and 0 < empty < 10
    redis_command(redis.port, "SET", "k", "x" * (16 * 2**20))
    filled = asyncio.run(redis_memory_utilization("127.0.0.1", redis.port, None, 2.0))
    assert filled is not None and 25 < filled < 40  # 16 MiB of 64 MiB, plus Redis's own few MiB


def test_password_is_sent_and_a_wrong_one_is_unknown(redis: RedisServer) -> None:
    redis_command(redis.port, "CONFIG", "SET", "maxmemory", str(64 * 2**20))
    redis_command(redis.port, "CONFIG", "SET", "requirepass", "s3cret")
    assert asyncio.run(redis_memory_utilization("127.0.0.1", redis.port, "s3cret", 2.0)) is not None
    assert asyncio.run(redis_memory_utilization("127.0.0.1", redis.port, "wrong", 2.0)) is None
    assert asyncio.run(redis_memory_utilization("127.0.0.1", redis.port, None, 2.0)) is None


def test_unreachable_shard_is_unknown_and_the_source_reads_shard_pods(redis: RedisServer) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # bound, never listening: connection refused
        assert asyncio.run(redis_memory_utilization("127.0.0.1", dead, None, 1.0)) is None
    redis_command(redis.port, "CONFIG", "SET", "maxmemory", str(64 * 2**20))
    source = redis_info_source(1.0, redis.port)
    pods = [{"status": {"podIP": "127.0.0.1"}}]
    alone = asyncio.run(source(None, pods, None))  # type: ignore[arg-type]
    assert alone is not None and asyncio.run(source(None, [], None)) is None  # type: ignore[arg-type]


def test_a_shard_under_kvpools_write_pattern_stays_under_its_memory_limit(tmp_path: Path) -> None:
    """A shard with the StatefulSet's own redis-server settings, written by a real sidecar four times
    over (chunks of 64 KiB to 5 MiB, evicting all along): its peak resident memory stays under the
    container's limit, where the kernel would OOM-kill it and the pool's tier with it."""
    limit = 256 * 2**20
    pool = parse_pool("ns", "p", {"selector": {"matchLabels": {"a": "b"}}, "backend": "redis",
                                  "redis": {"mode": "shared", "memory": "256Mi"}})  # fmt: skip
    (container,) = redis_statefulset(pool, {}, 1)["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["memory"] == "256Mi"
    args = container["args"]
    settings = {args[i]: args[i + 1] for i in range(0, len(args) - 1, 2) if args[i].startswith("--")}
    with redis_server() as shard:
        for name in ("maxmemory", "maxmemory-policy"):
            redis_command(shard.port, "CONFIG", "SET", name, settings[f"--{name}"])
        sidecar = start_sidecar(tmp_path, "64Mi", [shard.url])
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
        peak = next(
            int(line.split()[1]) * 1024
            for line in Path(f"/proc/{shard.proc.popen.pid}/status").read_text().splitlines()
            if line.startswith("VmHWM:")
        )
        evicted = int(redis_command(shard.port, "INFO", "stats").split(b"evicted_keys:")[1].split(b"\r")[0])
    print(f"\npeak RSS {peak / 2**20:.1f} MiB, {peak / limit:.3f} of the limit; {evicted} evicted")
    assert evicted > 0  # it was full, and evicting
    assert peak <= limit
