"""Where the time of a no-reuse wave goes, phase by phase, in vLLM alone and in kvpool (#24): which
part of kvpool's cost is its own work (lookups, scheduling, saves) and which is the forward.

bench processes measures kvpool's no-reuse cost at the client; its ratios mix kvpool's work with the
speed of the process that runs the forward, which differs by several percent between identical servers.
Here both servers run bench/phase_trace.py, which times each engine phase in the engine's own
processes, so kvpool's work outside the forward is measured apart from the forward it waits on.

SETS sets of a fresh vLLM alone and a fresh kvpool server (start order alternating), each sent the
same released waves of unique 352-token prompts at each level (first server alternating). Per wave,
split at the wave's first token (client side): the forwards before it, and the rest of the TTFT (the
resume call, schedule(), kvpool's lookups in it, the hand-over to the worker and back, the output to
the client); then the decode to the last token, split the same way. Mean milliseconds per wave.
Run: `.venv/bin/python -m bench phases` (about 20 minutes on 2 cores).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from bench.load_bench import ALONE, ENGINE_BLOCKS, FLOOR_BLOCKS, KVPOOL, unique_prompts
from bench.paired_bench import DEV_MODE, Wave, engine_call, lockstep, start_servers
from bench.phase_trace import server_env
from bench.stats import load_note
from bench.workloads_bench import arms
from kvpool_demo.localrun import HUGE_PAGES
from kvpool_demo.tinymodel import BENCH, make_model

SETS = 4
WAVES = {2: 12, 8: 4}
SERVERS = (ALONE, KVPOOL)


def trace_records(where: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for f in sorted(where.glob("*.jsonl")) for line in f.read_text().splitlines()]


@contextlib.contextmanager
def traced_servers(
    every: dict[str, Any], work: Path, n: int, servers: tuple[str, ...] = SERVERS
) -> Iterator[tuple[tuple[str, ...], dict[str, str], dict[str, Path]]]:
    """Set n's fresh servers (by default vLLM alone and kvpool; start order rotated by n), all traced:
    yields the order, their URLs and the folder each one's records go to; all written once the block
    ends."""
    order = servers[n % len(servers) :] + servers[: n % len(servers)]
    traces = {s: work / f"set{n}" / f"trace{i}" for i, s in enumerate(servers)}
    for where in traces.values():
        where.mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        envs = {s: server_env(work / "plugin", traces[s]) for s in servers}
        urls = start_servers(every, order, work / f"set{n}", stack, envs.__getitem__)
        yield order, urls, traces
        for url in urls.values():  # the engine core writes its records at a pause
            engine_call(url, "/pause?mode=keep&clear_cache=false")
            engine_call(url, "/resume")


def phases(wave: Wave, records: list[dict[str, Any]]) -> dict[str, float]:
    """One wave's phases (milliseconds) from its server's trace records."""
    start, first = wave.released_at, wave.released_at + min(r.ttft for r in wave.requests)
    end = wave.released_at + wave.seconds
    during = [r for r in records if start <= r["t0"] <= end]

    def total(phase: str, before: bool) -> float:
        return sum(r["t1"] - r["t0"] for r in during if r["phase"] == phase and (r["t1"] <= first) == before)

    ttft, decode = first - start, end - first
    forwards, later = total("forward", True), total("forward", False)
    out = {
        "TTFT": ttft,
        "TTFT: forwards": forwards,
        "TTFT: the rest": ttft - forwards,
        "TTFT: the rest: schedule()": total("schedule", True),
        "TTFT: the rest: kvpool's lookups": total("lookup", True),
        "TTFT: the rest: add_request() (kvpool sends its lookup)": total("add", True),
        "TTFT: the rest: update_from_output()": total("update", True),
        "decode (first to last token)": decode,
        "decode: forwards": later,
        "decode: the rest": decode - later,
        "decode: the rest: schedule()": total("schedule", False),
        "decode: the rest: update_from_output()": total("update", False),
        "saves (kvpool's save thread, beside the forwards)": sum(
            r["t1"] - r["t0"] for r in during if r["phase"] == "save"
        ),
    }
    return {k: 1000 * v for k, v in out.items()}


def set_figures(got: dict[str, list[dict[str, float]]]) -> dict[str, str]:
    """One set's kvpool over vLLM alone: the forwards' ratios before and after the first token (the
    processes the two servers got), and kvpool's extra milliseconds a wave outside the forwards (its
    own work)."""
    a, k = ({p: sum(w[p] for w in got[s]) / len(got[s]) for p in got[s][0]} for s in SERVERS)
    return {
        "TTFT forwards ratio": f"{k['TTFT: forwards'] / a['TTFT: forwards']:.3f}",
        "decode forwards ratio": f"{k['decode: forwards'] / a['decode: forwards']:.3f}",
        "rest of TTFT": f"{k['TTFT: the rest'] - a['TTFT: the rest']:+.1f} ms",
        "rest of decode": f"{k['decode: the rest'] - a['decode: the rest']:+.1f} ms",
    }


def table(rows: dict[str, dict[str, list[float]]]) -> list[str]:
    """rows[arm][phase]: per-wave milliseconds; the mean per wave of each arm and kvpool's difference."""
    lines = [
        "| phase (ms per wave, mean) | vLLM alone | kvpool | kvpool - vLLM alone |",
        "| --- | --- | --- | --- |",
    ]
    for phase in rows[ALONE]:
        a, k = (statistics.fmean(rows[s][phase]) for s in SERVERS)
        lines.append(f"| {phase} | {a:.2f} | {k:.2f} | {k - a:+.2f} |")
    return lines


def main() -> None:
    print(f"({load_note()})")
    model = make_model(Path(tempfile.gettempdir()) / "kvpool-models" / "bench-llama", BENCH)
    every = arms(model, ENGINE_BLOCKS, FLOOR_BLOCKS)
    rows: dict[int, dict[str, dict[str, list[float]]]] = {
        lv: {s: defaultdict(list) for s in SERVERS} for lv in WAVES
    }
    with (
        tempfile.TemporaryDirectory(prefix="kvpool-phases-", dir="/dev/shm") as d,
        mock.patch.dict(os.environ, {**DEV_MODE, **HUGE_PAGES}),
    ):
        for n in range(SETS):
            with traced_servers(every, Path(d), n) as (order, urls, traces):
                waves = {
                    lv: lockstep(urls, unique_prompts(nw * lv, seed=50_000 + 100 * n + lv), lv)
                    for lv, nw in WAVES.items()
                }
            print(f"set {n} ({', '.join(order)}) ({load_note()})", flush=True)
            records = {s: trace_records(traces[s]) for s in SERVERS}
            for lv, by_server in waves.items():
                got = {s: [phases(w, records[s]) for w in by_server[s]] for s in SERVERS}
                for s in SERVERS:
                    for wave_phases in got[s]:
                        for phase, ms in wave_phases.items():
                            rows[lv][s][phase].append(ms)
                print(
                    f"  c={lv}: " + ", ".join(f"{k} {v}" for k, v in set_figures(got).items()),
                    flush=True,
                )
    for lv, per_arm in rows.items():
        print(f"\nconcurrency {lv}: {SETS} sets, {WAVES[lv]} waves a set")
        print("\n".join(table(per_arm)))
