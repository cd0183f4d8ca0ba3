"""What kvpool adds to vLLM's engine core on each decode step as the running batch grows (#24). GPU
servers run 64 to 256 requests at once; the CPU engine's benches stop at 8.

The real vLLM v1 scheduler (tests/connector/schedkit.py: no model runs, the bench plays the worker),
alone and with kvpool's connector and a real sidecar, block 16 (vLLM's default on a GPU), chunk 256.
At each level, that many unique 352-token prompts are added and prefilled (their lookups miss and
their chunks are saved, as a worker reports), then STEPS decode steps are timed: schedule() and
update_from_output(), the engine core's part of a step (the worker's output is made outside it).
ROUNDS pairs of fresh schedulers, the order alternating; per pair the ratio of the median steps,
their geometric mean with a 95% bootstrap interval over the pairs, and kvpool's difference in µs.
Then one kvpool scheduler a level with kvpool's two per-step hooks timed inside its steps.
Run: `PYTHONPATH=.:demo/src .venv-vllm-latest/bin/python -m bench scheduler_batch` (vLLM 0.33's scheduler,
the newest; `.venv` runs it on 0.32's), about 2 minutes on 2 cores.
"""

from __future__ import annotations

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

from bench.stats import bootstrap, geomean, load_note  # noqa: E402
from kvpool_connector.connector import KVPoolConnector  # noqa: E402
from kvpool_demo.tinymodel import TINY, make_model  # noqa: E402

LEVELS = (1, 8, 64, 256)
ROUNDS = 10
STEPS = 200
PROMPT_TOKENS = 352
CHUNK = 256
HOOKS = ("build_connector_meta", "update_connector_output")
_seeds = iter(range(1, 1 << 30))


def decode_steps(model: Path, url: str, level: int, connector: bool) -> list[float]:
    """Seconds of each of STEPS decode steps' schedule() and update_from_output(), `level` running."""
    scheduler = sk.make_scheduler(
        model,
        url,
        num_blocks=level * math.ceil((PROMPT_TOKENS + STEPS + 16) / sk.BS) + 16,
        batched=8192,
        prefix_caching=True,
        max_num_seqs=max(LEVELS),
        connector=connector,
        chunk_size=CHUNK,
    )
    try:
        for _ in range(level):
            prompt = sk.prompt(PROMPT_TOKENS, next(_seeds))
            scheduler.add_request(sk.make_request(prompt, max_tokens=STEPS + 16))
        for _ in range(level + 64):  # prefill until every request decodes (8,192 tokens a step)
            so = scheduler.schedule()
            scheduler.update_from_output(so, sk.model_output(scheduler, so))
            if so.total_num_scheduled_tokens == level:
                break
        else:
            raise RuntimeError(f"{level} requests did not all reach decoding")
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


def main() -> None:
    print(f"({load_note()})")
    model = make_model(Path(tempfile.gettempdir()) / "kvpool-models" / "tiny-llama", TINY)
    sidecar = start_sidecar(Path(tempfile.mkdtemp(prefix="kvpool-scheduler-batch-")), "1Gi")
    url = sidecar.info["url"]
    try:
        decode_steps(model, url, 8, True)  # warm up both arms' imports and the sidecar
        decode_steps(model, url, 8, False)
        print(
            f"per decode step, schedule() + update_from_output(), median of {STEPS} steps a scheduler; "
            f"{ROUNDS} pairs a level, order alternating; geometric mean of the pairs' ratios (95% bootstrap)"
        )
        for level in LEVELS:
            alone: list[float] = []
            kvpool: list[float] = []
            for r in range(ROUNDS):
                for connector in (r % 2 == 1, r % 2 == 0):
                    median = statistics.median(decode_steps(model, url, level, connector))
                    (kvpool if connector else alone).append(median)
            ratios = [k / a for k, a in zip(kvpool, alone, strict=True)]
            low, high = bootstrap(ratios, geomean)
            diff = [1e6 * (k - a) for k, a in zip(kvpool, alone, strict=True)]
            print(
                f"  {level:>3} running: vLLM alone {1e6 * statistics.median(alone):7.1f} µs, "
                f"kvpool {1e6 * statistics.median(kvpool):7.1f} µs, kvpool / alone {geomean(ratios):.3f} "
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
    finally:
        sidecar.stop()
    print(f"({load_note()})")
