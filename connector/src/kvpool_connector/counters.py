"""The halves' event counts (the names metrics.STATS declares), added from vLLM's thread and the load and
save threads, taken once a step. Plain Python, so the worker's copy path imports no vLLM."""

from __future__ import annotations

import threading


class Counts:
    def __init__(self) -> None:
        self._data: dict[str, float] = {}
        self._lock = threading.Lock()  # the threads add while vLLM's thread takes

    def add(self, name: str, value: float = 1) -> None:
        with self._lock:
            self._data[name] = self._data.get(name, 0) + value

    def take(self) -> dict[str, float] | None:
        """The counts since the last take, or None when nothing happened (then nothing is sent)."""
        with self._lock:
            out, self._data = self._data, {}
        return {name: value for name, value in out.items() if value} or None
