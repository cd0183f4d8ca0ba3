"""The shared tier's default memory source: INFO memory from a real redis-server over RESP."""

from __future__ import annotations

import asyncio
import socket

from kvtest import RedisServer

from kvpool_operator.scaling import redis_info_source, redis_memory_utilization


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
