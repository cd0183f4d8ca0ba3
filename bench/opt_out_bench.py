"""What kvpool's work for a request costs with no reuse, measured inside one server process (#24).

Across server processes (bench processes) two identical vLLM alone servers differ by 1-1.5%, as much
as the 1% #24 asks about: which process a server happens to be outweighs kvpool. Here one kvpool
server (a real sidecar, the CPU tier) serves every arm, and only the requests differ:
- on: kvpool looks the request up and saves its chunks, as for any request;
- opted out: `kv_transfer_params: {"kvpool.skip_load": true, "kvpool.skip_save": true}`, so kvpool
  neither asks the sidecar nor saves;
- opted out again: the A/A control, the noise band of one process.
bench paired's released waves, a round being one wave of each arm in one of the six orders, the
orders cycling. Every wave has prompts of its own, of the same lengths in every arm (a prompt sent
twice would hit vLLM's prefix cache). After an on wave the next one waits until the sidecar holds
what it saved, so that no save runs into another arm's wave; how many had not landed by the wave's
end is counted. The sidecar's counters check each arm: an opted-out wave adds no lookup and no chunk.

What this leaves out is what the connector costs a step with no request work: its per-step calls
(tens of µs a step, bench phases) and an idle sidecar beside the engine. bench processes and bench
phases compare with vLLM alone for those.

Per level, pooled over SETS fresh servers: on / opted out and the control (opted out again / opted
out), as the median of the rounds' wave ratios of mean TTFT and as output tokens/s, with 95%
bootstrap intervals over the rounds. And the CPU time each wave took beside the forward, by role
(server_cpu.py: kvpool's save thread, the sidecar, the API server), as each arm's mean difference
from the opted-out waves. Unique 352-token prompts with 8-token answers, temperature 0.
Run: `.venv/bin/python -m bench opt_out` (about 22 minutes on 2 cores); writes
bench/results/opt-out.json.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from bench.load_bench import ENGINE_BLOCKS, request, unique_prompts
from bench.paired_bench import (
    DEV_MODE,
    Wave,
    cell,
    mean_ttft,
    out_tokens_per_s,
    ratio,
    released,
    wave_ratios,
)
from bench.server_cpu import ROLES, ServerProcesses, spent
from bench.stats import bootstrap, load_note
from bench.workloads_bench import BLOCK, CHUNK, RESULTS, bench_server
from kvpool_connector.config import load_config
from kvpool_connector.spans import prompt_spans
from kvpool_demo.localrun import HUGE_PAGES, kvpool_connector_spec, sidecar, sidecar_stats
from kvpool_demo.openai_driver import client
from kvpool_demo.tinymodel import BENCH, make_model
from kvpool_demo.workloads import Turn

ON, OFF, OFF_2 = "on", "opted out", "opted out again"
ARMS = (ON, OFF, OFF_2)
ORDERS = list(itertools.permutations(ARMS))
PARAMS: dict[str, dict[str, Any] | None] = {
    ON: None,
    OFF: {"kvpool.skip_load": True, "kvpool.skip_save": True},
    OFF_2: {"kvpool.skip_load": True, "kvpool.skip_save": True},
}
ROUNDS = {2: 30, 8: 10}  # the levels where bench processes finds kvpool below vLLM alone
SETS = 2
SAVE_DEADLINE_S = 60.0


def counts(url: str) -> tuple[int, int]:
    """(chunks the sidecar has taken, evicted ones included; keys it was asked for), from one read of
    its stats."""
    stats = sidecar_stats(url)
    return int(stats["chunks"]) + int(stats["evictions"]), int(stats["hits"]) + int(stats["misses"])


def chunks_saved(wave: list[Turn]) -> int:
    """How many chunks kvpool saves of `wave`'s prompts (their full chunks and block-aligned tails)."""
    cfg, _ = load_config({"sidecar_url": "http://unused", "chunk_size": CHUNK})
    return sum(len(prompt_spans(len(turn.prompt), cfg, BLOCK)) for turn in wave)


def wait_for_saves(url: str, target: int) -> bool:
    """Waits until the sidecar has taken `target` chunks in all; whether they had landed already."""
    if counts(url)[0] >= target:
        return True
    deadline = time.monotonic() + SAVE_DEADLINE_S
    while counts(url)[0] < target:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the sidecar took fewer than {target} chunks within {SAVE_DEADLINE_S} s")
        time.sleep(0.01)
    return False


@dataclass
class Level:
    """One level's waves of each arm, the CPU each took by role (ms), and how many on waves' saves had
    not all landed by the wave's end."""

    waves: dict[str, list[Wave]] = field(default_factory=lambda: {a: [] for a in ARMS})
    cpu: dict[str, list[dict[str, float]]] = field(default_factory=lambda: {a: [] for a in ARMS})
    spilled: int = 0

    def add(self, other: Level) -> None:
        for a in ARMS:
            self.waves[a] += other.waves[a]
            self.cpu[a] += other.cpu[a]
        self.spilled += other.spilled


