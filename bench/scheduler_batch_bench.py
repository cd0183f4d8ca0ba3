"""What kvpool adds to vLLM's engine core on each decode step as the running batch grows (#24). GPU
servers run 64 to 256 requests at once; the CPU engine's benches stop at 8.

The real vLLM v1 scheduler (tests/connector/schedkit.py: no model runs, the bench plays the worker),
alone and with kvpool's connector and a real sidecar, block 16 (vLLM's default on a GPU), chunk 256.
At each level, that many unique 352-token prompts are added and prefilled (their lookups miss and
their chunks are saved, as a worker reports), then STEPS decode steps are timed: schedule() and
update_from_output(), the engine core's part of a step (the worker's output is made outside it).
ROUNDS pairs of fresh schedulers, the order alternating; per pair the ratio of the median steps,
their geometric mean with a 95% bootstrap interval over the pairs, and kvpool's difference in µs.
Then one kvpool scheduler a level with kvpool's two per-step hooks timed inside its steps. Next, a
burst: that many unique prompts arrive at once (`vllm bench serve`'s default rate, every request at
once), and the engine core's time from their add_request() through the step in which all of them
decode is timed, ROUNDS pairs, with the lookups kvpool asked inside schedule() (a round trip each).
Then kvpool alone: RETURNING returning users whose first round another engine saved arrive at once,
with KV for RETURNING_ROOM at a time: its engine-core time until all have finished, and its round
trips inside schedule(), the second ones for a missed chunk's tails included.
Run: `PYTHONPATH=.:demo/src .venv-vllm-latest/bin/python -m bench scheduler_batch` (vLLM 0.33's scheduler,
the newest; `.venv` runs it on 0.32's), about 3 minutes on 2 cores.
"""

from __future__ import annotations

import functools
import gc
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / p) for p in ("tests", "tests/connector")]
import schedkit as sk  # noqa: E402
from kvtest import start_sidecar  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from bench.stats import bootstrap, geomean, load_note  # noqa: E402
from kvpool_connector.connector import KVPoolConnector  # noqa: E402
from kvpool_demo.tinymodel import TINY, make_model  # noqa: E402
from kvpool_sidecar.client import SidecarClient  # noqa: E402

LEVELS = (1, 8, 64, 256)
BURSTS = (64, 256)
RETURNING = 64
RETURNING_ROOM = 16  # requests the engine's KV holds at once
RETURNING_TOKENS = 8
RETURNING_FORWARD = 0.005  # a GPU's forward is milliseconds; the bench plays it with a sleep
ROUNDS = 10
STEPS = 200
PROMPT_TOKENS = 352
CHUNK = 256
HOOKS = ("build_connector_meta", "update_connector_output")
_seeds = iter(range(1, 1 << 30))


def make_scheduler(model: Path, url: str, level: int, connector: bool) -> Scheduler:
    """A scheduler with room for `level` requests' prompts and STEPS tokens each, 8,192 tokens a step."""
    return sk.make_scheduler(
        model,
        url,
        num_blocks=level * math.ceil((PROMPT_TOKENS + STEPS + 16) / sk.BS) + 16,
        batched=8192,
        prefix_caching=True,
        max_num_seqs=max(LEVELS),
        connector=connector,
        chunk_size=CHUNK,
    )


def prefill(scheduler: Scheduler, level: int, counters: dict[str, float] | None = None) -> float:
    """Steps until all `level` requests decode (8,192 tokens a step); the seconds of their schedule()
    and update_from_output() calls. `counters` sums kvpool's counters as the engine reports them."""
    return timed_steps(scheduler, lambda so: so.total_num_scheduled_tokens == level, level + 64, counters)


def timed_steps(
    scheduler: Scheduler,
    done: Callable[[Any], bool],
    bound: int,
    counters: dict[str, float] | None = None,
    forward: float = 0.0,
) -> float:
    """Steps until `done` (given the step's scheduler output) after at most `bound` steps; the seconds of
    their schedule() and update_from_output() calls. Each step's forward lasts `forward` seconds,
    not counted; `counters` sums kvpool's counters as the engine reports them."""
    seconds = 0.0
    for _ in range(bound):
        t0 = time.perf_counter()
        so = scheduler.schedule()
        t1 = time.perf_counter()
        time.sleep(forward)
        output = sk.model_output(scheduler, so)
        t2 = time.perf_counter()
        engine_outputs = scheduler.update_from_output(so, output)
        seconds += time.perf_counter() - t2 + t1 - t0
        if counters is not None:
            sk.add_counters(counters, engine_outputs)
        if done(so):
            return seconds
    raise RuntimeError(f"not done after {bound} steps")


