"""The kopf handlers, registered into a given registry (tests build their own operator from it)."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from kvpool_operator import kube, names, webhook
from kvpool_operator.pool import Pool, parse_pool
from kvpool_operator.reconcile import reconcile
from kvpool_operator.refresh import refresh
from kvpool_operator.settings import OperatorSettings

POOLS = (names.GROUP, names.VERSION, names.PLURAL)
POOL_INDEX = "kvpool_pools"  # the index's name is also the handlers' kwarg


def register(registry: kopf.OperatorRegistry, settings: OperatorSettings) -> None:
    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo:
        return kube.login(**kwargs)

    @kopf.on.startup(registry=registry)
    async def startup(memo: Any, **_: Any) -> None:
        memo.kube = kube.Kube()
        memo.background = set()

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: Any, **_: Any) -> None:
        await memo.kube.close()

    @kopf.index(*POOLS, registry=registry, id=POOL_INDEX)
    def kvpool_pools(namespace: str, name: str, spec: Any, uid: str, **_: Any) -> dict[str, Pool] | None:
        """Pools by namespace, kept in memory for the webhook (it must answer without API calls)."""
        try:
            return {namespace: parse_pool(namespace, name, spec, uid)}
        except ValueError as e:
            logging.getLogger("kvpool.index").warning("pool %s/%s not usable: %s", namespace, name, e)
            return None

    kopf.on.create(*POOLS, registry=registry, id="reconcile")(reconcile)
    kopf.on.update(*POOLS, registry=registry, id="reconcile", field="spec")(reconcile)
    kopf.on.resume(*POOLS, registry=registry, id="reconcile")(reconcile)
    kopf.timer(*POOLS, registry=registry, id="refresh", interval=settings.stats_interval, initial_delay=1.0)(
        refresh
    )

    @kopf.on.mutate(
        "v1", "pods", id=webhook.HANDLER_ID, operations={"CREATE"}, ignore_failures=True, registry=registry
    )
    async def kvpool_inject(**kwargs: Any) -> None:
        # only **kwargs: a handler that kopf cannot call would deny the pod instead of failing open
        try:
            body = kwargs["body"]
            namespace = (body.get("metadata") or {}).get("namespace") or ""
            pools = list(kwargs[POOL_INDEX].get(namespace, []))
            await webhook.inject(
                body, kwargs["patch"], kwargs["warnings"], kwargs["memo"], pools, kwargs.get("dryrun")
            )
        except Exception:
            logging.getLogger("kvpool.webhook").exception("kvpool-inject failed; admitting the pod untouched")
            kwargs["patch"].clear()
