"""A circuit breaker for sidecar calls on the engine's critical path (the scheduler's lookups, the
workers' saves at the end of a step): once a call has waited out its timeout, the sidecar is hung or
overloaded, and the calls of the next BREAKER_SECONDS are skipped instead of each waiting again. A
hung sidecar then costs the engine one timeout per BREAKER_SECONDS, not one per step."""

from __future__ import annotations

import time
from collections.abc import Callable

BREAKER_SECONDS = 5.0


class Breaker:
    def __init__(self, clock: Callable[[], float] = time.monotonic, seconds: float = BREAKER_SECONDS) -> None:
        self._clock = clock
        self.seconds = seconds
        self._until = 0.0

    def trip(self) -> None:
        self._until = self._clock() + self.seconds

    @property
    def open(self) -> bool:
        return self._clock() < self._until