def run_level(url: str, side: str, procs: ServerProcesses, level: int, seed: int) -> Level:
    """ROUNDS[level] rounds of waves at `level`. A wave's CPU is counted from its release to its last
    token: an on wave's saves land within it (Level.spilled counts those that did not)."""
    turns = unique_prompts(ROUNDS[level] * level * len(ARMS), seed=seed)
    waves = [turns[i : i + level] for i in range(0, len(turns), level)]
    apis = [client(url) for _ in range(level)]
    out = Level()
    with ThreadPoolExecutor(level) as pool:
        for r in range(ROUNDS[level]):
            for i, arm in enumerate(ORDERS[r % len(ORDERS)]):
                wave = waves[r * len(ARMS) + i]
                before = counts(side)
                start = procs.sample()
                out.waves[arm].append(released(url, apis, wave, pool, PARAMS[arm]))
                out.cpu[arm].append(spent(start, procs.sample()))
                if arm == ON:
                    out.spilled += not wait_for_saves(side, before[0] + chunks_saved(wave))
                elif counts(side) != before:
                    raise RuntimeError("an opted-out wave reached the sidecar: the opt-out did not hold")
    return out


def table(level: int, at: Level) -> list[str]:
    lines = []
    comparisons = (("on / opted out", OFF, ON), ("control: opted out again / opted out", OFF, OFF_2))
    for what, base, arm in comparisons:
        b, k = at.waves[base], at.waves[arm]
        per_wave = wave_ratios(b, k)
        low, high = bootstrap(per_wave, statistics.median)
        lines.append(
            f"| {level} | {what} | {len(k)} | {statistics.median(per_wave):.4f} ({low:.4f}-{high:.4f}) "
            f"| {cell(ratio(b, k, mean_ttft))} | {cell(ratio(b, k, out_tokens_per_s))} |"
        )
    spilled = f"on waves whose saves had not all landed at the wave's end | {at.spilled}"
    lines.append(f"| {level} | {spilled} | | | |")
    return lines


def cpu_table(level: int, at: Level) -> list[str]:
    """Per role: the opted-out waves' mean ms, and the mean paired difference of each arm from them."""
    lines = []
    for role in ROLES:
        base = [c[role] for c in at.cpu[OFF]]
        cells = []
        for arm in (ON, OFF_2):
            diffs = [c[role] - b for c, b in zip(at.cpu[arm], base, strict=True)]
            low, high = bootstrap(diffs, statistics.fmean)
            cells.append(f"{statistics.fmean(diffs):+.2f} ({low:+.2f} to {high:+.2f})")
        lines.append(f"| {level} | {role} | {statistics.fmean(base):.1f} | {cells[0]} | {cells[1]} |")
    return lines


HEAD = [
    "| concurrency | arm / baseline | waves | median of the waves' TTFT ratios | mean TTFT | out tok/s |",
    "| --- " * 6 + "|",
]
CPU_HEAD = [
    "| concurrency | CPU time, ms a wave | opted out | on - opted out | control: again - opted out |",
    "| --- " * 5 + "|",
]


def main() -> None:
    print(f"({load_note()})")
    model = make_model(Path(tempfile.gettempdir()) / "kvpool-models" / "bench-llama", BENCH)
    pooled = {lv: Level() for lv in ROUNDS}
    records: list[dict[str, Any]] = []
    with mock.patch.dict(os.environ, {**DEV_MODE, **HUGE_PAGES}):
        for n in range(SETS):
            with (
                tempfile.TemporaryDirectory(prefix="kvpool-bench-", dir="/dev/shm") as d,
                contextlib.ExitStack() as stack,
            ):
                side = stack.enter_context(sidecar(Path(d) / "sidecar", "2Gi"))
                spec = kvpool_connector_spec(side, CHUNK)
                url = stack.enter_context(
                    bench_server(model, Path(d) / "vllm.log", ENGINE_BLOCKS, connector=spec)
                )
                request(client(url), unique_prompts(1, seed=99)[0])  # warm-up
                procs = ServerProcesses.find()
                print(f"set {n}: server up ({load_note()})", flush=True)
                for level in ROUNDS:
                    t0 = time.perf_counter()
                    at = run_level(url, side, procs, level, seed=30_000 + 100 * n + level)
                    waves = {a: [asdict(w) for w in at.waves[a]] for a in ARMS}
                    records.append({"set": n, "level": level, "cpu": at.cpu, **waves})
                    pooled[level].add(at)
                    shown = "\n".join(table(level, at) + cpu_table(level, at))
                    print(shown, f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "opt-out.json").write_text(json.dumps(records))
    print(f"\nPooled over {SETS} sets, 95% intervals over the rounds ({load_note()}):")
    print("\n".join([*HEAD, *(line for lv in ROUNDS for line in table(lv, pooled[lv]))]))
    print("\nCPU time by role, ms a wave: the opted-out waves' mean, and each arm's mean difference from it")
    print("\n".join([*CPU_HEAD, *(line for lv in ROUNDS for line in cpu_table(lv, pooled[lv]))]))
