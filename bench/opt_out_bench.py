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

Each wave is also split into its phases in the engine's own processes (bench/phase_trace.py, as in
bench phases): the forwards before and after its first token and the rest (schedule(), kvpool's
lookups, the hand-overs, the output). bench phases compares two server processes, whose forwards
differ by the process each happens to be; here the forwards of on and opted-out waves run in the same
process, in steps of the same shapes, so their ratio is what kvpool's saves and lookups cost the
forward itself. Step by step (a wave's first STEPS_SHOWN forwards, each over its opted-out twin's), it
shows which forwards the saves slow: those they run beside.

What this leaves out is what the connector costs a step with no request work: its per-step calls
(tens of µs a step, bench phases) and an idle sidecar beside the engine. bench processes and bench
phases compare with vLLM alone for those.

Per level, pooled over SETS fresh servers: on / opted out and the control (opted out again / opted
out), as the median of the rounds' wave ratios of mean TTFT and as output tokens/s, with 95%
bootstrap intervals over the rounds. The phases as each arm's mean difference from the opted-out
waves, the forwards as a ratio, wave by wave and step by step. And the CPU time each wave took
beside the forward, by role (server_cpu.py: kvpool's save thread, the sidecar, the API server), as
each arm's mean difference from the opted-out waves. Unique 352-token prompts with 8-token answers,
temperature 0.
Run: `.venv/bin/python -m bench opt_out` (about 22 minutes on the 2-core VM of 2026-11-28, 10 on the
faster one of 2026-11-29); writes bench/results/opt-out.json.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
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
    engine_call,
    mean_ttft,
    out_tokens_per_s,
    ratio,
    released,
    wave_ratios,
)
from bench.phase_trace import server_env
from bench.phases_bench import phases, trace_records
from bench.server_cpu import ROLES, ServerProcesses, spent
from bench.stats import bootstrap, load_note
from bench.workloads_bench import BLOCK, CHUNK, RESULTS, bench_server
from kvpool_connector.config import load_config
from kvpool_connector.spans import prompt_spans
from kvpool_demo.localrun import HUGE_PAGES, kvpool_connector_spec, sidecar, sidecar_stats
from kvpool_demo.openai_driver import client
from kvpool_demo.tinymodel import BENCH, ModelShape, make_model
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
STEPS_SHOWN = 4  # a wave's first forwards: its prefills and the decodes beside their saves


def counts(url: str) -> tuple[int, int]:
    """(chunks the sidecar has taken, evicted ones included; keys it was asked for), from one read of
    its stats."""
    stats = sidecar_stats(url)
    return int(stats["chunks"]) + int(stats["evictions"]), int(stats["hits"]) + int(stats["misses"])


def chunks_saved(wave: list[Turn], groups: int) -> int:
    """How many chunks kvpool saves of `wave`'s prompts (their full chunks and block-aligned tails),
    each once per KV cache group (a hybrid model's windowed layers store their part apart)."""
    cfg, _ = load_config({"sidecar_url": "http://unused", "chunk_size": CHUNK})
    return groups * sum(len(prompt_spans(len(turn.prompt), cfg, BLOCK)) for turn in wave)


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


FORWARDS = "the forwards (TTFT and decode)"


def _with_forwards(got: dict[str, float]) -> dict[str, float]:
    return {**got, FORWARDS: got["TTFT: forwards"] + got["decode: forwards"]}


@dataclass
class Level:
    """One level's waves of each arm, the CPU each took by role and its phases (ms), and how many on
    waves' saves had not all landed by the wave's end."""

    waves: dict[str, list[Wave]] = field(default_factory=lambda: {a: [] for a in ARMS})
    cpu: dict[str, list[dict[str, float]]] = field(default_factory=lambda: {a: [] for a in ARMS})
    phases: dict[str, list[dict[str, float]]] = field(default_factory=lambda: {a: [] for a in ARMS})
    steps: dict[str, list[list[float]]] = field(default_factory=lambda: {a: [] for a in ARMS})
    spilled: int = 0

    def add(self, other: Level) -> None:
        for a in ARMS:
            self.waves[a] += other.waves[a]
            self.cpu[a] += other.cpu[a]
            self.phases[a] += other.phases[a]
            self.steps[a] += other.steps[a]
        self.spilled += other.spilled

    def trace(self, records: list[dict[str, Any]]) -> None:
        """Splits each wave into its phases and its forward steps, from the server's trace records."""
        for a in ARMS:
            self.phases[a] = [_with_forwards(phases(w, records)) for w in self.waves[a]]
            self.steps[a] = [forward_steps(w, records) for w in self.waves[a]]


