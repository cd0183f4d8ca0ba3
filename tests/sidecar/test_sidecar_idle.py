"""An idle sidecar process sleeps: it shares the pod's cores with vLLM, and a pool runs one beside
every vLLM pod."""

from __future__ import annotations

import time
from pathlib import Path

from kvtest import free_port, http_ok, start_sidecar


def _wakeups(pid: int) -> int:
    """Context switches of all the process's threads so far: each wake-up from a sleep is one."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        for line in status.read_text().splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                total += int(line.split()[1])
    return total


def test_an_idle_sidecar_does_not_wake_and_still_stops_at_sigterm(tmp_path) -> None:
    """uvicorn's own loop woke each server 10 times a second to poll for exit (and to refresh a Date
    header), about 0.2% of a core when idle. The window below is what is observed, not a wait for
    something: with the poll, a second holds about 10 wake-ups."""
    status_port = free_port()
    proc = start_sidecar(tmp_path, "1Mi", [], "--status-port", str(status_port))
    try:
        assert http_ok(f"http://127.0.0.1:{status_port}/healthz")  # both servers have served
        before = _wakeups(proc.popen.pid)
        time.sleep(1.0)
        assert _wakeups(proc.popen.pid) - before <= 2
    finally:
        proc.stop(timeout=10.0)  # SIGTERM; past the timeout it is killed, and the code says so
    assert proc.popen.returncode == 0, proc.output()
