"""Figures under load through vLLM's OpenAI-compatible server (#24): multi-round QA with returning
users, and unique prompts only (no reuse), each at concurrency 1, 2, 4 and 8.

Arms: vLLM alone; the floor (the same engine with KV for the whole working set); kvpool with a CPU
tier; LMCache's multiprocess mode when .venv-lmcache exists (`bash bench/lmcache-env.sh`). Every
arm's server is up for the whole run and the arms take turns at each level in an order that rotates
from level to level, so a drift of the machine lands on every arm. No reuse is also run as
ABBA-alternating pairs of vLLM alone and kvpool, PAIRS of them at each level. Whole runs move
10-45% from run to run here: bench paired compares the same arms wave by wave, where the targets'
gaps can be resolved. Every run sends prompts no server has seen (a seed per level and
repetition), the same prompts to every arm. The servers are workloads_bench's: the BENCH model,
block 64, prefix caching on, one compute thread, temperature 0, token ids.

A closed loop: `concurrency` clients each send the next turn as soon as their last one is answered;
a user's next question waits for its previous answer. TTFT and inter-token latency are measured at
the client; token sources are read off each server's /metrics around the whole run.
Run: `.venv/bin/python -m bench load` (about 35 minutes on 2 cores); writes bench/results/load.json.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from openai import OpenAI

from bench.stats import Spread, bootstrap, load_note, pct
from bench.workloads_bench import RESULTS, arms
from kvpool_demo.openai_driver import COUNTERS, client, counters, send
from kvpool_demo.tinymodel import BENCH, make_model
from kvpool_demo.workloads import Turn, multi_round_qa, no_reuse

LEVELS = (1, 2, 4, 8)
PAIRS = 8
# multi-round QA as ABBA pairs of the floor and kvpool, the first one the sweep's: one run's
# returning-user p50 moved 10% either way from run to run here, the size of the margin claimed
QA_PAIRS = 4
# read off the server's /metrics around each run: where prompt tokens came from, and what kvpool
# costs vLLM's scheduler (hit or miss)
WATCHED = {**COUNTERS, "lookup_seconds": "vllm:kvpool_lookup_seconds_total"}
# Room for 8 requests of the longest prompt (7 blocks) at once, but not for the working set: 16
# users' ~5,000 tokens are 1.7x of it, so a user returning after the 15 others misses vLLM's cache.
ENGINE_BLOCKS = 48
FLOOR_BLOCKS = 192  # one run's working set twice over
ARMS = ("vLLM alone", "vLLM, KV for everything (floor)", "kvpool, CPU tier", "LMCache (multiprocess mode)")
ALONE, FLOOR, KVPOOL = ARMS[:3]
QA, UNIQUE = "multi-round QA", "no reuse"
WAIT_S = 900  # the longest a turn waits for its user's previous answer


def multi_round(seed: int) -> list[Turn]:
    # 16 users sharing a 128-token system prompt, each with 192 tokens of its own, 3 rounds of a
    # 32-token question and an 8-token answer: prompts of 352, 392 and 432 tokens
    return multi_round_qa(16, 3, system=128, history=192, question=32, answer=8, vocab=BENCH.vocab, seed=seed)


def unique_prompts(n: int, seed: int) -> list[Turn]:
    return no_reuse(n, 352, answer=8, vocab=BENCH.vocab, seed=seed)


def unique(seed: int) -> list[Turn]:
    return unique_prompts(12, seed)


WORKLOADS: dict[str, Callable[[int], list[Turn]]] = {QA: multi_round, UNIQUE: unique}


@dataclass
class Request:
    user: int
    round: int
    prompt_tokens: int
    ttft: float  # seconds, at the client
    seconds: float  # to the last token
    output: list[int]

    @property
    def itl(self) -> float | None:
        """Mean seconds between output tokens after the first."""
        n = len(self.output)
        return (self.seconds - self.ttft) / (n - 1) if n > 1 else None


@dataclass
class Run:
    arm: str
    workload: str
    level: int
    rep: int
    wall: float
    requests: list[Request]
    tokens: dict[str, int]  # prompt tokens over the run: prompt, engine (cache), connector
    lookup_seconds: float  # the scheduler's time in kvpool's lookups over the run (0 without kvpool)

    @property
    def out_tokens_per_s(self) -> float:
        return sum(len(r.output) for r in self.requests) / self.wall


def request(api: OpenAI, t: Turn) -> Request:
    ttft, seconds, ids = send(api, t)
    return Request(t.user, t.round, len(t.prompt), ttft, seconds, ids)


def closed_loop(url: str, turns: list[Turn], concurrency: int) -> tuple[list[Request], float]:
    """Sends `turns` from `concurrency` clients, each taking the next turn in order once its last is
    answered; a turn whose user's previous round is still in flight waits for it. (requests, wall)"""
    cond = threading.Condition()
    answered: set[tuple[int, int]] = set()
    taken = 0
    out: list[Request | None] = [None] * len(turns)

    def one_client() -> None:
        nonlocal taken
        api = client(url)
        while True:
            with cond:
                if taken == len(turns):
                    return
                i, taken = taken, taken + 1
                t = turns[i]
                previous = (t.user, t.round - 1)
                if t.round > 1 and not cond.wait_for(lambda p=previous: p in answered, WAIT_S):  # type: ignore[misc]
                    raise TimeoutError(f"user {t.user}'s round {t.round - 1} not answered in {WAIT_S} s")
            try:
                out[i] = request(api, t)
            finally:  # a failed turn still releases its user's next, which then fails on its own
                with cond:
                    answered.add((t.user, t.round))
                    cond.notify_all()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(one_client) for _ in range(concurrency)]:
            f.result()
    wall = time.perf_counter() - t0
    return [r for r in out if r is not None], wall


