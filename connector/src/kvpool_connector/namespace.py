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


def stored_groups(kv_cache_config: KVCacheConfig, chunk_size: int) -> list[Any]:
    """The KV cache groups kvpool stores, each under keys of its own: one for most models, one per
    attention kind for hybrid ones under vLLM's hybrid KV cache manager (full attention, sliding
    window, chunked local). ValueError for a model or chunk size it cannot serve (the connector then
    turns itself off: vLLM serves the model without it)."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise ValueError("kvpool: this model has no KV cache")
    if other := [
        type(g.kv_cache_spec).__name__ for g in groups if not isinstance(g.kv_cache_spec, AttentionSpec)
    ]:
        # a Mamba/GDN layer's state is one running value, not per-token pages: loading the attention
        # layers' KV without it would compute on the wrong state
        kinds = ", ".join(sorted(set(other)))
        raise ValueError(
            f"kvpool cannot cache a model with state that is not per-token KV ({kinds}; Mamba and "
            "linear-attention hybrids such as Qwen3-Next, Nemotron-H, Jamba); annotate its pods "
            'kvpool.dev/inject: "false" to run them without a sidecar.'
        )
    block_sizes = {g.kv_cache_spec.block_size for g in groups}
    if len(block_sizes) != 1:
        raise ValueError(
            f"kvpool needs one KV block size for all attention groups, this model has {block_sizes}"
        )
    (block_size,) = block_sizes
    if chunk_size % block_size:
        raise ValueError(f"chunk_size {chunk_size} must be a multiple of the KV block size {block_size}")
    return groups


def tp_replicated(groups: list[Any]) -> bool:
    """Whether every TP rank holds the same KV: MLA's latent KV is computed by replicated layers and
    kept whole on each rank (vLLM's own offloading stores it once too)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return all(isinstance(g.kv_cache_spec, MLAAttentionSpec) for g in groups)


def out_of_window(spec: Any) -> Callable[[int], int] | None:
    """For a group's spec: with n tokens computed, how many tokens from the start vLLM no longer keeps
    (their blocks freed and replaced by the null block; vLLM's get_num_skipped_tokens, without its
    extra retained tokens, so never fewer). None for full attention: it keeps every token."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec

    if isinstance(spec, SlidingWindowSpec):
        window = spec.sliding_window
        return lambda n: max(0, n - window + 1)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        size = spec.attention_chunk_size
        return lambda n: n // size * size
    return None


def _window(spec: Any) -> str:
    """The attention window in the namespace: it changes every layer's KV after the first."""
    window = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None)
    return f":window={window}" if window else ""


def _other_groups(groups: list[Any]) -> str:
    """A hybrid model's groups after the first (each group's chunks hold its own layers' pages)."""
    if len(groups) == 1:
        return ""  # the keys of a one-group model are what they were before hybrid models
    return "".join(
        f"|{type(s).__name__}{_window(s)}:{s.num_kv_heads}x{s.head_size}:{str(s.dtype).removeprefix('torch.')}"
        f"/{len(g.layer_names)}"
        for g in groups
        for s in [g.kv_cache_spec]
    )


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
    groups = stored_groups(kv_cache_config, chunk_size)
    spec = groups[0].kv_cache_spec
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
        layout=f"{type(spec).__name__}:{layout or 'default'}{_window(spec)}{_other_groups(groups)}",
        num_layers=sum(len(g.layer_names) for g in groups),
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
        tp_replicated=tp_replicated(groups),
    )
