"""engine_namespace, the one function that names what a chunk's bytes depend on, built from real
vllm==0.33.0 configurations: each input changes it, and replaced weights at the same path do too."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm_latest

vllm = pytest.importorskip("vllm")
import torch  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402

from kvpool_connector.keys import Namespace  # noqa: E402
from kvpool_connector.namespace import engine_namespace  # noqa: E402
from kvpool_demo.tinymodel import TINY, make_model  # noqa: E402

KV = KVCacheConfig(
    num_blocks=16,
    kv_cache_tensors=[],
    kv_cache_groups=[
        KVCacheGroupSpec(
            ["layer0", "layer1"],
            FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16),
        )
    ],
)


def namespace(model: Path, pinned: str | None = None, **kw: Any) -> Namespace:
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model), dtype="float16", seed=42, hf_overrides=kw.pop("hf_overrides", {})
        ),
        parallel_config=ParallelConfig(**kw.pop("parallel", {})),
        cache_config=CacheConfig(block_size=16, cache_dtype=kw.pop("cache_dtype", "auto")),
        device_config=DeviceConfig("cpu"),
    )
    assert not kw
    return engine_namespace(config, KV, 32, pinned)


def test_each_engine_input_changes_the_namespace(tiny_model: Path) -> None:
    base = namespace(tiny_model)
    assert base.weights.startswith("files:") and namespace(tiny_model) == base  # stable
    variants: dict[str, dict[str, Any]] = {
        "pp_size": {"parallel": {"pipeline_parallel_size": 2}},
        "dcp_size": {"parallel": {"tensor_parallel_size": 4, "decode_context_parallel_size": 2}},
        "kv_cache_dtype": {"cache_dtype": "fp8_e4m3"},
        "overrides": {"hf_overrides": {"rope_theta": 5000.0}},
    }
    for field, kw in variants.items():
        other = namespace(tiny_model, **kw)
        assert getattr(other, field) != getattr(base, field), field
        assert other.seed() != base.seed(), field
    pinned = namespace(tiny_model, pinned="registry/model@sha256:abc")
    assert pinned.weights == "pinned:registry/model@sha256:abc" and pinned.seed() != base.seed()


def test_new_weights_at_the_same_path_change_the_namespace(tmp_path: Path, tiny_model: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    before = namespace(model)
    make_model(model, TINY, seed=1)  # same config, same file names and sizes, new values
    after = namespace(model)
    assert after.weights != before.weights and after.seed() != before.seed()
    assert {**vars(after), "weights": ""} == {**vars(before), "weights": ""}
