"""kvpool against its baselines wave by wave (#24), where bench load's whole runs cannot resolve the
gaps its targets name: returning users against the floor (the same engine with KV for everything)
and unique prompts (no reuse) against vLLM alone, at concurrency 1, 2, 4 and 8.

Lockstep: the turns go out in waves of `concurrency` requests; each wave goes to both servers of a
pair, one after the other, the order alternating from wave to wave, so both servers do the same work
under the same state of the machine. A run of whole workloads (bench load) moves 10-45% from run to
run on this VM; a wave and its twin a second apart do not.

Released waves: a wave is sent to a server whose scheduler is paused (vLLM's /pause in "keep" mode,
a development endpoint), then released at once (/resume), and its times count from the release. The
engine starts a step with the requests that have arrived, so without the pause which of a wave's
requests made the first step was chance, different for the two servers of a pair, and the wave's
TTFTs jumped between the groups; released, both servers run the wave in the same steps (the "same
steps" column counts the pairs where they did). Statistics are over whole waves, 95% bootstraps over
the pairs. The control: two identical vLLM alone servers compared the same way. What separates them
is the harness's and the machine's (which server a process happens to be), and no claim about kvpool
is finer than it.

The servers are bench load's (workloads_bench's arms, the same engine sizes); the QA waves hold
distinct users, every user's previous round in an earlier wave. Temperature 0, token ids compared.
Run: `.venv/bin/python -m bench paired` (about 30 minutes on 2 cores); writes
bench/results/paired.json.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import random
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from unittest import mock

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
from bench.workloads_bench import RESULTS, Servers, arms
from kvpool_demo.openai_driver import client, open_stream, read_stream
from kvpool_demo.tinymodel import BENCH, make_model
from kvpool_demo.workloads import Turn

QA_USERS = 16  # multi_round's
RETURNING_WAVES = 24  # at least, per level (at concurrency 1: 64)
NO_REUSE_WAVES = {1: 160, 2: 24, 4: 24, 8: 24}  # concurrency 1 claims a percent: more waves
CONTROL_WAVES = {1: 64, 2: 24, 4: 24, 8: 24}
ALONE_2 = "a second vLLM alone"
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}  # the servers' /pause and /resume
# First tokens further apart than this came from different steps: a step here takes 40 ms (a decode)
# or more, and the first tokens of one step reach the client within a few ms of each other.
STEP_GAP_S = 0.02


@dataclass
class Wave:
    requests: list[Request]  # TTFT and seconds counted from the wave's release
    seconds: float  # from the release to the wave's last token
    released_at: float = 0.0  # time.perf_counter() at the release (bench phases lines traces up with it)

    def steps(self) -> tuple[int, ...]:
        """How many of the wave's requests got their first token in each of its steps, in order."""
        firsts = sorted(r.ttft for r in self.requests)
        sizes = [1]
        for before, after in itertools.pairwise(firsts):
            if after - before > STEP_GAP_S:
                sizes.append(0)
            sizes[-1] += 1
        return tuple(sizes)


def engine_call(url: str, path: str) -> None:
    """POSTs to one of vLLM's development endpoints (VLLM_SERVER_DEV_MODE)."""
    with urllib.request.urlopen(urllib.request.Request(url + path, method="POST"), timeout=60) as r:
        r.read()


def released(
    url: str,
    apis: list[OpenAI],
    wave: list[Turn],
    pool: ThreadPoolExecutor,
    kv_transfer_params: dict[str, Any] | None = None,
) -> Wave:
    """Sends `wave` (each request with `kv_transfer_params`, if given) to the server at `url` with its
    scheduler paused ("keep": requests queue, nothing is scheduled, no cache is cleared), then resumes
    it, so the wave's first step starts with every request of it that fits and each server of a pair
    gets the wave in the same steps. A stream opens once the server has taken its request, just
    before it hands it to the engine; Wave.steps shows the shapes that came of it."""
    engine_call(url, "/pause?mode=keep&clear_cache=false")
    try:
        streams = list(pool.map(lambda api, turn: open_stream(api, turn, kv_transfer_params), apis, wave))
    finally:
        t0 = time.perf_counter()
        engine_call(url, "/resume")
    answers = list(pool.map(lambda s: read_stream(s, t0), streams))
    requests = [Request(t.user, t.round, len(t.prompt), *a) for t, a in zip(wave, answers, strict=True)]
    return Wave(requests, max(r.seconds for r in requests), t0)


