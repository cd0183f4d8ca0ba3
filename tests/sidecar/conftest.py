"""Fixtures of the sidecar tests: the API in this process, and Redis variants the shared `redis` fixture
does not start."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from kvtest import free_port, redis_call, redis_with, wait_until, write_auth

from kvpool_sidecar.app import create_app
from kvpool_sidecar.service import Sidecar
from kvpool_sidecar.settings import parse_settings


@pytest.fixture
def api(tmp_path: Path) -> Iterator[TestClient]:
    """The sidecar's whole HTTP API served in this process by FastAPI's TestClient (no uvicorn, no port):
    for tests of what the API answers. Writes carry the write token; `api.app.state.sidecar` is the
    Sidecar behind it. Tests of the wire (raw sockets, half-closes) and of the client start a process."""
    argv = ["--arena-dir", str(tmp_path / "arena"), "--capacity", "4Mi", "--max-chunk-bytes", "1Mi"]
    sidecar = Sidecar.build(parse_settings(argv, environ={}))
    try:
        with TestClient(create_app(sidecar), headers=write_auth(sidecar.settings.arena_dir)) as client:
            yield client
    finally:
        sidecar.close()


@pytest.fixture
def redis_cluster() -> Iterator[int]:
    """A one-node Redis Cluster owning all 16384 slots: the real cluster protocol, cheaply."""
    # The cluster bus port defaults to port + 10000, which a free port may push past 65535.
    bus = ["--cluster-port", str(free_port())]
    with redis_with("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", *bus) as (port, _):
        redis_call(port, "CLUSTER", "ADDSLOTSRANGE", "0", "16383")
        wait_until(lambda: b"cluster_state:ok" in redis_call(port, "CLUSTER", "INFO"), 15, "cluster state ok")
        yield port
