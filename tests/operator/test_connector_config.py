"""The connector configuration the operator writes, read by the connector's own loader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvtest import REPO

from kvpool_connector.config import KVPoolConfig, load_config
from kvpool_operator.connector_config import config_hash, kv_transfer_config, render
from kvpool_operator.pool import parse_pool


def pool_of(spec: dict[str, Any], crd: dict[str, Any], name: str = "llama") -> Any:
    """The pool as the operator reads it (its defaults equal the API server's: tests/k8s)."""
    del crd
    return parse_pool("team", name, {"selector": {"matchLabels": {"a": "b"}}, **spec})


@pytest.mark.parametrize("example", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.stem)
def test_connector_loads_the_operators_config_without_warnings(crd: dict[str, Any], example: Path) -> None:
    doc = yaml.safe_load(example.read_text())
    config, warnings = kv_transfer_config(pool_of(doc["spec"], crd, doc["metadata"]["name"]))
    assert warnings == []
    parsed = json.loads(render(config))  # exactly what the vLLM container gets
    loaded, unknown = load_config(parsed["kv_connector_extra_config"])
    assert unknown == []
    assert loaded.pool == f"team/{doc['metadata']['name']}"
    assert loaded.shm_path == "/var/run/kvpool"
    assert loaded.chunk_size == doc["spec"].get("chunkSize", 256)
    assert loaded.priority_limit == doc["spec"].get("priorityLimit")


def test_every_pool_setting_reaches_the_connector(crd: dict[str, Any]) -> None:
    spec = {
        "chunkSize": 512,
        "priorityLimit": 2,
        "saveDecodeCache": True,
        "skipLastNTokens": 3,
        "discardPartialChunks": True,
        "sidecar": {"port": 9000},
        "extraConfig": {"timeout_ms": 250},
    }
    config, warnings = kv_transfer_config(pool_of(spec, crd))
    assert warnings == []
    assert {
        k: config[k]
        for k in ("kv_connector", "kv_connector_module_path", "kv_role", "kv_load_failure_policy")
    } == {
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
    }
    loaded, unknown = load_config(config["kv_connector_extra_config"])
    assert unknown == []
    assert loaded == KVPoolConfig(
        sidecar_url="http://127.0.0.1:9000",
        shm_path="/var/run/kvpool",
        chunk_size=512,
        priority_limit=2,
        save_decode_cache=True,
        skip_last_n_tokens=3,
        discard_partial_chunks=True,
        timeout_ms=250,
        pool="team/llama",
    )


def test_priority_limit_only_when_set(crd: dict[str, Any]) -> None:
    config, _ = kv_transfer_config(pool_of({}, crd))
    assert "priority_limit" not in config["kv_connector_extra_config"]


def test_pool_keys_win_over_extra_config_with_a_warning(crd: dict[str, Any]) -> None:
    config, warnings = kv_transfer_config(pool_of({"chunkSize": 128, "extraConfig": {"chunk_size": 64}}, crd))
    assert config["kv_connector_extra_config"]["chunk_size"] == 128
    assert len(warnings) == 1 and "spec.extraConfig.chunk_size" in warnings[0]


def test_render_is_canonical(crd: dict[str, Any]) -> None:
    a = render(kv_transfer_config(pool_of({"extraConfig": {"b": 1, "a": 2}}, crd))[0])
    b = render(kv_transfer_config(pool_of({"extraConfig": {"a": 2, "b": 1}}, crd))[0])
    assert a == b and config_hash(a) == config_hash(b)
    assert config_hash(a) != config_hash(render(kv_transfer_config(pool_of({"chunkSize": 128}, crd))[0]))
