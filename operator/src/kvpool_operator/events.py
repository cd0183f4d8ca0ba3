"""Kubernetes events about a pool; posting one never fails the caller."""

from __future__ import annotations

import logging
from typing import Any

from kvpool_operator import names
from kvpool_operator.kube import Kube
from kvpool_operator.pool import Pool

log = logging.getLogger("kvpool.events")


def pool_ref(pool: Pool) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": pool.name, "namespace": pool.namespace, "uid": pool.uid},
    }


async def post(kube: Kube, pool: Pool, type_: str, reason: str, message: str) -> None:
    try:
        await kube.event(pool_ref(pool), type_, reason, message)
    except Exception as e:  # an event is information, never a reason to fail
        log.warning("could not post event %s for %s: %s", reason, pool.key, e)
