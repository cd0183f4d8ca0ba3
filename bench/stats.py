"""Timing helpers shared by the benchmarks: medians with ranges, ratios to a baseline of the same run."""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def pct(xs: list[float], q: float) -> float:
    """The sample at quantile q (nearest rank): with few samples, p99 is the slowest one."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def bootstrap(
    items: Sequence[T], stat: Callable[[list[T]], float], n: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """A 95% interval of stat(items), resampling the items with replacement."""
    rng = random.Random(seed)
    values = sorted(stat(rng.choices(items, k=len(items))) for _ in range(n))
    return values[int(0.025 * n)], values[int(0.975 * n)]


def geomean(xs: list[float]) -> float:
    """The geometric mean: the mean of ratios to a baseline."""
    return math.exp(statistics.fmean(math.log(x) for x in xs))


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))


@dataclass(frozen=True)
class Compared:
    """A path's throughput and the memcpy of the same bytes, timed alternately in the same run."""

    rate: Spread  # GB/s (10^9 bytes, each byte counted once)
    memcpy: Spread  # GB/s
    ratio: Spread  # rate / memcpy, per repetition

    def __str__(self) -> str:
        r, m, q = self.rate, self.memcpy, self.ratio
        return (
            f"{r.median:6.2f} GB/s [{r.low:.2f}-{r.high:.2f}]  = {q.median:4.2f}x memcpy "
            f"[{q.low:.2f}-{q.high:.2f}]  (memcpy {m.median:.2f} [{m.low:.2f}-{m.high:.2f}])"
        )


class Memcpy:
    """The baseline: one copy of nbytes between two buffers, out of cache (4 sources rotated)."""

    def __init__(self, nbytes: int) -> None:
        self.sources = [
            np.frombuffer(os.urandom(1024), dtype=np.uint8).repeat(nbytes // 1024) for _ in range(4)
        ]
        self.dst = np.empty(nbytes, dtype=np.uint8)
        self.i = 0

    def __call__(self) -> None:
        self.i += 1
        np.copyto(self.dst, self.sources[self.i % len(self.sources)])


def _timed(run: Callable[[], object]) -> float:
    t = time.perf_counter()
    run()
    return time.perf_counter() - t


def compare(
    nbytes: int, run: Callable[[], object], setup: Callable[[], object] | None = None, repeat: int = 7
) -> Compared:
    """Times `run` and a memcpy of nbytes alternately, `repeat` times after one warm-up of each;
    `setup` runs untimed before each `run`. Alternating keeps the ratio honest on a busy machine."""
    memcpy = Memcpy(nbytes)
    rates, bases, ratios = [], [], []
    for i in range(repeat + 1):
        base = nbytes / _timed(memcpy) / 1e9
        if setup is not None:
            setup()
        rate = nbytes / _timed(run) / 1e9
        if i:
            rates.append(rate)
            bases.append(base)
            ratios.append(rate / base)
    return Compared(Spread.of(rates), Spread.of(bases), Spread.of(ratios))


def latencies_ms(run: Callable[[], object], n: int) -> tuple[float, float]:
    """(p50, p99) in milliseconds over n calls after 50 warm-up calls."""
    for _ in range(50):
        run()
    out = sorted(_timed(run) * 1e3 for _ in range(n))
    return out[len(out) // 2], out[min(len(out) - 1, int(len(out) * 0.99))]


def load_note() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min) {five:.2f} (5 min) on {os.cpu_count()} cores"
