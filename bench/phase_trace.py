"""A vLLM general plugin that times the engine's phases in any server, vLLM alone or with kvpool, for
`bench phases`: the scheduler's schedule(), update_from_output() and add_request() and the engine's
pause and resume (engine-core process), the worker's execute_model() (the forward) and the model's
own forward inside it, and kvpool's lookups and saves.

vLLM loads it in its engine-core and worker processes from the entry point that `plugin_dir()` writes
(put that folder on the server's PYTHONPATH). Each process keeps its records in memory and writes them
to PHASE_TRACE_DIR/<pid>.jsonl only between waves (at a pause, and at the worker's empty step after
the last request ends): a write to a file costs up to a millisecond here, more than some phases.
Times are time.perf_counter(), CLOCK_MONOTONIC, so they compare across processes and with the client.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DIR_ENV = "PHASE_TRACE_DIR"
Extra = Callable[[tuple[Any, ...], Any], dict[str, Any]]  # (the call's arguments, its result) -> fields
When = Callable[[tuple[Any, ...], Any], bool]

_records: list[dict[str, Any]] = []
_lock = threading.Lock()
_installed = False


def plugin_dir(where: Path) -> Path:
    """A folder holding this plugin's entry point (vllm.general_plugins), for a server's PYTHONPATH."""
    info = where / "kvpool_phase_trace-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvpool-phase-trace\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nphase_trace = bench.phase_trace:install\n"
    )
    return where


def server_env(plugin_at: Path, records_at: Path) -> dict[str, str]:
    """The environment a traced server needs: this plugin's entry point (written under `plugin_at`)
    and the repository on its PYTHONPATH, and where to write its records."""
    path = f"{plugin_dir(plugin_at)}:{Path(__file__).resolve().parents[1]}:{os.environ.get('PYTHONPATH', '')}"
    return {DIR_ENV: str(records_at), "PYTHONPATH": path}


def _flush() -> None:
    with _lock:
        taken = _records[:]
        del _records[: len(taken)]
        with open(Path(os.environ[DIR_ENV]) / f"{os.getpid()}.jsonl", "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in taken))


def _timed(
    cls: type, name: str, phase: str, extra: Extra | None = None, flush_if: When | None = None
) -> None:
    inner = getattr(cls, name)

    @functools.wraps(inner)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        record = {"phase": phase, "t0": t0, "t1": time.perf_counter(), **(extra(args, out) if extra else {})}
        _records.append(record)  # one append: atomic under the GIL, no lock in the timed path
        if flush_if is not None and flush_if(args, out):
            _flush()
        return out

    setattr(cls, name, timed)


def _tokens(args: tuple[Any, ...], out: Any) -> dict[str, Any]:
    return {"tokens": out.total_num_scheduled_tokens, "new": len(out.scheduled_new_reqs)}


def _worker_tokens(args: tuple[Any, ...], out: Any) -> dict[str, Any]:
    return {"tokens": args[1].total_num_scheduled_tokens}


def install() -> None:
    """vLLM's plugin hook: called once in each of its processes; does nothing without PHASE_TRACE_DIR."""
    global _installed
    if _installed or DIR_ENV not in os.environ:
        return
    _installed = True
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore, EngineCoreProc
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    _timed(Scheduler, "schedule", "schedule", _tokens)
    _timed(Scheduler, "update_from_output", "update")
    _timed(Scheduler, "add_request", "add")  # where a connector's on_new_request runs
    _timed(EngineCore, "resume_scheduler", "resume")
    _timed(EngineCoreProc, "pause_scheduler", "pause", flush_if=lambda args, out: True)
    _timed(
        Worker,
        "execute_model",
        "forward",
        _worker_tokens,
        lambda args, out: not args[1].total_num_scheduled_tokens,
    )
    _timed(GPUModelRunner, "_model_forward", "model")  # the model alone, inside execute_model
    try:
        from kvpool_connector import KVPoolConnector
        from kvpool_connector.worker import KVPoolWorker
    except ImportError:  # a server without kvpool
        return
    _timed(KVPoolConnector, "get_num_new_matched_tokens", "lookup")
    _timed(KVPoolWorker, "_run_save", "save", lambda args, out: {"chunks": len(args[1].saves)})