def measure(arm: str, url: str, workload: str, level: int, rep: int) -> Run:
    turns = WORKLOADS[workload](1000 * level + 100 * rep + (7 if workload == QA else 0))
    before = counters(url, WATCHED)
    requests, wall = closed_loop(url, turns, level)
    after = counters(url, WATCHED)
    tokens = {k: round(after[k] - before[k]) for k in COUNTERS}
    lookup = after["lookup_seconds"] - before["lookup_seconds"]
    run = Run(arm, workload, level, rep, wall, requests, tokens, lookup)
    print(
        f"  c={level} {workload} rep {rep} {arm}: {wall:.1f} s, TTFT p50 {_p50(run):.3f} s, "
        f"{run.out_tokens_per_s:.2f} out tok/s",
        flush=True,
    )
    return run


def _ttfts(run: Run, returning: bool = False) -> list[float]:
    return [r.ttft for r in run.requests if r.round >= 2 or not returning]


def _p50(run: Run, returning: bool = False) -> float:
    return statistics.median(_ttfts(run, returning))


def sweep(urls: dict[str, str]) -> list[Run]:
    """At each level: every arm on multi-round QA and on no reuse, in an order rotated per level; then
    the remaining multi-round QA pairs of the floor and kvpool and no-reuse pairs of vLLM alone and
    kvpool, ABBA."""
    runs = []
    names = list(urls)
    for k, level in enumerate(LEVELS):
        order = names[k % len(names) :] + names[: k % len(names)]
        for workload in (QA, UNIQUE):
            runs += [measure(arm, urls[arm], workload, level, 0) for arm in order]
        for workload, base, pairs in ((QA, FLOOR, QA_PAIRS), (UNIQUE, ALONE, PAIRS)):
            ab = sorted((base, KVPOOL), key=order.index)  # the pair's order in repetition 0
            for rep in range(1, pairs):
                runs += [measure(a, urls[a], workload, level, rep) for a in (ab[::-1] if rep % 2 else ab)]
    return runs


def _find(runs: list[Run], arm: str, workload: str, level: int, rep: int = 0) -> Run:
    return next(r for r in runs if (r.arm, r.workload, r.level, r.rep) == (arm, workload, level, rep))


def report(runs: list[Run]) -> list[str]:
    lines = []
    for workload in (QA, UNIQUE):
        lines += [f"### {workload}", ""]
        head = "| concurrency | arm | TTFT p50 / p99 | returning users p50 / p99 | ITL p50 (ms) |"
        head += " out tok/s | req/s | prompt tokens: engine cache / connector / computed |"
        head += " same ids as vLLM alone |"
        lines += [head, "| --- " * 9 + "|"]
        for level in LEVELS:
            base = _find(runs, ALONE, workload, level)
            for run in (r for r in runs if r.workload == workload and r.level == level and r.rep == 0):
                ret = _ttfts(run, returning=True)
                ret_txt = f"{statistics.median(ret):.3f} / {pct(ret, 0.99):.3f}" if ret else "-"
                itls = [x for x in (r.itl for r in run.requests) if x is not None]
                eng, con = run.tokens["engine"], run.tokens["connector"]
                same = sum(a.output == b.output for a, b in zip(run.requests, base.requests, strict=True))
                t = _ttfts(run)
                lines.append(
                    f"| {level} | {run.arm} | {statistics.median(t):.3f} / {pct(t, 0.99):.3f} | {ret_txt} | "
                    f"{1e3 * statistics.median(itls):.1f} | {run.out_tokens_per_s:.2f} | "
                    f"{len(run.requests) / run.wall:.3f} | "
                    f"{eng} / {con} / {run.tokens['prompt'] - eng - con} | "
                    f"{same}/{len(run.requests)} |"
                )
        lines.append("")
    return lines


