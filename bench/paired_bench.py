"""kvpool against its baselines wave by wave (#24), where bench load's whole runs cannot resolve the
gaps its targets name: returning users against the floor (the same engine with KV for everything)
and unique prompts (no reuse) against vLLM alone, at concurrency 1, 2, 4 and 8.

Lockstep: the turns go out in waves of `concurrency` requests sent at once; each wave goes to both
servers of a pair, one after the other, the order alternating from wave to wave, so both servers do
the same work under the same state of the machine. At concurrency 1 a wave is one request. A run of
whole workloads (bench load) moves 10-45% from run to run on this VM; a wave and its twin a second
apart do not. Within a wave the engine starts a step with the requests that have arrived, so which
request is served first is chance: a wave is compared as a whole (its requests' TTFT together), never
request by request. At concurrency 2 and up a wave's TTFTs fall in two groups (served in the first
step or after it), and the p50 of such a sample jumps between them: the mean of the TTFTs is
reported beside it as the steadier figure. Intervals are 95% bootstraps over the pairs of waves.
The control: two identical vLLM alone servers compared the same way. What separates them is the
harness's and the machine's (which server a process happens to be), and no claim about kvpool is
finer than it.

The servers are bench load's (workloads_bench's arms, the same engine sizes); the QA waves hold
distinct users, every user's previous round in an earlier wave. Temperature 0, token ids compared.
Run: `.venv/bin/python -m bench paired` (about 40 minutes on 2 cores); writes
bench/results/paired.json.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from openai import OpenAI

from bench.load_bench import (
    ALONE,
    ENGINE_BLOCKS,
    FLOOR,
    FLOOR_BLOCKS,
    KVPOOL,
    LEVELS,
    Request,
    multi_round,
    request,
    unique_prompts,
)
from bench.stats import bootstrap, load_note, pct
from bench.workloads_bench import RESULTS, arms
from kvpool_demo.openai_driver import client
from kvpool_demo.tinymodel import BENCH, make_model
from kvpool_demo.workloads import Turn

QA_USERS = 16  # multi_round's
RETURNING_WAVES = 24  # at least, per level (at concurrency 1: 64)
NO_REUSE_WAVES = {1: 160, 2: 24, 4: 24, 8: 24}  # concurrency 1 claims a percent: more waves
CONTROL_WAVES = {1: 64, 2: 24, 4: 24, 8: 24}
ALONE_2 = "a second vLLM alone"


@dataclass
class Wave:
    requests: list[Request]
    seconds: float  # from sending the wave to its last token


def lockstep(apis: dict[str, list[OpenAI]], turns: list[Turn], concurrency: int) -> dict[str, list[Wave]]:
    """Sends `turns` in waves of `concurrency` to both arms of `apis`, alternating which goes first."""
    pair = list(apis)
    out: dict[str, list[Wave]] = {a: [] for a in pair}
    with ThreadPoolExecutor(concurrency) as pool:
        for w in range(0, len(turns), concurrency):
            wave = turns[w : w + concurrency]
            for arm in pair if (w // concurrency) % 2 == 0 else pair[::-1]:
                t0 = time.perf_counter()
                requests = list(pool.map(request, apis[arm], wave))
                out[arm].append(Wave(requests, time.perf_counter() - t0))
    return out


def ttfts(waves: list[Wave]) -> list[float]:
    return [r.ttft for w in waves for r in w.requests]


def mean_ttft(waves: list[Wave]) -> float:
    return statistics.fmean(ttfts(waves))


def out_tokens_per_s(waves: list[Wave]) -> float:
    return sum(len(r.output) for w in waves for r in w.requests) / sum(w.seconds for w in waves)


def ratio(base: list[Wave], arm: list[Wave], of: Callable[[list[Wave]], float]) -> tuple[float, float, float]:
    """of(arm) / of(base) over the paired waves: (value, 95% interval) by resampling the pairs."""
    value = of(arm) / of(base)
    pairs = list(zip(base, arm, strict=True))
    low, high = bootstrap(pairs, lambda ps: of([k for _, k in ps]) / of([b for b, _ in ps]))
    return value, low, high


def compare(
    urls: dict[str, str], base: str, arm: str, turns: list[Turn], level: int, keep: Callable[[Wave], bool]
) -> dict[str, list[Wave]]:
    """Waves of `turns` to `base` and `arm`; those `keep` takes, paired by position."""
    apis = {a: [client(urls[a]) for _ in range(level)] for a in (base, arm)}
    waves = lockstep(apis, turns, level)
    kept = [i for i, w in enumerate(waves[base]) if keep(w)]
    return {a: [ws[i] for i in kept] for a, ws in waves.items()}


def _cell(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.3f} ({r[1]:.3f}-{r[2]:.3f})"


def wave_ratios(base: list[Wave], arm: list[Wave]) -> list[float]:
    """Per pair of waves: the arm's mean TTFT over its twin's."""
    return [mean_ttft([k]) / mean_ttft([b]) for b, k in zip(base, arm, strict=True)]


HEAD = [
    "| concurrency | workload: arm / baseline | waves | TTFT p50 | TTFT p99 | TTFT mean "
    "| median of the waves' ratios | out tok/s | same ids |",
    "| --- " * 9 + "|",
]


def row(level: int, what: str, b: list[Wave], k: list[Wave]) -> str:
    """One comparison's ratios, arm `k` over baseline `b`, each with its 95% interval."""
    p50 = lambda ws: statistics.median(ttfts(ws))  # noqa: E731
    p99 = lambda ws: pct(ttfts(ws), 0.99)  # noqa: E731
    per_wave = wave_ratios(b, k)
    low, high = bootstrap(per_wave, statistics.median)
    outputs = lambda ws: [r.output for w in ws for r in w.requests]  # noqa: E731
    same = sum(x == y for x, y in zip(outputs(b), outputs(k), strict=True))
    return (
        f"| {level} | {what} | {len(k)} | {_cell(ratio(b, k, p50))} | {_cell(ratio(b, k, p99))} | "
        f"{_cell(ratio(b, k, mean_ttft))} | {statistics.median(per_wave):.3f} ({low:.3f}-{high:.3f}) | "
        f"{_cell(ratio(b, k, out_tokens_per_s))} | {same}/{len(ttfts(k))} |"
    )


