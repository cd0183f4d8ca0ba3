"""What the halves hand each other through vLLM, as vLLM's types: the step's plan (common.StepPlan) and
the workers' save progress."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from .common import StepPlan


@dataclass
class KVPoolMetadata(StepPlan, KVConnectorMetadata):
    """The scheduler -> worker plan of one step, as vLLM carries it."""


@dataclass
class KVPoolSaveProgress(KVConnectorWorkerMetadata):
    """Worker -> scheduler, each step: every save planned at a step <= saved_through has finished (the
    lowest over the ranks), so a lookup needing one of them need not wait for it."""

    saved_through: int

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVPoolSaveProgress)
        return KVPoolSaveProgress(min(self.saved_through, other.saved_through))
