"""The one function that builds the connector configuration a pool's pods run with.

Its JSON goes into the vLLM container's `--kv-transfer-config`, the pool's ConfigMap and
`status.connectorConfig`; the connector reads `kv_connector_extra_config` with
`kvpool_connector.config.load_config` (a test crosses the two).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kvpool_operator.names import ARENA_DIR
from kvpool_operator.pool import Pool


def kv_transfer_config(pool: Pool) -> tuple[dict[str, Any], list[str]]:
    """The `--kv-transfer-config` object, and a warning per extraConfig key the pool's own keys override."""
    own: dict[str, Any] = {
        "sidecar_url": f"http://127.0.0.1:{pool.sidecar_port}",
        "shm_path": ARENA_DIR,
        "chunk_size": pool.chunk_size,
        "save_decode_cache": pool.save_decode_cache,
        "skip_last_n_tokens": pool.skip_last_n_tokens,
        "discard_partial_chunks": pool.discard_partial_chunks,
        "pool": pool.key,
    }
    if pool.priority_limit is not None:
        own["priority_limit"] = pool.priority_limit
    overridden = sorted(k for k in pool.extra_config if k in own)
    warnings = [
        f"spec.extraConfig.{k} is ignored: the pool sets {k}={json.dumps(own[k])} itself" for k in overridden
    ]
    config = {
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {**pool.extra_config, **own},
    }
    return config, warnings


def render(config: dict[str, Any]) -> str:
    """The exact text injected: compact and key-sorted, so equal configs are equal strings."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def config_hash(text: str) -> str:
    """Short digest of the rendered config, stamped on injected pods to tell outdated ones."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]
