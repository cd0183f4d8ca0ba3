"""The kopf handlers, registered into a given registry (tests build their own operator from it)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import kopf

from kvpool_operator import kube, metrics, names, readiness, refresh_loop, webhook
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
        if settings.metrics and (served := await metrics.serve(settings.metrics)):
            memo.probes.append(served)
        memo.refresh_task = asyncio.create_task(refresh_loop.run(memo))

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: OperatorState, **_: Any) -> None:
        memo.index_task.cancel()
        memo.refresh_task.cancel()
        for runner in memo.probes:
            await runner.cleanup()
        await memo.kube.close()

    kopf.on.create(*POOLS, registry=registry, id="reconcile")(counted_reconcile)
    kopf.on.update(*POOLS, registry=registry, id="reconcile", field="spec")(counted_reconcile)
    kopf.on.resume(*POOLS, registry=registry, id="reconcile")(counted_reconcile)
    # the status refresh is refresh_loop.run, started above: a kopf timer would finalize every pool

    @kopf.on.mutate(
        "v1", "pods", id=webhook.HANDLER_ID, operations={"CREATE"}, ignore_failures=True, registry=registry
    )
    async def kvpool_inject(**kwargs: Any) -> None:
        # only **kwargs: a handler that kopf cannot call would deny the pod instead of failing open
        started, reason = time.monotonic(), "Error"
        try:
            body = kwargs["body"]
            namespace = (body.get("metadata") or {}).get("namespace") or ""
            state: OperatorState = kwargs["memo"]
            index = state.pool_index
            if not index.ready.is_set():
                reason = "NotReady"
                kwargs["warnings"].append(
                    "kvpool: the operator has not yet read the pools; no cache injected"
                )
                return
            pools = index.in_namespace(namespace)
            reason = await webhook.inject(
                body, kwargs["patch"], kwargs["warnings"], state, pools, bool(kwargs.get("dryrun"))
            )
        except Exception:
            logging.getLogger("kvpool.webhook").exception("kvpool-inject failed; admitting the pod untouched")
            kwargs["patch"].clear()
        finally:
            metrics.webhook_decided(reason, time.monotonic() - started)


async def counted_reconcile(**kwargs: Any) -> None:
    """reconcile, counted by outcome: the reason it gave the pool up for (the Ready condition it
    wrote), else Succeeded; Retried for a transient error kopf retries, Error for an exception."""
    try:
        await reconcile(**kwargs)
    except kopf.TemporaryError:
        metrics.RECONCILES.labels(outcome="Retried").inc()
        raise
    except Exception:
        metrics.RECONCILES.labels(outcome="Error").inc()
        raise
    written = kwargs["patch"].status.get("conditions") or []
    reasons = [c.get("reason") for c in written if c.get("type") == "Ready" and c.get("status") != "True"]
    metrics.RECONCILES.labels(outcome=reasons[0] if reasons else "Succeeded").inc()