def _spread(xs: list[float]) -> str:
    s = Spread.of(xs)
    return f"{s.median:.3f} [{s.low:.3f}-{s.high:.3f}]"


def targets(runs: list[Run]) -> list[str]:
    lines = []
    for level in LEVELS:
        alone, kv = (_find(runs, a, QA, level) for a in (ALONE, KVPOOL))
        qa = [tuple(_find(runs, a, QA, level, i) for a in (FLOOR, KVPOOL)) for i in range(QA_PAIRS)]
        pairs = [tuple(_find(runs, a, UNIQUE, level, i) for a in (ALONE, KVPOOL)) for i in range(PAIRS)]
        misses = [k for _, k in pairs]
        lookup = sum(k.lookup_seconds for k in misses) / sum(len(k.requests) for k in misses)
        lines.append(
            f"- concurrency {level}: multi-round QA out tok/s kvpool / vLLM alone = "
            f"{kv.out_tokens_per_s / alone.out_tokens_per_s:.3f} (target >= 1); returning users' TTFT "
            f"kvpool / floor over {QA_PAIRS} pairs, median [range]: p50 "
            f"{_spread([_p50(k, True) / _p50(f, True) for f, k in qa])} (target <= 1.10), p99 "
            f"{_spread([pct(_ttfts(k, True), 0.99) / pct(_ttfts(f, True), 0.99) for f, k in qa])} "
            f"(target <= 1.25); no reuse, kvpool / vLLM alone over {PAIRS} pairs, median [range]: out "
            f"tok/s {_spread([k.out_tokens_per_s / a.out_tokens_per_s for a, k in pairs])} (target >= 1), "
            f"TTFT p50 {_spread([_p50(k) / _p50(a) for a, k in pairs])} (target <= 1.01); vLLM alone "
            f"against itself, TTFT p50 of each pair over the median: "
            f"{_spread([_p50(a) / statistics.median(_p50(b) for b, _ in pairs) for a, _ in pairs])}; "
            f"kvpool's lookups on a miss, on the scheduler: {1e3 * lookup:.2f} ms a request, "
            f"{lookup / statistics.median(_p50(k) for k in misses):.2%} of its TTFT p50"
        )
    every = [
        tuple(_find(runs, a, UNIQUE, lv, i) for a in (ALONE, KVPOOL)) for lv in LEVELS for i in range(PAIRS)
    ]
    for what, ratio in (
        ("out tok/s", lambda a, k: k.out_tokens_per_s / a.out_tokens_per_s),
        ("TTFT p50", lambda a, k: _p50(k) / _p50(a)),
    ):
        xs = [ratio(a, k) for a, k in every]
        low, high = bootstrap(xs, statistics.median)
        lines.append(
            f"- no reuse, all {len(xs)} pairs of every level: {what} kvpool / vLLM alone, median "
            f"{statistics.median(xs):.3f} (95% interval {low:.3f}-{high:.3f})"
        )
    return lines


def main() -> None:
    print(f"({load_note()})")
    model = make_model(Path(tempfile.gettempdir()) / "kvpool-models" / "bench-llama", BENCH)
    every = arms(model, ENGINE_BLOCKS, FLOOR_BLOCKS)
    chosen = {name: every[name] for name in ARMS if name in every}
    with (
        tempfile.TemporaryDirectory(prefix="kvpool-bench-", dir="/dev/shm") as d,
        contextlib.ExitStack() as stack,
    ):
        urls = {}
        for i, (name, (servers, _)) in enumerate(chosen.items()):
            (urls[name],) = stack.enter_context(servers(Path(d) / f"arm{i}"))
            closed_loop(urls[name], no_reuse(1, 256, answer=2, vocab=BENCH.vocab, seed=99), 1)  # warm-up
        print(f"(servers up; {load_note()})", flush=True)
        runs = sweep(urls)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "load.json").write_text(json.dumps({"runs": [asdict(r) for r in runs]}))
    print("\n".join([*report(runs), "Targets:", *targets(runs)]))