def forward_steps(wave: Wave, records: list[dict[str, Any]]) -> list[float]:
    """The milliseconds of each of the wave's forwards that ran tokens, in order."""
    start, end = wave.released_at, wave.released_at + wave.seconds
    mine = [r for r in records if r["phase"] == "forward" and r.get("tokens") and start <= r["t0"] <= end]
    return [1000 * (r["t1"] - r["t0"]) for r in sorted(mine, key=lambda r: r["t0"])]


def run_level(url: str, side: str, procs: ServerProcesses, level: int, seed: int, groups: int) -> Level:
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
                    out.spilled += not wait_for_saves(side, before[0] + chunks_saved(wave, groups))
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


def differences(level: int, rows: dict[str, list[dict[str, float]]], keys: Sequence[str]) -> list[str]:
    """Per key (a role's CPU, a phase): the opted-out waves' mean ms, and the mean paired difference of
    each arm from them."""
    lines = []
    for key in keys:
        base = [r[key] for r in rows[OFF]]
        cells = []
        for arm in (ON, OFF_2):
            diffs = [r[key] - b for r, b in zip(rows[arm], base, strict=True)]
            low, high = bootstrap(diffs, statistics.fmean)
            cells.append(f"{statistics.fmean(diffs):+.2f} ({low:+.2f} to {high:+.2f})")
        lines.append(f"| {level} | {key} | {statistics.fmean(base):.1f} | {cells[0]} | {cells[1]} |")
    return lines


def forwards_ratio(level: int, at: Level) -> list[str]:
    """The forwards of each arm's waves over the opted-out waves' (same process, same step shapes),
    with a 95% interval by resampling the rounds."""
    cells = []
    for arm in (ON, OFF_2):
        pairs = list(zip(at.phases[OFF], at.phases[arm], strict=True))
        of = lambda ps: sum(k[FORWARDS] for _, k in ps) / sum(b[FORWARDS] for b, _ in ps)  # noqa: E731
        cells.append(cell((of(pairs), *bootstrap(pairs, of))))
    return [f"| {level} | {FORWARDS}, over the opted-out waves' | | {cells[0]} | {cells[1]} |"]


def step_ratios(level: int, at: Level) -> list[str]:
    """Step by step, each arm's forward over its opted-out twin's (waves of the same steps only): where
    in a wave kvpool's saves slow the forward. The median of the rounds' ratios, 95% interval."""
    lines: list[str] = []
    for i in range(STEPS_SHOWN):
        cells, used, base_ms = [], [], []
        for arm in (ON, OFF_2):
            pairs = zip(at.steps[OFF], at.steps[arm], strict=True)
            twins = [(b, k) for b, k in pairs if len(b) == len(k) > i]
            ratios = [k[i] / b[i] for b, k in twins]
            if not ratios:
                return lines
            low, high = bootstrap(ratios, statistics.median)
            cells.append(f"{statistics.median(ratios):.4f} ({low:.4f}-{high:.4f})")
            used.append(len(ratios))
            base_ms += [b[i] for b, _ in twins]
        what = f"forward step {i + 1} ({statistics.median(base_ms):.0f} ms), over the opted-out wave's"
        lines.append(f"| {level} | {what} ({min(used)} waves) | | {cells[0]} | {cells[1]} |")
    return lines


def phase_table(level: int, at: Level) -> list[str]:
    phase_rows = differences(level, at.phases, list(at.phases[OFF][0]))
    return phase_rows + forwards_ratio(level, at) + step_ratios(level, at)


