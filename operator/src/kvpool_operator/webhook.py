"""The pod-mutating admission webhook (`/kvpool-inject`, served by kopf's WebhookServer).

It fails open: whatever goes wrong, the pod is admitted untouched (and the chart's
MutatingWebhookConfiguration says failurePolicy: Ignore for when the operator is down).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Iterable
from typing import Any

import aiohttp
import kopf

from kvpool_operator.config_file import ConfigMapRead, Unreadable, config_maps_to_read
from kvpool_operator.injection import NamespaceLimits, claimed_by, decide
from kvpool_operator.kube import ApiError, Kube
from kvpool_operator.pool import Pool
from kvpool_operator.state import OperatorState
from kvpool_operator.vllm_target import Skip

HANDLER_ID = "kvpool-inject"  # the webhook path is /kvpool-inject


class WebhookServer(kopf.WebhookServer):
    """kopf's server, plus the request's namespace on the object: pods made by controllers arrive
    without metadata.namespace (and often without a name), and kopf hands handlers only the object.

    Every answer closes its connection. The API server keeps webhook connections alive and reuses
    them whatever the Service's endpoints say, so in a rolling update it sent a pod's review over a
    connection the exiting replica was closing: "EOF", and the pod was admitted without its cache
    (failurePolicy Ignore). A connection per review goes through the Service to a replica that is
    not terminating; it costs a TLS handshake per pod created.
    """

    @staticmethod
    async def _serve(fn: Any, request: aiohttp.web.Request) -> aiohttp.web.Response:
        response = await kopf.WebhookServer._serve(fn, request)
        response.force_close()
        return response

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        async def with_namespace(request: Any, **kwargs: Any) -> Any:
            payload = request.get("request") or {}
            obj = payload.get("object")
            if isinstance(obj, dict) and payload.get("namespace"):
                obj.setdefault("metadata", {}).setdefault("namespace", payload["namespace"])
            return await fn(request, **kwargs)

        async for config in super().__call__(with_namespace):
            yield config


async def inject(
    body: Any,
    patch: kopf.Patch,
    warnings: list[str],
    memo: OperatorState,
    pools: Iterable[Pool],
    dryrun: bool = False,
) -> str:
    """Sets the patch to the injected pod when exactly one usable pool claims it; returns the
    decision's reason (Injected, NotClaimed, or why the pod is admitted without the cache).

    The handler around it turns any exception into an untouched admission (fail open).
    """
    pod = copy.deepcopy(dict(body))
    namespace = (pod.get("metadata") or {}).get("namespace") or ""
    # every pod of the namespace comes through here: only one a pool claims is worth an API call
    claiming = claimed_by(pod, namespace, pools)
    if not claiming:
        return "NotClaimed"
    limits, config_maps = await asyncio.gather(
        namespace_limits(memo.kube, namespace), read_config_maps(memo.kube, namespace, pod)
    )
    decision = decide(pod, namespace, claiming, memo.settings, limits, config_maps)
    warnings.extend(decision.warnings)
    if decision.pod is not None:
        new = decision.pod

        def replace(raw: Any) -> None:  # the whole pod: kopf turns the difference into a JSON patch
            raw.clear()
            raw.update(copy.deepcopy(new))

        patch.fns.append(replace)
    if decision.skip is not None and not dryrun:
        for pool in decision.pools:  # counted per (pool, reason, owner), written after the answer
            memo.skip_events.record(pool, decision.skip, pod)
    if decision.skip is not None:
        return decision.skip.reason
    return "Injected" if decision.pod is not None else "NotClaimed"


async def namespace_limits(kube: Kube, namespace: str) -> NamespaceLimits | Skip:
    """The namespace's LimitRanges and ResourceQuotas (two lists, only for a pod a pool claims); when they
    cannot be read, why (a pod whose fit is unknown gets no sidecar rather than a refusal)."""
    try:
        (ranges, _), (quotas, _) = await asyncio.gather(
            kube.list_objects("LimitRange", namespace), kube.list_objects("ResourceQuota", namespace)
        )
    except (ApiError, OSError, TimeoutError) as e:
        return Skip("LimitsUnreadable", f"cannot read the namespace's LimitRanges and ResourceQuotas: {e}")
    return NamespaceLimits(ranges, quotas)


async def read_config_maps(kube: Kube, namespace: str, pod: Any) -> dict[str, ConfigMapRead]:
    """The ConfigMaps the pod's vLLM `--config` files come from (usually none: no API call), each
    read, or why it could not be (decide() then skips the pod with that reason)."""

    async def read(name: str) -> ConfigMapRead:
        try:
            found = await kube.get("ConfigMap", namespace, name)
        except (ApiError, OSError, TimeoutError, aiohttp.ClientError) as e:
            return Unreadable(f"reading it failed: {e}")
        return found if found is not None else Unreadable(f"no ConfigMap {name} in namespace {namespace}")

    wanted = sorted(config_maps_to_read(pod))
    return dict(zip(wanted, await asyncio.gather(*map(read, wanted)), strict=True))