@dataclass(frozen=True)
class Comparison:
    workload: str
    base: str
    arm: str
    turns: Callable[[int], list[Turn]]  # at a level
    keep: Callable[[Wave], bool] = lambda w: True

    @property
    def name(self) -> str:
        return f"{self.workload}: {self.arm} / {self.base}"


def returning_users(level: int) -> list[Turn]:
    assert QA_USERS % level == 0, "a QA wave must hold distinct users"
    seeds = max(2, math.ceil(RETURNING_WAVES * level / (2 * QA_USERS)))  # 2 returning rounds a seed
    return [t for s in range(seeds) for t in multi_round(9000 + 100 * level + s)]


COMPARISONS = (
    Comparison(
        "returning users", FLOOR, KVPOOL, returning_users, lambda w: all(r.round >= 2 for r in w.requests)
    ),
    Comparison("no reuse", ALONE, KVPOOL, lambda lv: unique_prompts(NO_REUSE_WAVES[lv] * lv, seed=9500 + lv)),
    # the control: what the harness alone makes of two identical servers (prompts of their own)
    Comparison("no reuse", ALONE, ALONE_2, lambda lv: unique_prompts(CONTROL_WAVES[lv] * lv, seed=9700 + lv)),
)


def main() -> None:
    print(f"({load_note()})")
    model = make_model(Path(tempfile.gettempdir()) / "kvpool-models" / "bench-llama", BENCH)
    every = arms(model, ENGINE_BLOCKS, FLOOR_BLOCKS)
    results: dict[int, dict[str, dict[str, list[dict[str, object]]]]] = {}
    lines: list[str] = []
    with (
        tempfile.TemporaryDirectory(prefix="kvpool-bench-", dir="/dev/shm") as d,
        contextlib.ExitStack() as stack,
    ):
        urls = {}
        for i, name in enumerate((ALONE, FLOOR, KVPOOL, ALONE_2)):
            (urls[name],) = stack.enter_context(
                every[ALONE if name == ALONE_2 else name][0](Path(d) / f"arm{i}")
            )
            request(client(urls[name]), unique_prompts(1, seed=99)[0])  # warm-up
        print(f"(servers up; {load_note()})", flush=True)
        for level in LEVELS:
            results[level] = {}
            for c in COMPARISONS:
                t0 = time.perf_counter()
                waves = compare(urls, c.base, c.arm, c.turns(level), level, c.keep)
                lines.append(row(level, c.name, waves[c.base], waves[c.arm]))
                print(f"{lines[-1]} [{time.perf_counter() - t0:.0f} s]", flush=True)
                results[level][c.name] = {a: [asdict(w) for w in ws] for a, ws in waves.items()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "paired.json").write_text(json.dumps(results))
    print("\n".join(["Wave by wave, arm / baseline (95% intervals):", *HEAD, *lines]))
