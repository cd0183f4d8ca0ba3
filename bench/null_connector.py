"""The least a KV connector can cost in vLLM: one that does nothing, as cheaply as vLLM lets it.

vLLM runs its connector path on every step of an engine that has any connector: the metadata built
and bound, the worker's hooks around the forward, the per-layer check in the attention wrapper, the
KVConnectorOutput it hands back. This connector answers every one of those calls with nothing (no
match, no save, no per-layer work: has_connector_metadata is False), so a server running it against
vLLM alone measures what vLLM charges for having a connector at all, and kvpool against it what
kvpool adds of its own (#24's throughput target at concurrency 1).
Loaded by module path (`bench.null_connector`) from the repository root.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

if TYPE_CHECKING:
    import torch
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

SPEC = {"name": "NullConnector", "module": "bench.null_connector"}


class NullConnector(KVConnectorBase_V1):
    def has_connector_metadata(self) -> bool:
        return False  # no layer has work: the attention wrapper skips its two calls, as kvpool's does

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()
