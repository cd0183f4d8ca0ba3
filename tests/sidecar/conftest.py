"""Fixtures of the sidecar tests: Redis variants the shared `redis` fixture does not start."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kvtest import free_port, redis_call, redis_with, wait_until


@pytest.fixture
def redis_cluster() -> Iterator[int]:
    """A one-node Redis Cluster owning all 16384 slots: the real cluster protocol, cheaply."""
    # The cluster bus port defaults to port + 10000, which a free port may push past 65535.
    bus = ["--cluster-port", str(free_port())]
    with redis_with("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", *bus) as (port, _):
        redis_call(port, "CLUSTER", "ADDSLOTSRANGE", "0", "16383")
        wait_until(lambda: b"cluster_state:ok" in redis_call(port, "CLUSTER", "INFO"), 15, "cluster state ok")
        yield port
