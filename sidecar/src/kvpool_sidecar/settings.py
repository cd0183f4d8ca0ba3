"""The sidecar's settings: flags, each also an environment variable KVPOOL_<FLAG>; the flag wins."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

_UNITS = {
    "": 1,
    "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
}  # fmt: skip
_QUANTITY = re.compile(r"^\s*(\d+)\s*(k|K|Ki|M|Mi|G|Gi|T|Ti|)\s*$")


def parse_quantity(text: str | int) -> int:
    """Bytes from an integer or a Kubernetes-style quantity: 512Mi, 4Gi, 1G."""
    if isinstance(text, int):
        return text
    m = _QUANTITY.match(text)
    if not m:
        raise ValueError(f"not a byte quantity: {text!r} (use e.g. 1073741824, 512Mi, 4Gi, 1G)")
    return int(m.group(1)) * _UNITS[m.group(2)]


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 7070
    capacity: int = 4 * 2**30
    arena_dir: Path = Path("/var/run/kvpool")
    redis_urls: tuple[str, ...] = ()
    redis_urls_file: Path | None = None
    redis_password: str | None = field(default=None, repr=False)
    pool_key: bytes | None = field(default=None, repr=False)  # authenticates chunks in Redis (see redis_tier)
    # the same two from files (a mounted Secret, which the kubelet keeps current): re-read while running
    redis_password_file: Path | None = None
    pool_key_file: Path | None = None
    pool_key_required: bool = False  # without a key, keep Redis off rather than trust it
    shared_group: bool = False  # every container that uses the arena has this process's group
    keep_arena: bool = False  # leave the arena file at exit (a pod's emptyDir, for the next start)
    max_chunk_bytes: int = 64 * 2**20
    lease_seconds: float = 30.0
    status_host: str = "::"  # every address, IPv4 and IPv6 (listen.py)
    status_port: int = 0
    redis_queue_bytes: int = 0  # 0: half the capacity
    max_chunks: int = 200_000
    prewarm_bytes: int = 0  # a new sidecar's pre-warm from the pool's hottest chunks in Redis (0: off)
    log_level: str = "info"


def _env(environ: Mapping[str, str], flag: str) -> str | None:
    value = environ.get("KVPOOL_" + flag.upper().replace("-", "_"))
    return value if value not in (None, "") else None


def _env_flag(environ: Mapping[str, str], flag: str) -> bool:
    return _env(environ, flag) in ("1", "true", "yes")


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    d = Settings()

    def default(flag: str, fallback: object) -> object:
        value = _env(environ, flag)
        return fallback if value is None else value

    p = argparse.ArgumentParser(
        prog="kvpool-sidecar",
        description="kvpool's KV-cache sidecar. Every flag is also read from KVPOOL_<FLAG>; the flag wins.",
    )
    p.add_argument("--host", default=default("host", d.host))
    p.add_argument("--port", type=int, default=default("port", d.port))
    p.add_argument(
        "--capacity",
        type=parse_quantity,
        default=default("capacity", d.capacity),
        help="CPU tier size = arena size: bytes or a quantity (512Mi, 4Gi, 1G)",
    )
    p.add_argument("--arena-dir", type=Path, default=default("arena-dir", d.arena_dir))
    env_urls = _env(environ, "redis-url")
    p.add_argument(
        "--redis-url",
        action="append",
        dest="redis_urls",
        default=None,
        help="one per shard; redis+cluster:// or ?cluster=true for Redis Cluster "
        "(env KVPOOL_REDIS_URL: comma-separated)",
    )
    p.set_defaults(env_redis_urls=[u.strip() for u in env_urls.split(",") if u.strip()] if env_urls else [])
    p.add_argument(
        "--redis-urls-file",
        type=Path,
        default=default("redis-urls-file", None),
        help="a file with one Redis URL per line, re-read when it changes",
    )
    for secret, env in (("redis-password", "KVPOOL_REDIS_PASSWORD"), ("pool-key", "KVPOOL_POOL_KEY")):
        p.add_argument(
            f"--{secret}-file",
            type=Path,
            default=default(f"{secret}-file", None),
            help=f"read {env} from this file (a mounted Secret) and again whenever it changes; the file wins",
        )
    p.add_argument(
        "--max-chunk-bytes", type=parse_quantity, default=default("max-chunk-bytes", d.max_chunk_bytes)
    )
    p.add_argument("--lease-seconds", type=float, default=default("lease-seconds", d.lease_seconds))
    p.add_argument("--status-host", default=default("status-host", d.status_host))
    p.add_argument(
        "--status-port",
        type=int,
        default=default("status-port", d.status_port),
        help="read-only /healthz /readyz /stats /metrics on this port (0: off)",
    )
    p.add_argument(
        "--redis-queue-bytes",
        type=parse_quantity,
        default=default("redis-queue-bytes", d.redis_queue_bytes),
        help="write-behind backlog in bytes (0: half the capacity); saves beyond it are not written "
        "to Redis (counted)",
    )
    p.add_argument(
        "--max-chunks",
        type=int,
        default=default("max-chunks", d.max_chunks),
        help="chunks the index holds at most (its memory, about 0.3 KiB each); beyond, eviction",
    )
    p.add_argument(
        "--prewarm-bytes",
        type=parse_quantity,
        default=default("prewarm-bytes", d.prewarm_bytes),
        help="at start, load up to this many bytes of the pool's hottest chunks from the Redis tier into "
        "free room of the CPU tier, in the background (0: off; needs a Redis tier)",
    )
    p.add_argument(
        "--shared-group",
        action="store_true",
        default=_env_flag(environ, "shared-group"),
        help="the arena's users all have this process's group (a pod's supplementalGroups): files are 0660",
    )
    p.add_argument(
        "--keep-arena",
        action="store_true",
        default=_env_flag(environ, "keep-arena"),
        help="leave the arena file at exit (in a pod: a restarted sidecar reuses its memory, and the "
        "emptyDir goes with the pod); without it the file is removed, so a host's tmpfs gets its RAM back",
    )
    p.add_argument(
        "--pool-key-required",
        action="store_true",
        default=_env_flag(environ, "pool-key-required"),
        help="keep the Redis tier off while there is no pool key (KVPOOL_POOL_KEY or --pool-key-file)",
    )
    p.add_argument("--log-level", default=default("log-level", d.log_level))
    return p  # fmt: skip


def parse_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    environ = os.environ if environ is None else environ
    parser = build_parser(environ)
    ns = parser.parse_args(argv)
    # argparse applies `type` to string defaults taken from the environment too.
    if ns.capacity <= 0:
        parser.error("--capacity must be positive")
    if ns.max_chunk_bytes <= 0:
        parser.error("--max-chunk-bytes must be positive")
    if ns.lease_seconds <= 0:
        parser.error("--lease-seconds must be positive")
    if ns.max_chunks <= 0:
        parser.error("--max-chunks must be positive")
    if ns.redis_queue_bytes < 0:
        parser.error("--redis-queue-bytes must not be negative")
    if ns.prewarm_bytes < 0:
        parser.error("--prewarm-bytes must not be negative")
    has_redis = ns.redis_urls or ns.env_redis_urls or ns.redis_urls_file
    if ns.prewarm_bytes and not has_redis:
        parser.error("--prewarm-bytes pre-warms from the Redis tier: give --redis-url or --redis-urls-file")
    return Settings(
        host=ns.host,
        port=ns.port,
        capacity=ns.capacity,
        arena_dir=ns.arena_dir,
        redis_urls=tuple(ns.redis_urls if ns.redis_urls is not None else ns.env_redis_urls),
        redis_urls_file=ns.redis_urls_file,
        redis_password=_env(environ, "redis-password"),
        pool_key=key.encode() if (key := _env(environ, "pool-key")) else None,
        redis_password_file=ns.redis_password_file,
        pool_key_file=ns.pool_key_file,
        pool_key_required=ns.pool_key_required,
        shared_group=ns.shared_group,
        keep_arena=ns.keep_arena,
        max_chunk_bytes=ns.max_chunk_bytes,
        lease_seconds=ns.lease_seconds,
        status_host=ns.status_host,
        status_port=ns.status_port,
        redis_queue_bytes=ns.redis_queue_bytes,
        max_chunks=ns.max_chunks,
        prewarm_bytes=ns.prewarm_bytes,
        log_level=ns.log_level,
    )
