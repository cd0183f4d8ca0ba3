"""The chunk namespace of an engine: everything in its configuration that changes a chunk's bytes."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .keys import Namespace
from .model_identity import model_weights_identity

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def attention_groups(kv_cache_config: KVCacheConfig) -> list:
    """The KV cache groups kvpool stores (attention layers; other kinds of state are not chunked)."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    return [g for g in kv_cache_config.kv_cache_groups if isinstance(g.kv_cache_spec, AttentionSpec)]


def layer_names(kv_cache_config: KVCacheConfig) -> list[str]:
    return [name for g in attention_groups(kv_cache_config) for name in g.layer_names]


def stored_group(kv_cache_config: KVCacheConfig, chunk_size: int) -> Any:
    """The one attention group kvpool stores; ValueError for a model or chunk size it cannot serve."""
    groups = attention_groups(kv_cache_config)
    if len(groups) != 1:
        raise ValueError(
            f"kvpool supports models with one attention KV cache group, this one has {len(groups)}"
        )
    block_size = groups[0].kv_cache_spec.block_size
    if chunk_size % block_size:
        raise ValueError(f"chunk_size {chunk_size} must be a multiple of the KV block size {block_size}")
    return groups[0]


def out_of_window(spec: Any) -> Callable[[int], int]:
    """For a group's spec: with n tokens computed, how many tokens from the start vLLM no longer keeps
    (their blocks freed and replaced by the null block; vLLM's get_num_skipped_tokens, without its
    extra retained tokens, so never fewer). 0 for full attention."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec

    if isinstance(spec, SlidingWindowSpec):
        window = spec.sliding_window
        return lambda n: max(0, n - window + 1)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        size = spec.attention_chunk_size
        return lambda n: n // size * size
    return lambda n: 0


def _window(spec: Any) -> str:
    """The attention window in the namespace: it changes every layer's KV after the first."""
    window = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None)
    return f":window={window}" if window else ""


def _canonical(value: Any) -> str:
    """Canonical JSON of a config value ("" for none); callables by their qualified name."""
    if not value:
        return ""
    if callable(value):
        return f"callable:{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', repr(value))}"
    return json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))


def engine_namespace(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    chunk_size: int,
    pinned_weights: str | None = None,
) -> Namespace:
    """The one place the namespace is computed: everything in the engine's configuration that changes
    a chunk's bytes (the model's weights, read once here, included). The scheduler's job: workers
    get chain links, never the namespace."""
    group = stored_group(kv_cache_config, chunk_size)
    spec = group.kv_cache_spec
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        vllm_config.cache_config, "kv_cache_layout", None
    )
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    kv_dtype = str(cache.cache_dtype)
    if skipped := getattr(cache, "kv_cache_dtype_skip_layers", None):
        kv_dtype += f":skip={_canonical(skipped)}"
    return Namespace(
        model=str(model.model),
        dtype=str(spec.dtype).removeprefix("torch."),
        layout=f"{type(spec).__name__}:{layout or 'default'}{_window(spec)}",
        num_layers=len(group.layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        block_size=spec.block_size,
        chunk_size=chunk_size,
        tp_size=parallel.tensor_parallel_size,
        pp_size=parallel.pipeline_parallel_size,
        # context parallelism shards a block's tokens across ranks: the size changes what a rank holds
        dcp_size=parallel.decode_context_parallel_size,
        pcp_size=getattr(parallel, "prefill_context_parallel_size", 1),
        kv_cache_dtype=kv_dtype,
        quantization=str(model.quantization or ""),
        weights=model_weights_identity(model, pinned_weights, vllm_config.load_config.download_dir),
        overrides=_canonical(model.hf_overrides),
    )
