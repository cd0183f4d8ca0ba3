"""The kopf handlers, registered into a given registry (tests build their own operator from it)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from kvpool_operator import kube, names, readiness, refresh_loop, webhook
from kvpool_operator.pool_index import PoolIndex
from kvpool_operator.reconcile import reconcile
from kvpool_operator.settings import OperatorSettings
from kvpool_operator.skip_events import SkipEvents
from kvpool_operator.state import OperatorState

POOLS = (names.GROUP, names.VERSION, names.PLURAL)


def register(registry: kopf.OperatorRegistry, settings: OperatorSettings) -> None:
    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo:
        return kube.login(**kwargs)

    @kopf.on.startup(registry=registry)
    async def startup(memo: OperatorState, **_: Any) -> None:
        memo.kube = kube.Kube()
        memo.skip_events = SkipEvents(memo.kube)
        memo.pool_index = PoolIndex()
        memo.index_task = asyncio.create_task(memo.pool_index.run(memo.kube, settings.namespaces))
        memo.probes = await readiness.serve(settings.readiness, settings.liveness, memo.pool_index.ready)
        memo.refresh_task = asyncio.create_task(refresh_loop.run(memo))

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: OperatorState, **_: Any) -> None:
        memo.index_task.cancel()
        memo.refresh_task.cancel()
        for runner in memo.probes:
            await runner.cleanup()
        await memo.kube.close()

    kopf.on.create(*POOLS, registry=registry, id="reconcile")(reconcile)
    kopf.on.update(*POOLS, registry=registry, id="reconcile", field="spec")(reconcile)
    kopf.on.resume(*POOLS, registry=registry, id="reconcile")(reconcile)
    # the status refresh is refresh_loop.run, started above: a kopf timer would finalize every pool

    @kopf.on.mutate(
        "v1", "pods", id=webhook.HANDLER_ID, operations={"CREATE"}, ignore_failures=True, registry=registry
    )
    async def kvpool_inject(**kwargs: Any) -> None:
        # only **kwargs: a handler that kopf cannot call would deny the pod instead of failing open
        try:
            body = kwargs["body"]
            namespace = (body.get("metadata") or {}).get("namespace") or ""
            state: OperatorState = kwargs["memo"]
            index = state.pool_index
            if not index.ready.is_set():
                kwargs["warnings"].append(
                    "kvpool: the operator has not yet read the pools; no cache injected"
                )
                return
            pools = index.in_namespace(namespace)
            await webhook.inject(
                body, kwargs["patch"], kwargs["warnings"], state, pools, bool(kwargs.get("dryrun"))
            )
        except Exception:
            logging.getLogger("kvpool.webhook").exception("kvpool-inject failed; admitting the pod untouched")
            kwargs["patch"].clear()
