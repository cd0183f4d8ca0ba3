"""kvpool against vLLM alone with no reuse, replicated over server processes (#24's 1% target).

bench paired found that two identical vLLM alone servers of one run differ by 5-7%, more than any
of its intervals: each arm there is one process, and which process a server happens to be is the
larger effect. Here the process is the unit of replication. SETS fresh sets of three servers
(vLLM alone, kvpool, a second vLLM alone), started in an order rotated from set to set; at each
level the same released waves (bench paired's) go to all three, in an order rotated from wave to
wave. Per set and level: kvpool's median wave ratio against each of the two vLLM alone servers
(their geometric mean), and the control, the second vLLM alone against the first. Across the sets:
the geometric mean of the sets' figures, and a 95% bootstrap interval that resamples the sets.

A server that runs right after kvpool may meet kvpool's saves still running on the other core. Set n
starts its servers, and rotates its waves, in the n-th of the six orders of the three: within a set
one vLLM alone follows kvpool twice as often as the other, and over six sets each does equally often
(stop 46's run rotated one order, so the second vLLM alone followed kvpool in two waves of three).

Every server runs on huge pages (HUGE_PAGES, the same in every arm): with 4 KiB pages, which
physical pages a process got may set how its weights share the caches. In paired-servers.txt huge
pages made identical servers about 5% faster at concurrency 4; whether they narrow the spread between
servers is not settled.

Unique 352-token prompts with 8-token answers, temperature 0, token ids compared.
What vLLM charges any connector, and what kvpool adds to it: set SERVERS to (ALONE, KVPOOL, NULL),
the third server then running a connector that does nothing (null_connector.py).
Run: `.venv/bin/python -m bench processes` (about 55 minutes on 2 cores); writes
bench/results/processes.json (OUT) after each set. Runs saved apart pool into one table, each of
their sets one set: `python -c "import bench.processes_bench as p; p.pooled(['a.json', 'b.json'])"`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any
from unittest import mock

from bench.load_bench import ALONE, ENGINE_BLOCKS, FLOOR_BLOCKS, KVPOOL, LEVELS, Request, unique_prompts
from bench.paired_bench import ALONE_2, DEV_MODE, Wave, lockstep, out_tokens_per_s, start_servers, wave_ratios
from bench.stats import bootstrap, geomean, load_note
from bench.workloads_bench import NULL, RESULTS, arms
from kvpool_demo.localrun import HUGE_PAGES
from kvpool_demo.tinymodel import BENCH, make_model

WAVES = {1: 16, 2: 8, 4: 6, 8: 4}
# The third server: a second vLLM alone (the control), or NULL, vLLM with a connector that does nothing
# (then kvpool / NULL is kvpool's own cost, NULL / vLLM alone what vLLM charges any connector).
SERVERS = (ALONE, KVPOOL, ALONE_2)
SETS = 6  # set n starts in the n-th of the six orders: each server starts first, and follows kvpool, alike
# Every request, rewritten whole after each set: a run stopped early keeps the sets it finished. Set
# it to another name (as LEVELS and SETS) to keep an earlier run's.
OUT = RESULTS / "processes.json"


def median_ratio(base: list[Wave], arm: list[Wave]) -> float:
    return statistics.median(wave_ratios(base, arm))


def tokens_ratio(base: list[Wave], arm: list[Wave]) -> float:
    return out_tokens_per_s(arm) / out_tokens_per_s(base)


def set_figures(waves: dict[str, list[Wave]]) -> dict[str, float]:
    """One set's figures at one level. With a second vLLM alone: kvpool against both vLLM alone
    servers (the geometric mean of its ratios against each), and the control, the second vLLM alone
    against the first. With the null connector: kvpool and it against vLLM alone, kvpool against it."""
    a, k = waves[ALONE], waves[KVPOOL]
    if ALONE_2 in waves:
        a2 = waves[ALONE_2]
        return {
            "kvpool TTFT": geomean([median_ratio(a, k), median_ratio(a2, k)]),
            "control TTFT": median_ratio(a, a2),
            "kvpool out tok/s": geomean([tokens_ratio(a, k), tokens_ratio(a2, k)]),
            "control out tok/s": tokens_ratio(a, a2),
        }
    z = waves[NULL]
    return {
        "kvpool TTFT": median_ratio(a, k),
        "null connector TTFT": median_ratio(a, z),
        "kvpool / null connector TTFT": median_ratio(z, k),
        "kvpool out tok/s": tokens_ratio(a, k),
        "null connector out tok/s": tokens_ratio(a, z),
        "kvpool / null connector out tok/s": tokens_ratio(z, k),
    }


def agreement(waves: dict[str, list[Wave]]) -> tuple[int, int, int]:
    """(requests whose ids all three servers agree on, waves all three ran in the same steps, waves)."""
    ids = [[r.output for w in ws for r in w.requests] for ws in waves.values()]
    same_ids = sum(len({tuple(x) for x in t}) == 1 for t in zip(*ids, strict=True))
    steps = zip(*([w.steps() for w in ws] for ws in waves.values()), strict=True)
    return same_ids, sum(len(set(t)) == 1 for t in steps), len(waves[ALONE])


def across(sets: list[float]) -> str:
    low, high = bootstrap(sets, geomean)
    return f"{geomean(sets):.3f} ({low:.3f}-{high:.3f}) [{', '.join(f'{x:.3f}' for x in sets)}]"


def waves_of(record: dict[str, Any], server: str) -> list[Wave]:
    return [Wave([Request(**r) for r in w["requests"]], w["seconds"]) for w in record[server]]


def summarize(runs: list[list[dict[str, Any]]]) -> None:
    """The table across every set of every run (each run's records as main() writes them): a set is
    one set of fresh servers, so runs of the same code pool into more sets."""
    levels = sorted({r["level"] for run in runs for r in run})
    sets = sum(len({r["set"] for r in run}) for run in runs)
    print(f"No reuse over {sets} sets of fresh servers: geometric mean (95% interval over sets) [each set]")
    print("| concurrency | figure | across the sets |\n| --- | --- | --- |")
    for level in levels:
        records = [r for run in runs for r in run if r["level"] == level]
        at = [{s: waves_of(r, s) for s in r if s not in ("set", "level")} for r in records]
        figures = [set_figures(waves) for waves in at]
        for key in figures[0]:
            print(f"| {level} | {key} | {across([f[key] for f in figures])} |")
        same_ids, same_steps, waves_run = (sum(c) for c in zip(*map(agreement, at), strict=True))
        print(f"| {level} | same ids in all three | {same_ids}/{waves_run * level} |")
        print(f"| {level} | waves all three ran in the same steps | {same_steps}/{waves_run} |")


def pooled(paths: list[str]) -> None:
    """summarize() over runs saved apart, read from their JSON files."""
    summarize([json.loads(Path(path).read_text()) for path in paths])


def main() -> None:
    print(f"({load_note()})")
    model = make_model(Path(tempfile.gettempdir()) / "kvpool-models" / "bench-llama", BENCH)
    every = arms(model, ENGINE_BLOCKS, FLOOR_BLOCKS)
    results: list[dict[str, Any]] = []
    with mock.patch.dict(os.environ, {**DEV_MODE, **HUGE_PAGES}):
        orders = list(itertools.permutations(SERVERS))
        for n in range(SETS):
            order = orders[n % len(orders)]
            t0 = time.perf_counter()
            with (
                tempfile.TemporaryDirectory(prefix="kvpool-bench-", dir="/dev/shm") as d,
                contextlib.ExitStack() as stack,
            ):
                urls = start_servers(every, order, Path(d), stack)
                print(f"set {n}: started {', '.join(order)} ({load_note()})", flush=True)
                for level in LEVELS:
                    turns = unique_prompts(WAVES[level] * level, seed=20_000 + 100 * n + level)
                    waves = lockstep({s: urls[s] for s in order}, turns, level)
                    record = {s: [asdict(w) for w in waves[s]] for s in SERVERS}
                    results.append({"set": n, "level": level, **record})
                    shown = ", ".join(f"{k} {v:.3f}" for k, v in set_figures(waves).items())
                    counts = agreement(waves)
                    print(f"set {n} c={level}: {shown}; same ids, steps, waves {counts}", flush=True)
            OUT.parent.mkdir(exist_ok=True)
            tmp = OUT.with_suffix(".tmp")
            tmp.write_text(json.dumps(results))
            tmp.replace(OUT)
            print(f"set {n}: {time.perf_counter() - t0:.0f} s", flush=True)
    summarize([results])
