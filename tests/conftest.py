from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from kvtest import Proc, RedisServer, redis_server, start_sidecar


@pytest.fixture(scope="session", autouse=True)
def vllm_ipc_dir() -> Iterator[str]:
    """One directory, removed at the end, for the IPC sockets of every vLLM engine the tests start:
    vLLM leaves them in /tmp when an engine is stopped or killed, thousands a day here."""
    with tempfile.TemporaryDirectory(prefix="kvpool-ipc-") as d, pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_RPC_BASE_PATH", d)
        yield d


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, stopped after the test."""
    with redis_server() as server:
        yield server


@pytest.fixture
def sidecar_factory(tmp_path: Path) -> Iterator:
    """Starts real `kvpool-sidecar` processes; all are stopped after the test."""
    started: list[Proc] = []

    def make(
        capacity: str | int = "64Mi",
        redis_urls: Sequence[str] = (),
        *extra: str,
        port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> Proc:
        proc = start_sidecar(tmp_path, capacity, redis_urls, *extra, port=port, env=env)
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.stop()
