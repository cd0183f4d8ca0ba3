"""Keeps kvpool's threads off the cores vLLM's forward is bound to."""

from __future__ import annotations

import contextlib
import os


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
