"""Whether a running pod carries what its pool would inject now."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpool_operator import names
from kvpool_operator.injection import inject
from kvpool_operator.pool import Pool
from kvpool_operator.settings import OperatorSettings


def outdated(pod: Mapping[str, Any], pool: Pool, settings: OperatorSettings) -> bool:
    """Injecting the pod again (which first removes the earlier injection) would change it: its
    kvpool.dev/config-hash, a digest of all that inject adds, differs from what it would get now."""
    try:
        now = inject(pod, pool, settings)
    except ValueError:  # the pool would no longer find its vLLM container
        return True
    return _hash(pod) != _hash(now)


def _hash(pod: Mapping[str, Any]) -> str | None:
    return ((pod.get("metadata") or {}).get("annotations") or {}).get(names.CONFIG_HASH_ANNOTATION)
