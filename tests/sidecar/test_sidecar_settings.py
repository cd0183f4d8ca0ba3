"""Flags and their environment variables; the status port; the Prometheus text."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from kvtest import free_port, http_ok, wait_until
from sidecar_support import key

from kvpool_sidecar.app import create_status_app
from kvpool_sidecar.settings import parse_quantity, parse_settings


@pytest.mark.parametrize(
    ("text", "n"),
    [
        ("1073741824", 2**30),
        ("512Mi", 512 * 2**20),
        ("4Gi", 4 * 2**30),
        ("1G", 10**9),
        ("64Ki", 65536),
        ("2k", 2000),
    ],
)
def test_quantities(text: str, n: int) -> None:
    assert parse_quantity(text) == n


@pytest.mark.parametrize("text", ["", "1.5Gi", "-1", "4 gigs", "Gi", "4gi"])
def test_bad_quantities(text: str) -> None:
    with pytest.raises(ValueError):
        parse_quantity(text)


def test_env_fallbacks_and_the_flag_wins() -> None:
    env = {
        "KVPOOL_CAPACITY": "1Gi",
        "KVPOOL_PORT": "9000",
        "KVPOOL_ARENA_DIR": "/tmp/a",
        "KVPOOL_REDIS_URL": "redis://a:1/0, redis://b:2/0",
        "KVPOOL_MAX_CHUNK_BYTES": "8Mi",
        "KVPOOL_REDIS_PASSWORD": "pw",
        "KVPOOL_STATUS_PORT": "7071",
        "KVPOOL_LEASE_SECONDS": "5",
    }
    s = parse_settings([], env)
    assert (s.capacity, s.port, s.arena_dir, s.max_chunk_bytes) == (2**30, 9000, Path("/tmp/a"), 8 * 2**20)
    assert s.redis_urls == ("redis://a:1/0", "redis://b:2/0") and s.redis_password == "pw"
    assert (s.status_port, s.lease_seconds) == (7071, 5.0)
    s = parse_settings(["--capacity", "2Gi", "--port", "1", "--redis-url", "redis://c:3/0"], env)
    assert (s.capacity, s.port, s.redis_urls) == (2 * 2**30, 1, ("redis://c:3/0",))
    assert parse_settings([], {}).redis_urls == ()


def test_bad_flag_values_exit_with_a_message(capsys) -> None:
    for argv in (["--capacity", "lots"], ["--capacity", "0"], ["--lease-seconds", "-1"]):
        with pytest.raises(SystemExit):
            parse_settings(argv, {})
        assert "capacity" in capsys.readouterr().err or "lease" in argv[0]
    with pytest.raises(SystemExit):  # a pre-warm reads the Redis tier: without one it is a mistake
        parse_settings(["--prewarm-bytes", "1Gi"], {})
    assert "--redis-url" in capsys.readouterr().err
    with_redis = parse_settings(["--prewarm-bytes", "1Gi"], {"KVPOOL_REDIS_URL": "redis://a:1/0"})
    assert with_redis.prewarm_bytes == 2**30


def test_status_port_serves_only_the_read_only_routes(api) -> None:
    status = TestClient(create_status_app(api.app.state.sidecar), headers=api.headers)
    for path in ("/healthz", "/readyz", "/stats", "/metrics"):
        assert status.get(path).status_code == 200, path
    assert status.post("/v1/lookup", json={"keys": []}).status_code == 404
    assert status.put(f"/v1/chunks/{key(1)}", content=b"x").status_code in (404, 405)
    assert status.get("/v1/arena").status_code == 404
    assert api.get("/v1/arena").status_code == 200


def test_stats_and_metrics(api) -> None:
    api.put(f"/v1/chunks/{key(1)}", content=b"a" * 1000)
    api.post("/v1/lookup", json={"keys": [key(1), key(2)]})
    stats = api.get("/stats").json()
    for name in ("hits", "misses", "hit_rate", "stored_bytes", "capacity_bytes", "chunks", "evictions",
                 "bytes_in", "bytes_out", "tiers"):  # fmt: skip
        assert name in stats
    assert (stats["hits"], stats["misses"], stats["hit_rate"]) == (1, 1, 0.5)
    assert stats["tiers"]["cpu"]["stored_bytes"] == 1000
    answer = api.get("/metrics")
    assert answer.status_code == 200
    lines = answer.text.splitlines()
    assert "kvpool_stored_bytes 1000.0" in lines and "kvpool_ready 1.0" in lines
    assert all(ln.startswith(("# ", "kvpool_")) for ln in lines)


def test_an_arena_that_cannot_be_made_is_a_clear_exit(tmp_path) -> None:
    import subprocess
    import sys

    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = [
        sys.executable,
        "-m",
        "kvpool_sidecar",
        "--arena-dir",
        str(blocker / "arena"),
        "--capacity",
        "1Mi",
    ]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert "cannot start" in run.stderr and "Traceback" not in run.stderr


def test_the_status_port_answers_on_ipv4_and_ipv6_alike(sidecar_factory) -> None:
    """IPv6-only clusters probe the pod's IPv6 address, IPv4 clusters its IPv4 one: by default the status
    listener takes both (one dual-stack socket)."""
    status_port = free_port()
    sidecar_factory("4Mi", [], "--status-port", str(status_port))
    for host in ("127.0.0.1", "[::1]"):
        wait_until(partial(http_ok, f"http://{host}:{status_port}/healthz"), 10, f"/healthz on {host}")
