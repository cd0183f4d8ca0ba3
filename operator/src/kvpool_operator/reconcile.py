"""On create, update and resume of a pool: check it, store its connector config, run its Redis tier."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

import kopf

from kvpool_operator import conditions, credentials, events, names, objects, pods, shards
from kvpool_operator.connector_config import config_hash, kv_transfer_config, render
from kvpool_operator.kube import RETRY_DELAY, ApiError
from kvpool_operator.outdated import outdated
from kvpool_operator.pool import Pool, parse_pool, problems
from kvpool_operator.state import OperatorState


async def reconcile(
    body: Mapping[str, Any],
    spec: Mapping[str, Any],
    meta: Mapping[str, Any],
    name: str,
    namespace: str | None,
    status: Mapping[str, Any],
    patch: kopf.Patch,
    memo: OperatorState,
    **_: Any,
) -> None:
    namespace = namespace or ""  # pools are namespaced (kopf types None for cluster objects)
    kube = memo.kube
    generation = meta.get("generation")
    now = datetime.datetime.now(datetime.UTC)
    try:
        pool = parse_pool(namespace, name, spec, meta.get("uid"))
        wrong = problems(pool)
    except ValueError as e:
        pool, wrong = Pool(namespace, name, {}, uid=meta.get("uid")), [str(e)]
    patch.status["observedGeneration"] = generation

    async def give_up(reason: str, problems: list[str]) -> None:
        """Degraded until the pool changes: retrying would get the same answer (kopf retries nothing
        after a handler returns)."""
        ready, degraded = conditions.failed(reason, problems)
        patch.status["conditions"] = conditions.merge(
            status.get("conditions") or [], [ready, degraded], generation, now
        )
        await events.post(kube, pool, "Warning", reason, "; ".join(problems))

    if wrong:
        await give_up("InvalidSpec", wrong)
        return

    config, warnings = kv_transfer_config(pool)
    text = render(config)
    owner = objects.owner_reference(body)
    try:
        urls: list[str] | None = None
        await credentials.ensure(kube, pool, owner)
        if pool.shared_tier:
            urls = await shards.start(kube, pool, owner)
        elif pool.redis is not None:
            urls = [pool.redis.url or ""]  # its password Secret is the user's: never read, only referenced
        await kube.ensure("ConfigMap", namespace, objects.config_map(pool, owner, text, urls))
        changed = status.get("observedGeneration") != generation or status.get("connectorConfig") != text
        found = await kube.list_pods(namespace, pool.selector) if changed else []
    except ApiError as e:
        if e.gone and e.status == 403:
            return  # its namespace is being deleted, and the pool with it
        if e.transient:
            raise kopf.TemporaryError(f"API call failed: {e}", delay=RETRY_DELAY) from e
        message = f"the API server refused a call ({e}); tried again when the pool changes"
        # kept until a reconcile succeeds: refresh, which judges the rest, never clears it
        stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        patch.status["refused"] = {"message": message, "observedGeneration": generation, "time": stamp}
        await give_up("Refused", [message])
        return

    # Ready and Degraded are refresh's (pool_health): a reconcile alone does not show the pool serves
    patch.status["refused"] = None
    patch.status["connectorConfig"] = text
    for warning in warnings:
        await events.post(kube, pool, "Warning", "ExtraConfigOverridden", warning)
    if changed:
        counts = pods.count(found, name, lambda p: outdated(p, pool, memo.settings))
        await events.post(
            kube,
            pool,
            "Normal",
            "ConfigUpdated",
            f"pool generation {generation}: connector config {config_hash(text)} stored in ConfigMap "
            f"{names.config_map_name(name)}; {counts.outdated} of {counts.matched} running pod(s) are "
            "outdated and keep what they were given until they are replaced",
        )