def lockstep(urls: dict[str, str], turns: list[Turn], concurrency: int) -> dict[str, list[Wave]]:
    """Sends `turns` in waves of `concurrency` to every server of `urls`, rotating which goes first
    (two servers: alternating)."""
    servers = list(urls)
    apis = {a: [client(urls[a]) for _ in range(concurrency)] for a in servers}
    out: dict[str, list[Wave]] = {a: [] for a in servers}
    with ThreadPoolExecutor(concurrency) as pool:
        for w in range(0, len(turns), concurrency):
            wave, first = turns[w : w + concurrency], (w // concurrency) % len(servers)
            for arm in servers[first:] + servers[:first]:
                out[arm].append(released(urls[arm], apis[arm], wave, pool))
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
    waves = lockstep({a: urls[a] for a in (base, arm)}, turns, level)
    kept = [i for i, w in enumerate(waves[base]) if keep(w)]
    return {a: [ws[i] for i in kept] for a, ws in waves.items()}


def cell(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.3f} ({r[1]:.3f}-{r[2]:.3f})"


def wave_ratios(base: list[Wave], arm: list[Wave]) -> list[float]:
    """Per pair of waves: the arm's mean TTFT over its twin's."""
    return [mean_ttft([k]) / mean_ttft([b]) for b, k in zip(base, arm, strict=True)]


HEAD = [
    "| concurrency | workload: arm / baseline | waves | TTFT p50 | TTFT p99 | TTFT mean "
    "| median of the waves' ratios | out tok/s | same ids | same steps |",
    "| --- " * 10 + "|",
]


def row(level: int, what: str, b: list[Wave], k: list[Wave]) -> str:
    """One comparison's ratios, arm `k` over baseline `b`, each with its 95% interval."""
    p50 = lambda ws: statistics.median(ttfts(ws))  # noqa: E731
    p99 = lambda ws: pct(ttfts(ws), 0.99)  # noqa: E731
    per_wave = wave_ratios(b, k)
    low, high = bootstrap(per_wave, statistics.median)
    outputs = lambda ws: [r.output for w in ws for r in w.requests]  # noqa: E731
    same = sum(x == y for x, y in zip(outputs(b), outputs(k), strict=True))
    same_steps = sum(x.steps() == y.steps() for x, y in zip(b, k, strict=True))
    return (
        f"| {level} | {what} | {len(k)} | {cell(ratio(b, k, p50))} | {cell(ratio(b, k, p99))} | "
        f"{cell(ratio(b, k, mean_ttft))} | {statistics.median(per_wave):.3f} ({low:.3f}-{high:.3f}) | "
        f"{cell(ratio(b, k, out_tokens_per_s))} | {same}/{len(ttfts(k))} | {same_steps}/{len(k)} |"
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


def returning(wave: Wave) -> bool:
    """A wave of returning users only (rounds 2 and 3 of returning_users)."""
    return all(r.round >= 2 for r in wave.requests)


COMPARISONS = (
    Comparison("returning users", FLOOR, KVPOOL, returning_users, returning),
    Comparison("no reuse", ALONE, KVPOOL, lambda lv: unique_prompts(NO_REUSE_WAVES[lv] * lv, seed=9500 + lv)),
    # the control: what the harness alone makes of two identical servers (prompts of their own)
    Comparison("no reuse", ALONE, ALONE_2, lambda lv: unique_prompts(CONTROL_WAVES[lv] * lv, seed=9700 + lv)),
)


def through_control(
    arm: tuple[list[Wave], list[Wave]], control: tuple[list[Wave], list[Wave]]
) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """The arm against the control's second server, both compared with the same first server on
    prompts of their own, as (baseline, other) waves: the arm's median wave ratio over the control's,
    and the same of out tok/s, each with a 95% interval that resamples both comparisons' pairs."""
    rng = random.Random(0)
    arm_pairs, control_pairs = list(zip(*arm, strict=True)), list(zip(*control, strict=True))

    def ttft(ps: list[tuple[Wave, Wave]]) -> float:
        return statistics.median(wave_ratios([b for b, _ in ps], [k for _, k in ps]))

    def tokens(ps: list[tuple[Wave, Wave]]) -> float:
        return out_tokens_per_s([k for _, k in ps]) / out_tokens_per_s([b for b, _ in ps])

    out = []
    for stat in (ttft, tokens):
        draws = sorted(
            stat(rng.choices(arm_pairs, k=len(arm_pairs)))
            / stat(rng.choices(control_pairs, k=len(control_pairs)))
            for _ in range(2000)
        )
        out.append((stat(arm_pairs) / stat(control_pairs), draws[50], draws[1949]))
    return out[0], out[1]


CONTROL_HEAD = [
    "| concurrency | no reuse, through the control: kvpool / a second vLLM alone "
    "| median of the waves' ratios | out tok/s |",
    "| --- " * 4 + "|",
]


def start_servers(
    every: Mapping[str, tuple[Servers, object]],
    names: tuple[str, ...],
    work: Path,
    stack: contextlib.ExitStack,
    env: Callable[[str], dict[str, str]] = lambda name: {},
) -> dict[str, str]:
    """Starts the servers `names` in that order (ALONE_2: another vLLM alone) under `stack`, each in a
    directory of its own below `work`, with `env(name)` added to its environment, and warmed with one
    request; their URLs."""
    urls = {}
    for i, name in enumerate(names):
        with mock.patch.dict(os.environ, env(name)):
            (urls[name],) = stack.enter_context(
                every[ALONE if name == ALONE_2 else name][0](work / f"arm{i}")
            )
        request(client(urls[name]), unique_prompts(1, seed=99)[0])  # warm-up
    return urls


def main() -> None:
    print(f"({load_note()})")
    model = make_model(Path(tempfile.gettempdir()) / "kvpool-models" / "bench-llama", BENCH)
    every = arms(model, ENGINE_BLOCKS, FLOOR_BLOCKS)
    results: dict[int, dict[str, dict[str, list[dict[str, object]]]]] = {}
    lines: list[str] = []
    controlled: list[str] = []
    with (
        mock.patch.dict(os.environ, DEV_MODE),
        tempfile.TemporaryDirectory(prefix="kvpool-bench-", dir="/dev/shm") as d,
        contextlib.ExitStack() as stack,
    ):
        urls = start_servers(every, (ALONE, FLOOR, KVPOOL, ALONE_2), Path(d), stack)
        print(f"(servers up; {load_note()})", flush=True)
        for level in LEVELS:
            results[level] = {}
            kept: dict[Comparison, tuple[list[Wave], list[Wave]]] = {}
            for c in COMPARISONS:
                t0 = time.perf_counter()
                waves = compare(urls, c.base, c.arm, c.turns(level), level, c.keep)
                lines.append(row(level, c.name, waves[c.base], waves[c.arm]))
                print(f"{lines[-1]} [{time.perf_counter() - t0:.0f} s]", flush=True)
                results[level][c.name] = {a: [asdict(w) for w in ws] for a, ws in waves.items()}
                kept[c] = (waves[c.base], waves[c.arm])
            ttft, tokens = through_control(kept[COMPARISONS[1]], kept[COMPARISONS[2]])
            controlled.append(f"| {level} | {KVPOOL} / {ALONE_2} | {cell(ttft)} | {cell(tokens)} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "paired.json").write_text(json.dumps(results))
    print("\n".join(["Wave by wave, arm / baseline (95% intervals):", *HEAD, *lines]))
    print(
        "\n".join(
            [
                "The two comparisons with vLLM alone taken together (95% intervals):",
                *CONTROL_HEAD,
                *controlled,
            ]
        )
    )
