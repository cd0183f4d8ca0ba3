"""Connector counters, reported through vLLM's KVConnectorStats (summed across workers and steps)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = (
    "lookups",  # scheduler: lookup round trips
    "lookup_errors",  # scheduler: lookups that failed or timed out (counted as misses)
    "lookups_skipped",  # scheduler: lookups not asked while the breaker was open (counted as misses)
    "hit_tokens",  # scheduler: tokens offered to vLLM from the sidecar
    "unkeyable_requests",  # scheduler: requests with an input kvpool cannot key (not loaded or saved)
    "loaded_chunks",
    "loaded_bytes",
    "load_seconds",
    "load_failed_blocks",  # blocks reported through get_block_ids_with_load_errors
    "corrupt_chunks",  # loaded chunks whose bytes failed their checksum (recomputed)
    "saved_chunks",
    "saved_bytes",
    "save_seconds",
    "save_skipped_chunks",  # already stored, no room, or sidecar unreachable
    "save_refused_chunks",  # commits refused: the reservation was no longer this writer's
    "sidecar_errors",  # worker: failed sidecar calls
)


@dataclass
class KVPoolStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def add(self, name: str, value: float = 1) -> None:
        self.data[name] = self.data.get(name, 0) + value

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVPoolStats:
        for name, value in other.data.items():
            self.add(name, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: round(v, 6) if isinstance(v, float) else v for name, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def take(self) -> KVPoolStats | None:
        """The counters since the last take, or None when nothing happened (then nothing is sent)."""
        if self.is_empty():
            return None
        out = KVPoolStats(data=dict(self.data))
        self.reset()
        return out


def build_stats(data: dict[str, Any] | None) -> KVPoolStats:
    return KVPoolStats(data=dict(data or {}))
