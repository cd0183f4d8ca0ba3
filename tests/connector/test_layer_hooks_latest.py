"""What vLLM's attention layers call on kvpool's connector: through vLLM's own per-layer wrapper
(maybe_transfer_kv_layer), with the real vllm==0.33.0 config, forward context and transfer group."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.vllm_latest

vllm = pytest.importorskip("vllm")
from schedkit import make_scheduler  # noqa: E402
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer  # noqa: E402

from kvpool_connector.common import ChunkOp, SaveSpec  # noqa: E402
from kvpool_connector.connector import KVPoolConnector  # noqa: E402
from kvpool_connector.vllm_types import KVPoolMetadata  # noqa: E402

LAYERS = ["layer0", "layer1"]  # schedkit's KV cache group


@maybe_transfer_kv_layer
def attention(layer_name: str) -> str:  # an attention layer's forward, as vLLM wraps it
    return layer_name


def test_a_cpu_workers_attention_layers_do_not_call_into_the_connector(
    tiny_model, sidecar, monkeypatch
) -> None:
    """On the CPU no layer has work for kvpool (a load lands before the forward, a save reads the
    blocks after it), so vLLM's two calls around each attention layer of each step are not made."""
    url, _ = sidecar
    scheduler = make_scheduler(tiny_model, url)
    config, kv_cache_config = scheduler.vllm_config, scheduler.kv_cache_config
    connector = KVPoolConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    calls: list[str] = []
    monkeypatch.setattr(connector, "wait_for_layer_load", lambda name: calls.append(f"wait {name}"))
    monkeypatch.setattr(connector, "save_kv_layer", lambda name, *a, **k: calls.append(f"save {name}"))
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", connector)
    for name in LAYERS:
        layer = SimpleNamespace(kv_cache=torch.zeros(1))
        monkeypatch.setitem(config.compilation_config.static_forward_context, name, layer)
    save = SaveSpec("r1", 0, [ChunkOp(b"link", 2, [1, 2])])
    try:
        for meta in (KVPoolMetadata(step=1), KVPoolMetadata(step=2, saves=[save])):
            connector.bind_connector_metadata(meta)
            attn: dict[str, Any] = {name: object() for name in LAYERS}
            with set_forward_context(attn, config, slot_mapping={}):
                assert [attention(name) for name in LAYERS] == LAYERS
            connector.clear_connector_metadata()
        assert calls == []
    finally:
        connector.shutdown()