def arrivals(scheduler: Scheduler, level: int) -> float:
    """Adds `level` requests with unique prompts at once; the seconds of the add_request() calls."""
    requests = [
        sk.make_request(sk.prompt(PROMPT_TOKENS, next(_seeds)), max_tokens=STEPS + 16) for _ in range(level)
    ]
    return added(scheduler, requests)


def added(scheduler: Scheduler, requests: list[Any]) -> float:
    """Adds `requests` at once; the seconds of the add_request() calls."""
    t0 = time.perf_counter()
    for request in requests:
        scheduler.add_request(request)
    return time.perf_counter() - t0


def burst(model: Path, url: str, level: int, in_schedule: list[float], connector: bool) -> float:
    """Seconds of the engine core's part from `level` arrivals at once through the step in which all
    of them decode. With kvpool, adds to `in_schedule` how many of its lookups were round trips
    inside schedule() (not sent ahead)."""
    scheduler = make_scheduler(model, url, level, connector)
    try:
        counters: dict[str, float] = {}
        gc.collect()  # the garbage of the schedulers before, not collected inside this one's burst
        seconds = arrivals(scheduler, level) + prefill(scheduler, level, counters)
    finally:
        scheduler.shutdown()
    if connector:
        in_schedule.append(sk.lookups_asked_in_schedule(counters))
    return seconds


def saved_elsewhere(model: Path, url: str, level: int) -> list[list[int]]:
    """`level` users' second rounds (their first, PROMPT_TOKENS long, and 40 tokens more), whose first
    rounds another engine saved: chunk 0 and the first round's partial tail, with its block prefixes."""
    firsts = [sk.prompt(PROMPT_TOKENS, next(_seeds)) for _ in range(level)]
    other = make_scheduler(model, url, level, True)
    try:
        for tokens in firsts:
            other.add_request(sk.make_request(tokens, max_tokens=1))
        with SidecarClient(url, timeout=5) as client:
            sk.save_like_a_worker(client, sk.run_to_end(other))
    finally:
        other.shutdown()
    return [tokens + sk.prompt(40, next(_seeds)) for tokens in firsts]


def returning_elsewhere(model: Path, url: str, rounds: list[list[int]], counters: dict[str, float]) -> float:
    """Seconds of the engine core's part from `rounds` arriving at once until all have answered
    RETURNING_TOKENS tokens, with KV for RETURNING_ROOM of them at a time (the rest queue, as behind a
    full GPU), each step's forward lasting RETURNING_FORWARD (the sidecar answers meanwhile)."""
    scheduler = make_scheduler(model, url, RETURNING_ROOM, True)
    try:
        requests = [sk.make_request(tokens, max_tokens=RETURNING_TOKENS) for tokens in rounds]
        gc.collect()
        seconds = added(scheduler, requests)
        finished = lambda so: not scheduler.has_unfinished_requests()  # noqa: E731
        bound = len(rounds) * (RETURNING_TOKENS + 4)
        return seconds + timed_steps(scheduler, finished, bound, counters, RETURNING_FORWARD)
    finally:
        scheduler.shutdown()


def returning_users(model: Path, url: str) -> None:
    print(
        f"returning users whose first round another engine saved, {RETURNING} at once, KV for "
        f"{RETURNING_ROOM} at a time, {RETURNING_TOKENS} tokens each, each step's forward "
        f"{1e3 * RETURNING_FORWARD:.0f} ms: the engine core's part (add_request() of each, then "
        f"schedule() + update_from_output() until all have finished); {ROUNDS} runs"
    )
    seconds, asked, tails, again = [], [], [], []
    for _ in range(ROUNDS):
        counters: dict[str, float] = {}
        seconds.append(returning_elsewhere(model, url, saved_elsewhere(model, url, RETURNING), counters))
        asked.append(sk.lookups_asked_in_schedule(counters))
        tails.append(counters.get("tail_lookups", 0))
        again.append(counters.get("lookups_guessed_again", 0))
        # each loads its first round: chunk 0 and the partial tail's blocks
        assert counters.get("hit_tokens") == RETURNING * PROMPT_TOKENS, counters
    print(
        f"  {1e3 * statistics.median(seconds):.1f} ms ({1e3 * min(seconds):.1f}-{1e3 * max(seconds):.1f}); "
        f"round trips inside schedule(): lookups {min(asked):.0f}-{max(asked):.0f}, their tails asked again "
        f"{min(tails):.0f}-{max(tails):.0f}; lookups sent again with the chunk found "
        f"{min(again):.0f}-{max(again):.0f}; every one loaded its first round",
        flush=True,
    )


def median_step(model: Path, url: str, level: int, connector: bool) -> float:
    return statistics.median(decode_steps(model, url, level, connector))


