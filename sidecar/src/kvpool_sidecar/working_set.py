"""The chunks this sidecar's engine asked for lately, as a HyperLogLog sketch the operator can merge.

The shared Redis tier holds what the pool's pods use. Their arenas summed overstate it by as much as
the pods share (300 pods asking for the same system prompt need it stored once), so each sidecar
sketches the distinct chunk keys its lookups asked for over the last window (every key wanted, hit
or miss: a miss is saved next), and the operator merges the sketches register by register into the
pool's distinct count. 4,096 one-byte registers: about 1.6% standard error, 4 KiB whatever the traffic.
Two sketches rotate every `window` seconds, so what is reported covers the last one to two windows.
"""

from __future__ import annotations

import base64
import math
import threading
import time
from collections.abc import Callable, Iterable

PRECISION = 12
REGISTERS = 1 << PRECISION
_REST = 64 - PRECISION
_LOW = (1 << _REST) - 1  # a hash's bits below the register index
WINDOW_SECONDS = 1800.0


def _alpha(m: int) -> float:
    return 0.7213 / (1 + 1.079 / m)


def estimate(registers: bytes | bytearray) -> float:
    """The distinct count of a sketch (HyperLogLog with linear counting for small counts)."""
    m = len(registers)
    raw = _alpha(m) * m * m / sum(2.0**-r for r in registers)
    zeros = registers.count(0)
    if raw <= 2.5 * m and zeros:
        return m * math.log(m / zeros)
    return raw


def merge(sketches: Iterable[bytes | bytearray]) -> bytearray:
    """The sketch of the union: each register's largest value."""
    out = bytearray(REGISTERS)
    for sketch in sketches:
        if len(sketch) != REGISTERS:
            raise ValueError(f"a sketch has {len(sketch)} registers, not {REGISTERS}")
        out = bytearray(map(max, out, sketch))
    return out


def encode(registers: bytes | bytearray) -> str:
    return base64.b64encode(bytes(registers)).decode()


def decode(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


class WorkingSet:
    """Thread-safe: the store calls `looked_up` outside its own lock."""

    def __init__(self, window: float = WINDOW_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self._clock = clock
        self._current = bytearray(REGISTERS)
        self._previous = bytearray(REGISTERS)
        self._started = clock()
        self._lock = threading.Lock()

    def looked_up(self, hashes: Iterable[int]) -> None:
        """A lookup's keys, as miss_ratio.key_hashes."""
        with self._lock:
            self._rotate()
            registers = self._current
            for h in hashes:
                rank = _REST - (h & _LOW).bit_length() + 1
                i = h >> _REST
                if rank > registers[i]:
                    registers[i] = rank

    def _rotate(self) -> None:
        elapsed = self._clock() - self._started
        if elapsed >= self.window:
            # after two windows of silence the last one saw nothing either
            self._previous = self._current if elapsed < 2 * self.window else bytearray(REGISTERS)
            self._current = bytearray(REGISTERS)
            self._started = self._clock()

    def sketch(self) -> bytearray:
        """The last one to two windows' keys."""
        with self._lock:
            self._rotate()
            return merge([self._current, self._previous])

    def snapshot(self) -> dict[str, object]:
        """For /stats: the distinct chunks looked up lately, and the sketch to merge with other pods'."""
        sketch = self.sketch()
        return {"chunks": round(estimate(sketch)), "window_seconds": self.window, "sketch": encode(sketch)}
