"""Warnings (and caught errors) that a failing cache would otherwise repeat on every engine step."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any


class RateLimitedLog:
    """One message per kind per `interval` seconds; the next one says how many were held back. A line
    names the caller's file and line, not this one's."""

    def __init__(
        self, logger: logging.Logger, interval: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._log = logger
        self._interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: Any) -> None:
        self._emit(kind, logging.WARNING, msg, args, exc_info=False)

    def exception(self, kind: str, msg: str, *args: Any) -> None:
        """An error with the traceback being handled (a bug caught so that a request only recomputes)."""
        self._emit(kind, logging.ERROR, msg, args, exc_info=True)

    def _emit(self, kind: str, level: int, msg: str, args: tuple[Any, ...], exc_info: bool) -> None:
        now = self._clock()
        with self._lock:
            if now - self._last.get(kind, -self._interval) < self._interval:
                self._held[kind] = self._held.get(kind, 0) + 1
                return
            self._last[kind] = now
            held = self._held.pop(kind, 0)
        if held:
            msg += " (and %d more like it since the last report)"
            args = (*args, held)
        self._log.log(level, msg, *args, exc_info=exc_info, stacklevel=3)
