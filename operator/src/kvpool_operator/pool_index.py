"""Every usable pool of the watched namespaces, for the webhook, kept by every replica.

kopf's own watches pause on a replica that is not the leader (peering), so an index built by kopf is
empty on a standby, and a pod sent to that replica would get no cache. This index follows the pools
with a list and watch of its own that never pauses; `ready` is set once every watched scope has been
listed, and the operator's readiness endpoint reports it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

from kvpool_operator.kube import ApiError, Kube
from kvpool_operator.pods import not_starting
from kvpool_operator.pool import Pool, parse_pool
from kvpool_operator.vllm_breaker import blocked_images

RETRY_DELAY = 2.0  # seconds before a failed list or watch is tried again
log = logging.getLogger("kvpool.index")


class PoolIndex:
    def __init__(self) -> None:
        self._pools: dict[str, dict[str, Pool]] = {}  # namespace -> name -> pool
        self._bodies: dict[str, dict[str, dict[str, Any]]] = {}  # and the objects as last seen
        self._listed: set[str | None] = set()
        self.ready = asyncio.Event()

    def in_namespace(self, namespace: str) -> list[Pool]:
        return list(self._pools.get(namespace, {}).values())

    def bodies(self) -> list[dict[str, Any]]:
        """Every usable pool as the API server last sent it (status included), for the refresh loop."""
        return [body for pools in self._bodies.values() for body in pools.values()]

    async def run(self, kube: Kube, namespaces: Iterable[str]) -> None:
        """Follows the pools of `namespaces` (all namespaces when empty) until cancelled."""
        scopes: list[str | None] = list(namespaces) or [None]
        await asyncio.gather(*(self._follow(kube, scope, len(scopes)) for scope in scopes))

    async def _follow(self, kube: Kube, namespace: str | None, scopes: int) -> None:
        while True:
            try:
                items, version = await kube.list_objects("KVCachePool", namespace)
                self._replace(namespace, items)
                self._listed.add(namespace)
                if len(self._listed) == scopes:
                    self.ready.set()
                async for event in kube.watch("KVCachePool", namespace, version):
                    if event.get("type") == "ERROR":  # e.g. 410 Gone: list again
                        break
                    self._apply(event.get("type", ""), event.get("object") or {})
            except asyncio.CancelledError:
                raise
            except (TimeoutError, ApiError, OSError, ValueError) as e:
                log.warning(
                    "following pools in %s failed (%s); again in %ss", namespace or "all", e, RETRY_DELAY
                )
                await asyncio.sleep(RETRY_DELAY)

    def _replace(self, namespace: str | None, items: list[dict[str, Any]]) -> None:
        if namespace is None:
            self._pools.clear()
            self._bodies.clear()
        else:
            self._pools.pop(namespace, None)
            self._bodies.pop(namespace, None)
        for item in items:
            self._apply("ADDED", item)

    def _apply(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        namespace, name = meta.get("namespace", ""), meta.get("name", "")
        pools = self._pools.setdefault(namespace, {})
        bodies = self._bodies.setdefault(namespace, {})
        if kind == "DELETED":
            pools.pop(name, None)
            bodies.pop(name, None)
            return
        if kind not in ("ADDED", "MODIFIED"):
            return  # BOOKMARK
        try:
            pool = parse_pool(namespace, name, obj.get("spec") or {}, meta.get("uid"))
            pools[name] = dataclasses.replace(
                pool, sidecar_not_starting=not_starting(obj), vllm_failing=blocked_images(obj)
            )
            bodies[name] = obj
        except ValueError as e:
            pools.pop(name, None)
            bodies.pop(name, None)
            log.warning("pool %s/%s not usable: %s", namespace, name, e)
