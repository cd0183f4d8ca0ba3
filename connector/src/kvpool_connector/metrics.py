"""Connector statistics, declared once (STATS): reported through vLLM's KVConnectorStats (summed across
workers and steps, logged by vLLM as "KV Transfer metrics") and published on vLLM's own /metrics as
Prometheus metrics (KVPoolPromMetrics, named vllm:kvpool_<name>_total like vLLM's own connectors')."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats


@dataclass(frozen=True)
class Stat:
    """One connector statistic. Every one is a count of what happened since the last report, which
    vLLM sums over workers and steps: a Prometheus counter."""

    name: str
    help: str
    kind: Literal["counter"] = "counter"

    @property
    def prom_name(self) -> str:
        return f"vllm:kvpool_{self.name}_total"


STATS = (
    Stat("lookups", "Lookups from vLLM's scheduler to the kvpool sidecar (one round trip each)"),
    Stat(
        "tail_lookups",
        "Second round trips of lookups: a missed chunk's shorter tails, asked again where the first "
        "round trip guessed another miss (or where windowed layers need their own keys)",
    ),
    Stat("lookup_errors", "Lookups that failed or timed out (counted as misses)"),
    Stat("lookups_skipped", "Lookups not asked while the lookup breaker was open (counted as misses)"),
    Stat("lookups_deferred", "Lookups put off a step: this engine's save of a chunk they need was running"),
    Stat("lookup_seconds", "Seconds the scheduler spent in lookups, round trips to the sidecar included"),
    Stat("lookups_reused", "Lookups of a waiting request answered with its last answer (no round trip)"),
    Stat(
        "lookups_sent_on_arrival",
        "Lookups sent when vLLM received the request and answered before schedule() asked (the round "
        "trip off the scheduler)",
    ),
    Stat(
        "lookups_sent_in_turn",
        "Lookups of a burst of arrivals past the 32 sent on arrival, sent as those before them were "
        "read (as a step ended, or when schedule() reached the burst)",
    ),
    Stat(
        "lookups_guessed_again",
        "Lookups sent ahead whose answer, read ahead (as a step ended, or before another lookup's second "
        "round trip), found the prefix ending at another chunk than the one whose tails they asked: that "
        "chunk's tails asked ahead, alone, and read in schedule()",
    ),
    Stat(
        "lookups_renewed",
        "Lookups of a waiting request whose last answer aged out, sent at a step's end and read in the "
        "next schedule() (the round trip off the scheduler)",
    ),
    Stat("hit_tokens", "Prompt tokens offered to vLLM from the kvpool sidecar (loaded, not computed)"),
    Stat("unkeyable_requests", "Requests with an input kvpool cannot key (neither loaded nor saved)"),
    Stat("loaded_chunks", "Chunks loaded from the kvpool sidecar into vLLM's KV cache"),
    Stat("loaded_bytes", "Bytes loaded from the kvpool sidecar into vLLM's KV cache"),
    Stat("load_seconds", "Seconds spent loading chunks (per load, summed)"),
    Stat("load_failed_blocks", "KV blocks whose load failed and were recomputed"),
    Stat("corrupt_chunks", "Loaded chunks whose bytes failed their checksum (recomputed, dropped)"),
    Stat("failed_load_requests", "Requests whose load failed: recomputed, never offered a hit again"),
    Stat("saved_chunks", "Chunks saved into the kvpool sidecar"),
    Stat("saved_bytes", "Bytes saved into the kvpool sidecar"),
    Stat("save_seconds", "Seconds the save thread spent saving chunks (per step, summed; off the step)"),
    Stat("save_fenced_chunks", "Chunks not saved: vLLM reused their blocks before a slow sidecar took them"),
    Stat("save_fence_seconds", "Seconds vLLM's steps waited, before running, for saves of blocks they reuse"),
    Stat("save_skipped_chunks", "Chunks not saved: stored already, no room, or the sidecar unreachable"),
    Stat("save_refused_chunks", "Chunk commits the sidecar refused (the reservation had expired)"),
    Stat("sidecar_errors", "Failed calls from vLLM's workers to the kvpool sidecar"),
)
COUNTERS = tuple(s.name for s in STATS)


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


def build_stats(data: dict[str, Any] | None) -> KVPoolStats:
    return KVPoolStats(data=dict(data or {}))


class KVPoolPromMetrics(KVConnectorPromMetrics):
    """STATS as Prometheus metrics on vLLM's /metrics, with vLLM's labels (model_name, engine).
    observe() gets each step's KVPoolStats payload: counts since the last one, added to the counters."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        classes = {"counter": self._counter_cls}
        self._children: dict[int, dict[str, Any]] = {idx: {} for idx in per_engine_labelvalues}
        for stat in STATS:
            metric = classes[stat.kind](name=stat.prom_name, documentation=stat.help, labelnames=labelnames)
            for idx, values in per_engine_labelvalues.items():
                self._children[idx][stat.name] = metric.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        children = self._children.get(engine_idx, {})
        for name, value in transfer_stats_data.items():
            child = children.get(name)  # a name this version does not know (a newer worker's): skipped
            if child is not None and isinstance(value, int | float) and value > 0:
                child.inc(value)
