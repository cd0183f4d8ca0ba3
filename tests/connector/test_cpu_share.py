"""The copy threads a CUDA worker starts by default: half of its share of the CPUs its container may
use, read from the process's cgroup (a Kubernetes CPU limit is a quota: the affinity shows the node).
The last test puts a real process in a real cgroup with a quota."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from kvtest import need

from kvpool_connector.cpu_share import MAX_COPY_THREADS, cgroup_cpus, default_copy_threads


def _write(path: Path, **files: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name.replace("cpu_", "cpu.", 1)).write_text(text)


def test_a_v1_quota_is_read_from_the_process_cgroup(tmp_path: Path) -> None:
    own = tmp_path / "cpu,cpuacct" / "kubepods" / "pod1" / "c1"
    _write(own, cpu_cfs_quota_us="150000\n", cpu_cfs_period_us="100000\n")
    _write(tmp_path / "cpu,cpuacct", cpu_cfs_quota_us="-1\n", cpu_cfs_period_us="100000\n")
    text = "12:memory:/kubepods/pod1/c1\n4:cpu,cpuacct:/kubepods/pod1/c1\n0::/\n"
    assert cgroup_cpus(text, tmp_path) == 1.5


def test_a_container_reads_its_own_cgroup_at_the_mount_root(tmp_path: Path) -> None:
    """In a container, /proc/self/cgroup names the host's path; the mount shows the container's own."""
    _write(tmp_path / "cpu", cpu_cfs_quota_us="400000\n", cpu_cfs_period_us="100000\n")
    assert cgroup_cpus("3:cpu:/kubepods/burstable/pod9/abc\n", tmp_path) == 4.0


def test_no_quota_or_no_cgroup_means_no_limit(tmp_path: Path) -> None:
    _write(tmp_path / "cpu", cpu_cfs_quota_us="-1\n", cpu_cfs_period_us="100000\n")
    assert cgroup_cpus("3:cpu:/\n", tmp_path) is None
    assert cgroup_cpus("3:cpu:/\n", tmp_path / "missing") is None
    assert cgroup_cpus("not a cgroup line", tmp_path) is None
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpus("0::/\n", tmp_path / "v2") is None


def test_a_v2_quota_is_read_from_cpu_max(tmp_path: Path) -> None:
    own = tmp_path / "kubepods.slice" / "pod.slice" / "cri-abc.scope"
    own.mkdir(parents=True)
    (own / "cpu.max").write_text("250000 100000\n")
    assert cgroup_cpus("0::/kubepods.slice/pod.slice/cri-abc.scope\n", tmp_path) == 2.5


def test_a_hybrid_host_reads_the_v1_cpu_controller(tmp_path: Path) -> None:
    """cgroup v1 controllers with the unified hierarchy mounted beside them (this machine's layout)."""
    _write(tmp_path / "cpu", cpu_cfs_quota_us="200000\n", cpu_cfs_period_us="100000\n")
    (tmp_path / "unified").mkdir()
    assert cgroup_cpus("2:cpuacct:/\n1:cpu:/\n0::/\n", tmp_path) == 2.0


@pytest.mark.parametrize(
    ("workers", "cpus", "threads"),
    [
        (1, 16, 8),  # the H100 machine of BENCHMARKS.md: what was measured best
        (1, 64, MAX_COPY_THREADS),  # more threads moved no more
        (8, 64, 4),  # eight GPU workers share the container's CPUs
        (1, 4, 2),  # a pod limited to 4 CPUs: half for the engine
        (1, 1.5, 1),
        (0, 6, 3),  # no GPU seen: one worker
    ],
)
def test_the_default_is_half_of_a_workers_share(workers: int, cpus: float, threads: int) -> None:
    assert default_copy_threads(workers, cpus) == threads


def _real_cgroup() -> tuple[Path, Path, str]:
    """(this host's cgroup root for the cpu controller, a new cgroup there, its quota file's content):
    cgroup v1 (this machine, CI) or v2."""
    v1 = Path("/sys/fs/cgroup/cpu")
    name = f"kvpool-test-{uuid.uuid4().hex[:8]}"
    if (v1 / "cpu.cfs_quota_us").exists():
        return v1, v1 / name, "150000"
    return Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup") / name, "150000 100000"


def test_a_process_in_a_cgroup_with_a_quota_gets_its_share() -> None:
    root, group, quota = _real_cgroup()
    need(os.geteuid() == 0 and os.access(root, os.W_OK), "root and a writable cgroup hierarchy")
    group.mkdir()
    try:
        if (group / "cpu.cfs_quota_us").exists():
            (group / "cpu.cfs_quota_us").write_text(quota)
            (group / "cpu.cfs_period_us").write_text("100000")
        else:
            (root / "cgroup.subtree_control").write_text("+cpu")
            (group / "cpu.max").write_text(quota)
        probe = (
            "import os, sys\n"
            f"open({str(group / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
            "from kvpool_connector.cpu_share import cgroup_cpus, default_copy_threads, usable_cpus\n"
            "print(cgroup_cpus(), usable_cpus(), default_copy_threads(1))\n"
        )
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        seen_quota, usable, threads = out.stdout.split()
        assert float(seen_quota) == 1.5
        assert float(usable) == min(1.5, len(os.sched_getaffinity(0)))
        assert int(threads) == 1  # 1.5 CPUs: one copy thread, not the 8 a whole H100 host gets
    finally:
        group.rmdir()  # the probe has exited: the cgroup is empty