HEAD = [
    "| concurrency | arm / baseline | waves | median of the waves' TTFT ratios | mean TTFT | out tok/s |",
    "| --- " * 6 + "|",
]
PHASE_HEAD = [
    "| concurrency | phase, ms a wave | opted out | on - opted out | control: again - opted out |",
    "| --- " * 5 + "|",
]
CPU_HEAD = [
    "| concurrency | CPU time, ms a wave | opted out | on - opted out | control: again - opted out |",
    "| --- " * 5 + "|",
]


def main() -> None:
    run(BENCH, "bench-llama", "opt-out.json")


def run(
    shape: ModelShape,
    model_name: str,
    results: str,
    configs: dict[str, dict[str, Any]] | None = None,
    levels: Sequence[int] = tuple(ROUNDS),
    sets: int = SETS,
) -> None:
    """The bench on a model of `shape` (made in the temp dir's kvpool-models/`model_name`), its every
    request and phase written to bench/results/`results`. `configs`: connector settings by name, each
    set of servers one of each, their order alternating set to set; pooled per name."""
    print(f"({load_note()})")
    configs = configs or {"": {}}
    model = make_model(Path(tempfile.gettempdir()) / "kvpool-models" / model_name, shape)
    groups = 2 if shape.full_attention_every else 1  # vLLM's hybrid manager: full and windowed groups
    pooled = {(name, lv): Level() for name in configs for lv in levels}
    records: list[dict[str, Any]] = []
    with mock.patch.dict(os.environ, {**DEV_MODE, **HUGE_PAGES}):
        for n in range(sets):
            names = list(configs) if n % 2 == 0 else list(reversed(configs))
            for name in names:
                with (
                    tempfile.TemporaryDirectory(prefix="kvpool-bench-", dir="/dev/shm") as d,
                    contextlib.ExitStack() as stack,
                ):
                    trace = Path(d) / "trace"
                    trace.mkdir()
                    stack.enter_context(mock.patch.dict(os.environ, server_env(Path(d) / "plugin", trace)))
                    side = stack.enter_context(sidecar(Path(d) / "sidecar", "2Gi"))
                    spec = kvpool_connector_spec(side, CHUNK)
                    spec["extra"].update(configs[name])
                    url = stack.enter_context(
                        bench_server(model, Path(d) / "vllm.log", ENGINE_BLOCKS, connector=spec)
                    )
                    request(client(url), unique_prompts(1, seed=99)[0])  # warm-up
                    procs = ServerProcesses.find()
                    print(f"set {n}{f' ({name})' if name else ''}: server up ({load_note()})", flush=True)
                    for level in levels:
                        t0 = time.perf_counter()
                        at = run_level(url, side, procs, level, seed=30_000 + 100 * n + level, groups=groups)
                        engine_call(url, "/pause?mode=keep&clear_cache=false")  # the engine core writes
                        engine_call(url, "/resume")  # its trace records at a pause
                        at.trace(trace_records(trace))
                        waves = {a: [asdict(w) for w in at.waves[a]] for a in ARMS}
                        figures = {"cpu": at.cpu, "phases": at.phases, "steps": at.steps}
                        records.append({"set": n, "config": name, "level": level, **figures, **waves})
                        pooled[name, level].add(at)
                        shown = "\n".join(
                            table(level, at) + phase_table(level, at) + differences(level, at.cpu, ROLES)
                        )
                        print(shown, f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / results).write_text(json.dumps(records))
    for name in configs:
        of = {lv: pooled[name, lv] for lv in levels}
        print(f"\nPooled over {sets} sets{f' of {name}' if name else ''}, 95% intervals over the rounds")
        print(f"({load_note()}):")
        print("\n".join([*HEAD, *(line for lv in levels for line in table(lv, of[lv]))]))
        print("\nPhases in the engine's processes, ms a wave: the opted-out waves' mean, each arm's change")
        print("\n".join([*PHASE_HEAD, *(line for lv in levels for line in phase_table(lv, of[lv]))]))
        print("\nCPU time by role, ms a wave: the opted-out waves' mean, each arm's mean difference from it")
        print("\n".join([*CPU_HEAD, *(line for lv in levels for line in differences(lv, of[lv].cpu, ROLES))]))
