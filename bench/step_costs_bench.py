"""What a step costs outside the model, in vLLM alone and in kvpool (#24): the fixed work a
connector adds to every step of every request, hit or miss, measured apart from the forward's
process-to-process spread.

SETS sets of a fresh vLLM alone, a fresh kvpool server and a fresh vLLM with a connector that does
nothing (null_connector.py: what vLLM's connector path costs any connector, so kvpool's own part is
the difference between the two), all up at once (start order rotated), sent the same released waves
of LEVEL unique 352-token prompts (first server rotating). All run
bench/phase_trace.py, which times in the engine's own processes each step's schedule() and
update_from_output() (engine core), the worker's execute_model() and the model's forward inside it.
Per step: the worker's time outside the model (input preparation, vLLM's connector calls and
kvpool's worker hooks, the hand-off of saves), schedule() (kvpool's build_connector_meta) and
update_from_output() (update_connector_output, the stats). Decode steps (a token a request) and
the steps that carry prompt tokens are counted apart. Medians over a set's steps, in microseconds;
each connector's difference from vLLM alone per set and the median of the sets. It also adds each
wave's steps up, from its release to its last token: the share of vLLM alone's wave that a
connector's work outside the model costs, which a comparison of whole servers cannot resolve at load
(bench processes); and each server's whole wave, with its time outside the engine's steps (the client,
the API server, the hand-offs between processes).
Run: `.venv/bin/python -m bench step_costs` (about 12 minutes on 2 cores); at a level:
`python -c "import bench.step_costs_bench as s; s.LEVEL=8; s.main()"`.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any
from unittest import mock

from bench.load_bench import ALONE, ENGINE_BLOCKS, FLOOR_BLOCKS, KVPOOL, unique_prompts
from bench.paired_bench import DEV_MODE, Wave, lockstep
from bench.phases_bench import trace_records, traced_servers
from bench.stats import load_note
from bench.workloads_bench import NULL, arms
from kvpool_demo.localrun import HUGE_PAGES
from kvpool_demo.tinymodel import BENCH, make_model

SERVERS = (ALONE, KVPOOL, NULL)
SETS = 4
WAVES = 30
LEVEL = 1  # requests a wave: a decode step schedules a token for each running one, LEVEL at most
PARTS = ("worker outside the model", "schedule()", "update_from_output()", "the model's forward")
KINDS = ("decode", "with prompt tokens")
Timed = tuple[float, int | None, str, float]  # a step's part: its start, the tokens scheduled, seconds


def kind(tokens: int | None) -> str:
    """A step's kind by the tokens it scheduled. A decode step has fewer than LEVEL tokens where a
    wave's requests finish in different steps, or wait for room in the engine's KV."""
    return "empty" if not tokens else "decode" if tokens <= LEVEL else "with prompt tokens"


def parts_timed(records: list[dict[str, Any]]) -> list[Timed]:
    """(start, tokens scheduled, part, seconds) for each part of each step, from one server's trace
    records (all its processes)."""
    out: list[Timed] = []
    models = sorted((r for r in records if r["phase"] == "model"), key=lambda r: r["t0"])
    for r in records:
        if r["phase"] == "forward":
            inside = [m for m in models if r["t0"] <= m["t0"] and m["t1"] <= r["t1"]]
            model = sum(m["t1"] - m["t0"] for m in inside)
            out.append((r["t0"], r.get("tokens"), PARTS[0], r["t1"] - r["t0"] - model))
            out.append((r["t0"], r.get("tokens"), PARTS[3], model))
    tokens = None  # update_from_output follows its step's schedule() in the engine core
    for r in sorted((r for r in records if r["phase"] in ("schedule", "update")), key=lambda r: r["t0"]):
        if r["phase"] == "schedule":
            tokens = r.get("tokens")
        out.append((r["t0"], tokens, PARTS[1] if r["phase"] == "schedule" else PARTS[2], r["t1"] - r["t0"]))
    return out


def step_parts(timed: list[Timed], waves: list[Wave], of: str) -> dict[str, list[float]]:
    """Each step's parts (seconds), for the steps of one kind run for the waves."""
    out: dict[str, list[float]] = {part: [] for part in PARTS}
    for t0, tokens, part, seconds in timed:
        if kind(tokens) == of and any(during(t0, w) for w in waves):
            out[part].append(seconds)
    return out


def in_a_wave(
    timed: list[Timed], waves: list[Wave], of: str | None = None, model: bool = False
) -> list[float]:
    """Each wave's time in its steps (seconds), from its release to its last token: the parts of its
    steps of one kind (or all), the model's forward only when `model`."""
    return [
        sum(
            t
            for t0, tokens, part, t in timed
            if (model or part != PARTS[3]) and of in (None, kind(tokens)) and during(t0, w)
        )
        for w in waves
    ]


