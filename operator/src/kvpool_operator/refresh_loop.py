"""Every --stats-interval seconds, on the leading replica, each pool's refresh (refresh.py) and its
status written. Not a kopf timer: kopf gives every pool with a timer a finalizer, which an operator
uninstalled before its pools leaves behind (pools stuck deleting, namespaces stuck Terminating)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from kvpool_operator import metrics
from kvpool_operator.kube import ApiError
from kvpool_operator.leading import Peering, leading
from kvpool_operator.refresh import refresh
from kvpool_operator.state import OperatorState

FIRST_DELAY = 1.0  # seconds after start: a new replica says what it sees at once
log = logging.getLogger("kvpool.refresh")


async def run(memo: OperatorState) -> None:
    """Until cancelled."""
    peering = memo.peering
    await asyncio.sleep(FIRST_DELAY)
    while True:
        started = asyncio.get_running_loop().time()
        await memo.pool_index.ready.wait()
        bodies = memo.pool_index.bodies()

        def scope(body: Mapping[str, Any]) -> str:  # one peering object for all namespaces, or one each
            return "" if peering.clusterwide else _namespace(body)

        acting = {s for s in {scope(b) for b in bodies} if await _leading(memo, peering, s)}
        ours = [b for b in bodies if scope(b) in acting]
        metrics.keep_pools((_namespace(b), (b.get("metadata") or {}).get("name") or "") for b in ours)
        await asyncio.gather(*(_one(memo, b) for b in ours))
        spent = asyncio.get_running_loop().time() - started
        await asyncio.sleep(max(0.0, memo.settings.stats_interval - spent))


def _namespace(body: Mapping[str, Any]) -> str:
    return (body.get("metadata") or {}).get("namespace") or ""


async def _leading(memo: OperatorState, peering: Peering, namespace: str) -> bool:
    try:
        return await leading(memo.kube, peering, namespace)
    except (ApiError, OSError, TimeoutError) as e:
        log.warning("reading kopf's peering failed (%s): no refresh this round", e)
        return False


async def _one(memo: OperatorState, body: Mapping[str, Any]) -> None:
    meta = body.get("metadata") or {}
    where = f"[{meta.get('namespace')}/{meta.get('name')}]"
    try:
        changed = await refresh(body, memo)
        if changed:
            await memo.kube.patch_status("KVCachePool", meta["namespace"], meta["name"], changed)
        metrics.REFRESHES.labels(outcome="Succeeded").inc()
    except (ApiError, OSError, TimeoutError) as e:
        if isinstance(e, ApiError) and e.gone:
            return  # deleted meanwhile, or its namespace is
        metrics.REFRESHES.labels(outcome="Error").inc()
        log.warning("%s refresh failed (%s); again in %ss", where, e, memo.settings.stats_interval)
    except Exception:
        metrics.REFRESHES.labels(outcome="Error").inc()
        log.exception("%s refresh failed; again next round", where)