def decode_steps(model: Path, url: str, level: int, connector: bool) -> list[float]:
    """Seconds of each of STEPS decode steps' schedule() and update_from_output(), `level` running."""
    scheduler = make_scheduler(model, url, level, connector)
    try:
        arrivals(scheduler, level)
        prefill(scheduler, level)
        seconds = []
        for _ in range(STEPS):
            t0 = time.perf_counter()
            so = scheduler.schedule()
            t1 = time.perf_counter()
            output = sk.model_output(scheduler, so)
            t2 = time.perf_counter()
            scheduler.update_from_output(so, output)
            seconds.append(time.perf_counter() - t2 + t1 - t0)
        return seconds
    finally:
        scheduler.shutdown()


@contextmanager
def hooks_timed() -> Iterator[dict[str, list[float]]]:
    """kvpool's per-step hooks, each call timed (seconds), while inside."""
    times: dict[str, list[float]] = {name: [] for name in HOOKS}

    def timed(name: str) -> Callable[..., Any]:
        inner = getattr(KVPoolConnector, name)

        def call(self: KVPoolConnector, *args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(self, *args)
            finally:
                times[name].append(time.perf_counter() - t0)

        return call

    with ExitStack() as patched:
        for name in HOOKS:
            patched.enter_context(mock.patch.object(KVPoolConnector, name, timed(name)))
        yield times


def pairs(measure: Callable[[bool], float]) -> tuple[list[float], list[float], tuple[float, float, float]]:
    """ROUNDS pairs of `measure(connector)`, the order alternating: vLLM alone's, kvpool's, and the
    geometric mean of the pairs' ratios with its 95% bootstrap interval."""
    alone: list[float] = []
    kvpool: list[float] = []
    for r in range(ROUNDS):
        for connector in (r % 2 == 1, r % 2 == 0):
            (kvpool if connector else alone).append(measure(connector))
    ratios = [k / a for k, a in zip(kvpool, alone, strict=True)]
    return alone, kvpool, (geomean(ratios), *bootstrap(ratios, geomean))


def decode_levels(model: Path, url: str) -> None:
    print(
        f"per decode step, schedule() + update_from_output(), median of {STEPS} steps a scheduler; "
        f"{ROUNDS} pairs a level, order alternating; geometric mean of the pairs' ratios (95% bootstrap)"
    )
    for level in LEVELS:
        alone, kvpool, (ratio, low, high) = pairs(functools.partial(median_step, model, url, level))
        diff = [1e6 * (k - a) for k, a in zip(kvpool, alone, strict=True)]
        print(
            f"  {level:>3} running: vLLM alone {1e6 * statistics.median(alone):7.1f} µs, "
            f"kvpool {1e6 * statistics.median(kvpool):7.1f} µs, kvpool / alone {ratio:.3f} "
            f"({low:.3f}-{high:.3f}), kvpool - alone {statistics.median(diff):+7.1f} µs "
            f"({min(diff):+.1f} to {max(diff):+.1f})",
            flush=True,
        )
    print("kvpool's hooks inside a decode step, median µs (one scheduler a level)")
    for level in LEVELS:
        with hooks_timed() as times:
            decode_steps(model, url, level, True)
        steps = {name: times[name][-STEPS:] for name in HOOKS}
        print(
            f"  {level:>3} running: "
            + ", ".join(f"{name} {1e6 * statistics.median(t):.1f}" for name, t in steps.items()),
            flush=True,
        )


def bursts(model: Path, url: str) -> None:
    print(
        "a burst of arrivals: add_request() of each, then schedule() + update_from_output() until all "
        f"decode; {ROUNDS} pairs a level, order alternating"
    )
    for level in BURSTS:
        in_schedule: list[float] = []  # kvpool's lookups that were round trips inside schedule()
        alone, kvpool, (ratio, low, high) = pairs(functools.partial(burst, model, url, level, in_schedule))
        print(
            f"  {level:>3} at once: vLLM alone {1e3 * statistics.median(alone):6.1f} ms, "
            f"kvpool {1e3 * statistics.median(kvpool):6.1f} ms, kvpool / alone {ratio:.3f} "
            f"({low:.3f}-{high:.3f}); kvpool's lookups asked inside schedule(): "
            f"{min(in_schedule):.0f}-{max(in_schedule):.0f} of {level}",
            flush=True,
        )


def main() -> None:
    print(f"({load_note()})")
    model = make_model(Path(tempfile.gettempdir()) / "kvpool-models" / "tiny-llama", TINY)
    sidecar = start_sidecar(Path(tempfile.mkdtemp(prefix="kvpool-scheduler-batch-")), "1Gi")
    url = sidecar.info["url"]
    try:
        decode_steps(model, url, 8, True)  # warm up both arms' imports and the sidecar
        decode_steps(model, url, 8, False)
        decode_levels(model, url)
        bursts(model, url)
        returning_users(model, url)
    finally:
        sidecar.stop()
    print(f"({load_note()})")
