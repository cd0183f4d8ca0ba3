"""CPU time of a kvpool server's processes beside the forward, by role, to the nanosecond, from
/proc/<pid>/task/*/schedstat (the time each thread ran).

Wall time on this VM moves a few percent from wave to wave with the machine; CPU time counts only
what the threads did, so a cost of a few ms a wave stands out of it. Not counted: the worker's main
thread (the forward) and the engine core, which poll vLLM's shared-memory queues between steps, so
their CPU time holds spinning that moves with timing, not work."""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

WORKER_OTHERS = "the worker's threads beside the forward (kvpool's save thread)"
SAVE_THREAD = "of them, kvpool's save thread"
SAVE_PROCESS = "kvpool's save process (a child of the worker)"
SIDECAR = "sidecar"
API_SERVER = "API server"
# Not CPU time: how long the forward's thread was ready to run but waited for a CPU (another thread
# held its core), schedstat's second field.
FORWARD_WAITED = "the forward's thread, waiting for a CPU (run queue)"
ROLES = (WORKER_OTHERS, SAVE_THREAD, SAVE_PROCESS, SIDECAR, API_SERVER, FORWARD_WAITED)


# schedstat's fields: nanoseconds a thread has run, and has waited on a run queue
RAN, WAITED = 0, 1


def _schedstat_ns(pid: int, tid: int, field: int = RAN) -> int:
    """One thread's schedstat field, in nanoseconds; 0 for a thread that has ended."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            return int(f.read().split()[field])
    except (OSError, ValueError, IndexError):
        return 0


def _process_ns(pid: int, named: str | None = None) -> int:
    """The CPU time of a process's threads (those whose OS name is `named`, if given)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return 0
    if named is not None:
        tids = [t for t in tids if _comm(pid, t) == named]
    return sum(_schedstat_ns(pid, t) for t in tids)


def _comm(pid: int, tid: int) -> str | None:
    """A thread's OS name (kvpool names its own: affinity.name_native_thread); None once it has ended."""
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


@dataclass(frozen=True)
class ServerProcesses:
    api_server: int
    worker: int
    sidecar: int | None
    save_process: int | None  # the connector's, where it runs the saves (save_process.py)

    @classmethod
    def find(cls) -> ServerProcesses:
        """This process's one vLLM server (one engine core, one worker) and its sidecar, if any."""
        children = psutil.Process().children()
        (api,) = [p for p in children if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline())]
        sidecars = [p.pid for p in children if "kvpool_sidecar" in " ".join(p.cmdline())]
        (core,) = [p for p in api.children() if p.children()]  # the resource tracker has none
        (worker,) = [p for p in core.children() if "spawn_main" in " ".join(p.cmdline())]
        saves = [p.pid for p in worker.children() if "kvpool_connector.save_process" in " ".join(p.cmdline())]
        return cls(api.pid, worker.pid, sidecars[0] if sidecars else None, saves[0] if saves else None)

    def sample(self) -> dict[str, int]:
        """Nanoseconds so far, by role."""
        return {
            WORKER_OTHERS: _process_ns(self.worker) - _schedstat_ns(self.worker, self.worker),
            SAVE_THREAD: _process_ns(self.worker, named="kvpool-save"),
            SAVE_PROCESS: _process_ns(self.save_process) if self.save_process is not None else 0,
            SIDECAR: _process_ns(self.sidecar) if self.sidecar is not None else 0,
            API_SERVER: _process_ns(self.api_server),
            FORWARD_WAITED: _schedstat_ns(self.worker, self.worker, WAITED),
        }


def spent(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """Milliseconds by role between two samples."""
    return {role: (after[role] - before[role]) / 1e6 for role in ROLES}