def during(t0: float, wave: Wave) -> bool:
    return wave.released_at <= t0 <= wave.released_at + wave.seconds


def main() -> None:
    print(f"({load_note()})")
    model = make_model(Path(tempfile.gettempdir()) / "kvpool-models" / "bench-llama", BENCH)
    every = arms(model, ENGINE_BLOCKS, FLOOR_BLOCKS)
    # per set, in microseconds: each server's median of a part over the steps of a kind, its median
    # wave, a wave's median time outside the model and outside the engine's steps
    medians: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    walls: dict[str, list[float]] = defaultdict(list)
    outside: dict[str, list[float]] = defaultdict(list)
    between: dict[str, list[float]] = defaultdict(list)
    with (
        tempfile.TemporaryDirectory(prefix="kvpool-step-costs-", dir="/dev/shm") as d,
        mock.patch.dict(os.environ, {**DEV_MODE, **HUGE_PAGES}),
    ):
        for n in range(SETS):
            with traced_servers(every, Path(d), n, SERVERS) as (order, urls, traces):
                turns = unique_prompts(WAVES * LEVEL, seed=60_000 + 100 * (LEVEL - 1) + n)
                waves = lockstep(urls, turns, LEVEL)
            timed = {s: parts_timed(trace_records(traces[s])) for s in SERVERS}
            print(f"set {n} ({', '.join(order)}; waves of {LEVEL})", flush=True)
            for k in KINDS:
                steps = {s: step_parts(timed[s], waves[s], k) for s in SERVERS}
                print(f"  {k} steps ({len(steps[ALONE][PARTS[0]])} each), medians:", flush=True)
                for part in PARTS:
                    for s in SERVERS:
                        medians[s, k, part].append(1e6 * statistics.median(steps[s][part]))
                    print(
                        f"    {part}: " + ", ".join(f"{s} {medians[s, k, part][-1]:.0f} us" for s in SERVERS)
                    )
            for of in (None, *KINDS, "empty"):  # all steps, then by kind ("empty": scheduled nothing)
                us = {s: 1e6 * statistics.median(in_a_wave(timed[s], waves[s], of)) for s in SERVERS}
                if of is None:
                    for s in SERVERS:
                        outside[s].append(us[s])
                print(
                    f"  outside the model a wave, {of or 'all'} steps: "
                    + ", ".join(f"{s} {us[s]:.0f} us" for s in SERVERS)
                )
            for s in SERVERS:  # a wave from its release to its last token, in the engine's steps or not
                stepped = in_a_wave(timed[s], waves[s], model=True)
                rest = [w.seconds - t for w, t in zip(waves[s], stepped, strict=True)]
                walls[s].append(1e6 * statistics.median(w.seconds for w in waves[s]))
                between[s].append(1e6 * statistics.median(rest))
                print(f"  a wave: {s} {walls[s][-1] / 1e3:.1f} ms, outside its steps {between[s][-1]:.0f} us")
            print(f"  ({load_note()})", flush=True)
    # what vLLM charges any connector, what kvpool costs in all, and kvpool's own part of that
    for arm, base in ((NULL, ALONE), (KVPOOL, ALONE), (KVPOOL, NULL)):
        for k in KINDS:
            print(f"\nper {k} step, {arm} - {base} (median of {SETS} sets; the sets' range):")
            for part in PARTS:
                v = [x - b for x, b in zip(medians[arm, k, part], medians[base, k, part], strict=True)]
                print(f"  {part}: {statistics.median(v):+.0f} us ({min(v):+.0f} to {max(v):+.0f})")
        v = [100 * (x - b) / w for x, b, w in zip(outside[arm], outside[base], walls[ALONE], strict=True)]
        print(
            f"{arm} - {base}: work outside the model, as a share of vLLM alone's wave: "
            f"{statistics.median(v):+.2f}% ({min(v):+.2f}% to {max(v):+.2f}%)"
        )
        v = [100 * (x / b - 1) for x, b in zip(walls[arm], walls[base], strict=True)]
        print(f"{arm} / {base}: a whole wave {statistics.median(v):+.2f}% ({min(v):+.2f}% to {max(v):+.2f}%)")
        v = [x - b for x, b in zip(between[arm], between[base], strict=True)]
        print(f"  of it outside the steps: {statistics.median(v):+.0f} us ({min(v):+.0f} to {max(v):+.0f})")
