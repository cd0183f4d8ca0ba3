"""Helpers of the sidecar tests: keys, payloads, saving and loading through the arena."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import socket
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from kvtest import Proc, free_port, need, spawn, wait_until

from kvpool_sidecar.client import SidecarClient


def key(i: int, tag: str = "a") -> str:
    return hashlib.sha256(f"{tag}:{i}".encode()).hexdigest()


def payload(n: int, seed: int) -> bytes:
    """n bytes that differ between seeds everywhere, so a wrong chunk never passes for a right one."""
    block = hashlib.sha256(str(seed).encode()).digest() * 2048
    return (block * (n // len(block) + 1))[:n]


def save(c: SidecarClient, chunks: dict[str, bytes], priority: int = 0) -> list[str]:
    """Saves through the arena; returns the keys that were written."""
    slots = c.reserve([(k, len(v)) for k, v in chunks.items()], priority)
    arena = c.arena()
    written = [s for s in slots if s is not None]
    for s in written:
        arena[s.offset : s.offset + s.length] = chunks[s.key]
    c.commit(written)
    return [s.key for s in written]


def load(c: SidecarClient, keys: list[str]) -> dict[str, bytes]:
    """Loads the longest loadable prefix through the arena."""
    pinned = c.pin(keys)
    arena = c.arena()
    try:
        return {s.key: bytes(arena[s.offset : s.offset + s.length]) for s in pinned.slots}
    finally:
        c.release(pinned.lease)


def http_json(url: str, method: str = "GET", body: bytes | None = None, headers: dict | None = None):
    """(status, parsed JSON or raw bytes) without raising on 4xx/5xx."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status, data = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, data = e.code, e.read()
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data


def redis_stats(c: SidecarClient) -> dict:
    return c.stats()["tiers"]["redis"]


def redis_call(port: int, *args: str, password: str | None = None) -> bytes:
    """One command over a raw socket (no client library between the test and the server)."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        if password:
            s.sendall(_resp("AUTH", password))
            s.recv(64)
        s.sendall(_resp(*args))
        return s.recv(65536)


def _resp(*args: str) -> bytes:
    out = f"*{len(args)}\r\n".encode()
    for a in args:
        b = a.encode()
        out += b"$%d\r\n%s\r\n" % (len(b), b)
    return out


@contextlib.contextmanager
def redis_with(
    *extra: str, password: str | None = None, port: int | None = None
) -> Iterator[tuple[int, Proc]]:
    """A real redis-server with extra arguments (a password, cluster mode)."""
    binary = shutil.which("redis-server")
    need(binary is not None, "redis-server")
    port = port or free_port()
    with tempfile.TemporaryDirectory(prefix="kvpool-redis-") as d:
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", d, "--protected-mode", "no", *extra]  # fmt: skip
        if password:
            argv += ["--requirepass", password]
        proc = spawn(argv, Path(d) / "redis.log")
        try:
            try:
                wait_until(lambda: b"PONG" in redis_call(port, "PING", password=password), 15, "redis-server")
            except TimeoutError:
                raise RuntimeError(f"redis-server did not start:\n{proc.output()}") from None
            yield port, proc
        finally:
            proc.stop()
