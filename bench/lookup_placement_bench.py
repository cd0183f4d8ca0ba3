"""What a lookup costs vLLM's engine core, by where the sidecar runs: on the engine core's CPU, as the
kernel places it on a 2-core host, or on a CPU of its own, as on a node with cores to spare.

The real vLLM v1 scheduler (tests/connector/schedkit.py: no model runs, the bench plays the worker)
with kvpool's connector and a real sidecar process. A wave is two unique 352-token prompts added at
once (add_request, where kvpool sends each one's lookup) and the step that schedules them
(schedule(), where kvpool reads the answers), after an idle gap. Waves alternate between kvpool on and
opted out (`kvpool.skip_load`/`skip_save`: no lookup), so each on wave has a baseline next to it; the
figure is the median of the pairs' differences, with a 95% bootstrap interval.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / p) for p in ("tests", "tests/connector")]
import schedkit as sk  # noqa: E402
from kvtest import start_sidecar  # noqa: E402

from bench.stats import bootstrap  # noqa: E402
from kvpool_demo.tinymodel import TINY, make_model  # noqa: E402

PAIRS = 300
PROMPT_TOKENS = 352
CHUNK = 256
IDLE_SECONDS = (0.002, 0.05)
OPT_OUT = {"kvpool.skip_load": True, "kvpool.skip_save": True}


def _place(sidecar_pid: int, apart: bool) -> None:
    """apart: this process on CPU 1, the sidecar's threads on CPU 0; else anywhere, as started."""
    everywhere = set(range(os.cpu_count() or 1))
    os.sched_setaffinity(0, {1} if apart else everywhere)
    for tid in os.listdir(f"/proc/{sidecar_pid}/task"):
        os.sched_setaffinity(int(tid), {0} if apart else everywhere)


def _waves(scheduler, idle: float, seed: int) -> dict[bool, list[tuple[float, float]]]:
    """(add_request, schedule()) in µs of each wave, by opted out."""
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for w in range(-20, 2 * PAIRS):  # the first 20 waves warm up
        opted_out = w % 2 == 1
        prompts = [sk.prompt(PROMPT_TOKENS, seed + 2 * w + i) for i in range(2)]
        params = OPT_OUT if opted_out else None
        reqs = [sk.make_request(p, max_tokens=1, kv_transfer_params=params) for p in prompts]
        t0 = time.perf_counter()
        for r in reqs:
            scheduler.add_request(r)
        t1 = time.perf_counter()
        so = scheduler.schedule()
        t2 = time.perf_counter()
        scheduler.update_from_output(so, sk.model_output(scheduler, so))
        while scheduler.has_unfinished_requests():
            so = scheduler.schedule()
            scheduler.update_from_output(so, sk.model_output(scheduler, so))
        if w >= 0:
            times[opted_out].append(((t1 - t0) * 1e6, (t2 - t1) * 1e6))
        time.sleep(idle)  # the gap being measured, not a wait for anything
    return times


def _row(label: str, on: list[float], out: list[float]) -> str:
    diffs = [a - b for a, b in zip(on, out, strict=True)]
    low, high = bootstrap(diffs, statistics.median)
    return (
        f"  {label:<34} on {statistics.median(on):7.0f}  opted out {statistics.median(out):6.0f}  "
        f"on minus opted out {statistics.median(diffs):+6.0f} µs ({low:+.0f} to {high:+.0f})"
    )


def main() -> None:
    if (os.cpu_count() or 1) < 2:
        print("needs two CPUs")
        return
    work = Path(tempfile.mkdtemp(prefix="kvpool-lookup-placement-"))
    sidecar = start_sidecar(work, "256Mi")
    try:
        model = make_model(Path(tempfile.gettempdir()) / "kvpool-models" / "tiny", TINY)
        scheduler = sk.make_scheduler(
            model, sidecar.info["url"], num_blocks=4000, batched=4096, prefix_caching=True, chunk_size=CHUNK
        )
        print(
            f"two unique {PROMPT_TOKENS}-token prompts a wave, block {sk.BS}, chunk {CHUNK}; {PAIRS} pairs "
            "of on and opted-out waves; µs a wave, median (95% interval of the pairs' median difference)"
        )
        for apart in (False, True):
            _place(sidecar.popen.pid, apart)
            for idle in IDLE_SECONDS:
                times = _waves(scheduler, idle, seed=int(idle * 1e4) + 100_000 * apart)
                where = "the sidecar on a CPU of its own" if apart else "placed by the kernel"
                print(f"{where}, {idle * 1e3:g} ms idle before each wave:")
                for i, phase in enumerate(("add_request() x2 (sends)", "schedule() (reads the answers)")):
                    print(_row(phase, [t[i] for t in times[False]], [t[i] for t in times[True]]))
                total = [sum(t) for t in times[False]], [sum(t) for t in times[True]]
                print(_row("both", *total))
    finally:
        _place(sidecar.popen.pid, apart=False)
        sidecar.stop()


if __name__ == "__main__":
    main()
