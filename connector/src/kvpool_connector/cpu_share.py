"""How many copy threads a CUDA worker starts when the config names none: half of its share of the CPUs
its container may use, so that moving chunks never throttles the engine under its CPU limit.

The CPUs are the fewer of the process's affinity and its cgroup's CPU quota (a Kubernetes CPU limit
is a quota, not an affinity: `os.cpu_count()` sees the whole node). The share is among the GPU
workers of the container (one per GPU it sees).
"""

from __future__ import annotations

import os
from pathlib import Path

# On the H100 host 12 threads moved no more than 8 (BENCHMARKS.md, #26).
MAX_COPY_THREADS = 8


def _cgroup_dirs(proc_cgroup: str, root: Path) -> list[tuple[Path, bool]]:
    """(directory, is v1) where this process's CPU controller may be: its own cgroup, then the
    mount's root (a container sees its own cgroup there, whatever /proc/self/cgroup names)."""
    v2 = None
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):  # v1 (also on a hybrid host, where 0:: has no cpu controller)
            base = root / controllers
            return [(base / path.lstrip("/"), True), (base, True)]
        if controllers == "":
            v2 = path
    if v2 is None:
        return []
    return [(root / v2.lstrip("/"), False), (root, False)]


def cgroup_cpus(proc_cgroup: str | None = None, root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPUs this process's cgroup quota allows; None when it sets none or cannot be read."""
    try:
        text = proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text()
        dirs = _cgroup_dirs(text, root)
    except (OSError, ValueError):
        return None
    for directory, v1 in dirs:
        try:
            if v1:
                quota = int((directory / "cpu.cfs_quota_us").read_text())
                period = int((directory / "cpu.cfs_period_us").read_text())
            else:
                limit, per = (directory / "cpu.max").read_text().split()[:2]
                if limit == "max":
                    return None
                quota, period = int(limit), int(per)
        except (OSError, ValueError):
            continue
        return quota / period if quota > 0 and period > 0 else None
    return None


def usable_cpus() -> float:
    """The CPUs this process may run on: its affinity, or fewer where its cgroup's quota says so."""
    cpus = float(len(os.sched_getaffinity(0)))
    quota = cgroup_cpus()
    return cpus if quota is None else min(cpus, quota)


def default_copy_threads(workers: int, cpus: float | None = None) -> int:
    """Half of one worker's share of the CPUs (the other half is the engine's), 1 to MAX_COPY_THREADS.
    workers: the GPU workers sharing the container's CPUs; cpus: usable_cpus() when None."""
    cpus = usable_cpus() if cpus is None else cpus
    return max(1, min(MAX_COPY_THREADS, int(cpus / max(1, workers) / 2)))
