"""The chunk namespace of an engine, computed the same way on the scheduler and on every worker."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def attention_groups(kv_cache_config: KVCacheConfig) -> list:
    """The KV cache groups kvpool stores (attention layers; other kinds of state are not chunked)."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    return [g for g in kv_cache_config.kv_cache_groups if isinstance(g.kv_cache_spec, AttentionSpec)]


def layer_names(kv_cache_config: KVCacheConfig) -> list[str]:
    return [name for g in attention_groups(kv_cache_config) for name in g.layer_names]


def engine_namespace(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, chunk_size: int) -> Namespace:
    groups = attention_groups(kv_cache_config)
    if len(groups) != 1:
        raise ValueError(
            f"kvpool supports models with one attention KV cache group, this one has {len(groups)}"
        )
    spec = groups[0].kv_cache_spec
    if chunk_size % spec.block_size:
        raise ValueError(f"chunk_size {chunk_size} must be a multiple of the KV block size {spec.block_size}")
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        vllm_config.cache_config, "kv_cache_layout", None
    )
    return Namespace(
        model=str(vllm_config.model_config.model),
        dtype=str(spec.dtype).removeprefix("torch."),
        layout=f"{type(spec).__name__}:{layout or 'default'}",
        num_layers=len(groups[0].layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        block_size=spec.block_size,
        chunk_size=chunk_size,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
    )
