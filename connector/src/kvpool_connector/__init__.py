"""kvpool's vLLM KV connector. `KVPoolConnector` is imported on first use, so `kvpool_connector.config`
and the key functions stay importable without torch or vLLM (the operator's tests use them)."""

from __future__ import annotations

from typing import Any

__all__ = ["KVPoolConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVPoolConnector":
        from .connector import KVPoolConnector

        return KVPoolConnector
    raise AttributeError(name)
