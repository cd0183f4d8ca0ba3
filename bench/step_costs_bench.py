"""What a decode step costs outside the model, in vLLM alone and in kvpool (#24): the fixed work a
connector adds to every step of every request, hit or miss, measured apart from the forward's
process-to-process spread.

SETS sets of a fresh vLLM alone and a fresh kvpool server, both up at once (start order alternating),
sent the same released waves of one unique 352-token prompt (first server alternating). Both run
bench/phase_trace.py, which times in the engine's own processes each step's schedule() and
update_from_output() (engine core), the worker's execute_model() and the model's forward inside it.
Per decode step (one token scheduled): the worker's time outside the model (input preparation,
vLLM's connector calls and kvpool's worker hooks), schedule() (kvpool's build_connector_meta) and
update_from_output() (update_connector_output, the stats). Medians over a set's steps, in
microseconds; kvpool's difference per set and the median of the sets.
Run: `.venv/bin/python -m bench step_costs` (about 10 minutes on 2 cores).
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

from bench.load_bench import ALONE, ENGINE_BLOCKS, FLOOR_BLOCKS, unique_prompts
from bench.paired_bench import DEV_MODE, lockstep
from bench.phases_bench import SERVERS, trace_records, traced_pair
from bench.stats import load_note
from bench.workloads_bench import arms
from kvpool_demo.localrun import HUGE_PAGES
from kvpool_demo.tinymodel import BENCH, make_model

SETS = 4
WAVES = 30
PARTS = ("worker outside the model", "schedule()", "update_from_output()", "the model's forward")


def decode_steps(records: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each decode step's parts (seconds) from one server's trace records (all its processes)."""
    out: dict[str, list[float]] = {part: [] for part in PARTS}
    models = sorted((r for r in records if r["phase"] == "model"), key=lambda r: r["t0"])
    for r in records:
        if r["phase"] == "forward" and r.get("tokens") == 1:
            inside = [m for m in models if r["t0"] <= m["t0"] and m["t1"] <= r["t1"]]
            model = sum(m["t1"] - m["t0"] for m in inside)
            out["worker outside the model"].append(r["t1"] - r["t0"] - model)
            out["the model's forward"].append(model)
    tokens = None  # update_from_output follows its step's schedule() in the engine core
    for r in sorted((r for r in records if r["phase"] in ("schedule", "update")), key=lambda r: r["t0"]):
        if r["phase"] == "schedule":
            tokens = r.get("tokens")
            if tokens == 1:
                out["schedule()"].append(r["t1"] - r["t0"])
        elif tokens == 1:
            out["update_from_output()"].append(r["t1"] - r["t0"])
    return out


def main() -> None:
    print(f"({load_note()})")
    model = make_model(Path(tempfile.gettempdir()) / "kvpool-models" / "bench-llama", BENCH)
    every = arms(model, ENGINE_BLOCKS, FLOOR_BLOCKS)
    deltas: dict[str, list[float]] = {part: [] for part in PARTS}
    with (
        tempfile.TemporaryDirectory(prefix="kvpool-step-costs-", dir="/dev/shm") as d,
        mock.patch.dict(os.environ, {**DEV_MODE, **HUGE_PAGES}),
    ):
        for n in range(SETS):
            with traced_pair(every, Path(d), n) as (order, urls, traces):
                lockstep(urls, unique_prompts(WAVES, seed=60_000 + n), 1)
            steps = {s: decode_steps(trace_records(traces[s])) for s in SERVERS}
            counted = len(steps[ALONE][PARTS[0]])
            print(f"set {n} ({', '.join(order)}; {counted} decode steps each)", flush=True)
            for part in PARTS:
                a, k = (1e6 * statistics.median(steps[s][part]) for s in SERVERS)
                deltas[part].append(k - a)
                print(f"  {part}: vLLM alone {a:.0f} us, kvpool {k:.0f} us, kvpool - alone {k - a:+.0f} us")
            print(f"  ({load_note()})", flush=True)
    print(f"\nper decode step, kvpool - vLLM alone (median of {SETS} sets; the sets' range):")
    for part in PARTS:
        v = deltas[part]
        print(f"  {part}: {statistics.median(v):+.0f} us ({min(v):+.0f} to {max(v):+.0f})")
