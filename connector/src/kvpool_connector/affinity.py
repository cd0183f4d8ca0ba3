"""Keeps kvpool's threads off the cores vLLM's forward is bound to and out of its OpenMP team, its
save thread behind vLLM's own threads for the CPU, and names them where the OS shows threads."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import threading

from .logs import connector_logger

log = connector_logger(__name__)

# How far below vLLM's threads the save thread runs: nice(1)'s default. Measured with bench opt_out:
# it cut kvpool's no-reuse TTFT outside the forwards at concurrency 2 from +2.4 to +1.4 ms a wave.
SAVE_NICENESS = 10
# prctl(2)'s option that names the calling thread (Linux's PR_SET_NAME); a name is at most 15 bytes
PR_SET_NAME = 15
# The OpenMP runtimes torch may have loaded (GNU's, Intel's, LLVM's), as /proc/self/maps names them.
_OPENMP = re.compile(r"/lib(gomp|iomp5|omp)[-.][^/]*$")


def side_thread() -> None:
    """Called first on each of kvpool's own threads (save, load, CUDA copies)."""
    off_compute_cores()
    one_openmp_thread()
    name_native_thread()


def name_native_thread(name: str | None = None) -> None:
    """Gives the calling thread's OS name its Python name (kvpool-save, kvpool-load_0, ...) or `name`,
    so that `top -H`, `ps -L` and /proc/<pid>/task/<tid>/comm tell kvpool's threads in a vLLM process
    from vLLM's own, all of which are "python" otherwise. Python 3.11 does not do it."""
    raw = (name or threading.current_thread().name).encode()[:15]
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the name stays as it is
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0)


def below_vllm(niceness: int = SAVE_NICENESS) -> None:
    """Lowers the calling thread's CPU priority by `niceness` (on Linux a thread has its own nice
    value). For the save thread: nothing in the step waits for its work, so where kvpool, vLLM's API
    server and its engine share busy cores (always on a CPU engine, whose forward keeps its own cores),
    theirs runs first and a save takes the time left. Without CAP_SYS_NICE it can never be raised
    back: a step that must wait for a save (a fence) waits with its own thread asleep, off the CPU."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)


def off_compute_cores() -> None:
    """Moves the calling thread off the cores the forward is bound to. A thread started from vLLM's
    thread inherits its affinity, which on a CPU engine is the compute cores alone
    (VLLM_CPU_OMP_THREADS_BIND), so kvpool's copies would take turns with the forward there instead
    of overlapping it. Where vLLM binds nothing (GPUs) there is nowhere else to go: unchanged."""
    mine = os.sched_getaffinity(0)
    others = set(range(os.cpu_count() or 1)) - mine
    if others:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, others)


def one_openmp_thread() -> None:
    """Makes the calling thread's torch calls run on it alone. A new thread takes torch's thread count,
    which a CPU engine sets to its compute cores, so each copy of more than a few KiB would start an
    OpenMP team that large on the cores the thread was moved to: with two threads on one core a 4 MiB
    save took over 250 ms instead of about 1 (bench/save_interference_bench.py, part 1).
    torch.set_num_threads would change the count of every thread started after; OpenMP's own call
    changes this thread's alone."""
    import torch  # here: the save process moves itself off the forward's cores without torch

    if torch.get_num_threads() == 1:  # also torch's per-thread set-up, which would undo the call below
        return
    with open("/proc/self/maps") as maps:
        runtimes = sorted({line.split()[-1] for line in maps if _OPENMP.search(line.rstrip())})
    for path in runtimes:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(path).omp_set_num_threads(1)
    if torch.get_num_threads() != 1:
        log.warning(
            "kvpool: cannot limit its copy thread to one OpenMP thread (runtimes found: %s); its copies "
            "start teams of %d threads beside the forward",
            runtimes or "none",
            torch.get_num_threads(),
        )
