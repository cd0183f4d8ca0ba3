"""Timing helpers shared by the benchmarks: medians with ranges, ratios to a baseline of the same run."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Rate:
    """Throughput over repetitions, GB/s (10^9 bytes, each byte counted once)."""

    median: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.median:6.2f} GB/s [{self.low:.2f}-{self.high:.2f}]"


def rate(
    nbytes: int, run: Callable[[], object], repeat: int = 7, setup: Callable[[], object] | None = None
) -> Rate:
    """Runs `run` `repeat` times (after one warm-up), `setup` untimed before each."""
    rates = []
    for i in range(repeat + 1):
        if setup is not None:
            setup()
        t = time.perf_counter()
        run()
        dt = time.perf_counter() - t
        if i:
            rates.append(nbytes / dt / 1e9)
    return Rate(statistics.median(rates), min(rates), max(rates))


def latencies_ms(run: Callable[[], object], n: int) -> tuple[float, float]:
    """(p50, p99) in milliseconds over n calls after 50 warm-up calls."""
    for _ in range(50):
        run()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        run()
        out.append((time.perf_counter() - t) * 1e3)
    out.sort()
    return out[len(out) // 2], out[min(len(out) - 1, int(len(out) * 0.99))]


def memcpy_rate(nbytes: int, repeat: int = 7) -> Rate:
    """The baseline: one copy of nbytes between two buffers, out of cache (4 sources rotated)."""
    sources = [np.frombuffer(os.urandom(1024), dtype=np.uint8).repeat(nbytes // 1024) for _ in range(4)]
    dst = np.empty(nbytes, dtype=np.uint8)
    it = iter(range(10**9))
    return rate(nbytes, lambda: np.copyto(dst, sources[next(it) % len(sources)]), repeat)


def ratio(x: Rate, base: Rate) -> str:
    return f"{x.median / base.median:5.2f}x memcpy"


def load_note() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min) {five:.2f} (5 min) on {os.cpu_count()} cores"
