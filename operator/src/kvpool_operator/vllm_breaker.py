"""The vLLM breaker: once the vLLM container of a pod kvpool injected fails for good, pods running that
vLLM image are admitted without the cache, until a person clears the breaker or the image changes.

kvpool changed the pod (a connector flag, a sidecar), so a vLLM that then crash-loops is first of all
kvpool's problem: a stock image without the connector dies at every start. The breaker is per image,
so a fixed image is injected at once. It is kept in the pool's status.vllmFailing:

    resetValue: the pool's kvpool.dev/reset-breaker annotation when last seen; a new value clears it
    resetAt:    when the last clearing was seen (pods created before it do not open it again)
    images:     [{image, pod, reason, time}], one per failing image
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import Any

from kvpool_operator import events, names
from kvpool_operator.kube import Kube
from kvpool_operator.pods import injected_by
from kvpool_operator.pool import Pool
from kvpool_operator.vllm_target import Skip

RESET_ANNOTATION = "kvpool.dev/reset-breaker"  # on the pool: any new value clears the vLLM breaker


def vllm_container(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The container kvpool configured: the one besides the sidecar that mounts the arena."""
    for c in (pod.get("spec") or {}).get("containers") or []:
        mounts = {m.get("name") for m in c.get("volumeMounts") or []}
        if c.get("name") != names.SIDECAR_CONTAINER and names.ARENA_VOLUME in mounts:
            return c
    return None


def failure(pod: Mapping[str, Any]) -> str | None:
    """Why the pod's vLLM container fails for good, or None.

    Only a crash loop counts: the kubelet waits in CrashLoopBackOff once a container has failed at
    least twice, and its lastState gives the exit of the last try. A single non-zero exit (an OOM kill
    under load, a node's preemption) says nothing about kvpool, and an exit 0 is not a failure.
    """
    container = vllm_container(pod)
    if container is None:
        return None
    for c in (pod.get("status") or {}).get("containerStatuses") or []:
        if c.get("name") != container.get("name"):
            continue
        waiting = (c.get("state") or {}).get("waiting") or {}
        last = (c.get("lastState") or {}).get("terminated") or {}
        if waiting.get("reason") == "CrashLoopBackOff" and last.get("exitCode", 0) != 0:
            detail = ": ".join(str(x) for x in (last.get("reason"), last.get("message")) if x)
            return f"CrashLoopBackOff, exit code {last['exitCode']}" + (f" ({detail})" if detail else "")
    return None


def blocked_images(pool_object: Mapping[str, Any]) -> dict[str, str]:
    """The pool's open breakers, image -> why (none once its reset annotation has a new value)."""
    found = (pool_object.get("status") or {}).get("vllmFailing") or {}
    annotations = (pool_object.get("metadata") or {}).get("annotations") or {}
    if found.get("resetValue", "") != annotations.get(RESET_ANNOTATION, ""):
        return {}
    return {str(b.get("image")): f"pod {b.get('pod')}: {b.get('reason')}" for b in found.get("images") or []}


def skip(pod: Mapping[str, Any], index: int, pool: Pool) -> Skip | None:
    """Why the pod gets no cache when its vLLM container (at `index`) runs an image whose breaker is open."""
    image = ((pod.get("spec") or {}).get("containers") or [])[index].get("image")
    why = pool.vllm_failing.get(str(image))
    if why is None:
        return None
    return Skip(
        "VLLMFailing",
        f"vLLM image {image} fails in pool {pool.name}'s injected pods ({why}); pods running it start "
        f"without the cache until the image changes or the pool is annotated {RESET_ANNOTATION}=<new value>",
    )


async def update(
    kube: Kube,
    pool: Pool,
    found: Iterable[Mapping[str, Any]],
    previous: Mapping[str, Any] | None,
    reset_value: str,
    now: datetime.datetime,
) -> dict[str, Any] | None:
    """status.vllmFailing after looking at the pool's pods: a breaker opened (with a warning event
    naming the pod and the image) for each image whose vLLM fails in a pod created since the last
    clearing; None while nothing was ever opened or cleared."""
    previous = previous or {}
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    if previous and previous.get("resetValue", "") != reset_value:
        previous = {"resetAt": stamp, "images": []}  # a person cleared it
    reset_at = previous.get("resetAt")
    images = [dict(b) for b in previous.get("images") or []]
    for pod in found:
        meta = pod.get("metadata") or {}
        before_reset = reset_at and str(meta.get("creationTimestamp", "")) < reset_at
        if not injected_by(pod, pool.name) or before_reset:
            continue
        reason = failure(pod)
        container = vllm_container(pod)
        image = str((container or {}).get("image"))
        if reason is None or any(b["image"] == image for b in images):
            continue
        images.append({"image": image, "pod": meta.get("name"), "reason": reason, "time": stamp})
        await events.post(
            kube, pool, "Warning", "VLLMFailing",
            f"vLLM in pod {meta.get('name')} (image {image}) fails since kvpool injected it: {reason}; "
            f"new pods running {image} start without the cache until the image changes or the pool is "
            f"annotated {RESET_ANNOTATION}=<new value>",
        )  # fmt: skip
    if not images and not reset_at:
        return None
    result: dict[str, Any] = {"resetValue": reset_value, "images": images}
    if reset_at:
        result["resetAt"] = reset_at
    return result
