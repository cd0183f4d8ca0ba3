"""A pool's conditions from what refresh sees, outdated pods over the whole injection, and the vLLM
breaker: the pure parts. tests/k8s/test_operator_apiserver.py shows them on a real API server."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime
from typing import Any

import pytest

from kvpool_operator import vllm_breaker
from kvpool_operator.injected_parts import added
from kvpool_operator.injection import decide, inject
from kvpool_operator.outdated import outdated
from kvpool_operator.pods import PodCounts, count
from kvpool_operator.pool import parse_pool
from kvpool_operator.pool_health import Seen, assess
from kvpool_operator.settings import OperatorSettings

SETTINGS = OperatorSettings()
SPEC = {"selector": {"matchLabels": {"app": "vllm"}}, "capacity": "1Gi"}
NOW = datetime.datetime(2026, 11, 24, 12, tzinfo=datetime.UTC)


def vllm_pod(name: str = "vllm-0", image: str = "vllm/vllm-openai:v0.32.0") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"app": "vllm"}, "creationTimestamp": "2026-11-24T11:00:00Z"},
        "spec": {
            "containers": [{"name": "vllm", "image": image, "command": ["vllm", "serve"], "args": ["m"]}]
        },
    }


def injected(spec: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    return inject(vllm_pod(**kwargs), parse_pool("ns", "llama", spec or SPEC), SETTINGS)


# --- outdated pods: anything inject adds ----------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        {"capacity": "2Gi"},  # the sidecar's --capacity, resources and the arena's sizeLimit
        {"sidecar": {"image": "kvpool/sidecar:other"}},
        {"sidecar": {"resources": {"limits": {"cpu": "100m"}}}},
        {"sidecar": {"port": 7080}},
        {"chunkSize": 64},  # the connector config
        {"backend": "redis", "redis": {"mode": "external", "url": "redis://r:6379"}},  # env, volumes
    ],
)
def test_a_pod_is_outdated_when_anything_kvpool_would_inject_differs(change: dict[str, Any]) -> None:
    pod = injected()
    assert not outdated(pod, parse_pool("ns", "llama", SPEC), SETTINGS)
    assert outdated(pod, parse_pool("ns", "llama", {**SPEC, **change}), SETTINGS)


def test_the_digest_survives_what_the_api_server_and_other_injectors_add() -> None:
    pool = parse_pool("ns", "llama", SPEC)
    pod = injected()
    stored = copy.deepcopy(pod)  # as stored: defaults on every container, another injector's proxy
    for c in [*stored["spec"]["containers"], *stored["spec"]["initContainers"]]:
        c.update(terminationMessagePath="/dev/termination-log", imagePullPolicy="IfNotPresent")
    stored["spec"]["containers"].append({"name": "istio-proxy", "image": "istio/proxyv2"})
    assert not outdated(stored, pool, SETTINGS)
    assert inject(pod, pool, SETTINGS) == pod  # injecting again changes nothing


def test_added_compares_named_entries_by_name_and_other_lists_by_element() -> None:
    before = {"containers": [{"name": "a", "args": ["m"]}], "x": 1}
    after = {"containers": [{"name": "a", "args": ["m", "--flag"]}, {"name": "b"}], "x": 1}
    assert added(before, after) == {"containers": [{"name": "a", "args": ["--flag"]}, {"name": "b"}]}
    assert added(after, after) is None


def test_pods_the_webhook_never_saw_are_named_and_skipped_ones_kept_apart() -> None:
    never_seen = vllm_pod("plain")
    skipped = vllm_pod("big")
    skipped["metadata"]["annotations"] = {"kvpool.dev/skipped": "LimitRangeExceeded: too big"}
    counts = count([injected(), never_seen, skipped], "llama", lambda p: False)
    assert counts.unseen == ["plain"] and counts.outdated == 1 and counts.skipped == 1
    assert counts.skipped_example == "pod big: LimitRangeExceeded: too big"


# --- Ready ------------------------------------------------------------------------------------------


def counts(**kw: Any) -> PodCounts:
    return PodCounts(**{"matched": 2, "ready": 2, "outdated": 0, "injected": 2, **kw})


def stats(redis: dict[str, Any] | None = None, **engines: dict[str, Any]) -> dict[str, Any]:
    engines = engines or {"dp0": {"cache": "on", "shared": True, "reason": "", "model": "m"}}
    return {"hits": 1, "tiers": {"cpu": {}, **({"redis": redis} if redis else {})}, "engines": engines}


OFF = {
    "cache": "off",
    "reason": "kvpool cannot cache a model with state that is not per-token KV",
    "model": "q",
}
PRIVATE = {"cache": "on", "shared": False, "reason": "its weights cannot be read", "model": "s3://m"}


@pytest.mark.parametrize(
    ("seen", "reason"),
    [
        (Seen(True, None, counts(), [stats(), stats()]), "Serving"),
        (Seen(True, None, PodCounts(0, 0, 0), []), "NoPods"),  # it will serve the pods created now
        (Seen(False, None, PodCounts(0, 0, 0), []), "Reconciling"),
        (Seen(True, "the API server refused a call (403: quota)", PodCounts(0, 0, 0), []), "Refused"),
        (Seen(True, None, counts(matched=3, unseen=["plain"]), [stats(), stats()]), "InjectionNotEnabled"),
        (Seen(True, None, counts(ready=0, injected=0, skipped=2, skip_reasons={"LimitRangeExceeded": 2}),
              []), "LimitRangeExceeded"),
        (Seen(True, None, counts(matched=3, skipped=1, skip_reasons={"OwnConnector": 1}),
              [stats(), stats()]), "OwnConnector"),
        (Seen(True, None, counts(skipped=2, skip_reasons={"OwnConnector": 1, "HostNetwork": 1}), []),
         "PodsSkipped"),
        (Seen(True, None, counts(ready=0), []), "PodsNotReady"),
        (Seen(True, None, counts(), [stats(), None]), "SidecarsNotAnswering"),
        (Seen(True, None, counts(), [stats({"ready": False, "reason": "redis unreachable: r:6379: "
                                            "AuthenticationError: Authentication required."})] * 2),
         "RedisAuthFailed"),
        (Seen(True, None, counts(), [stats({"ready": False, "reason": "redis unreachable: r:1: "
                                            "ConnectionError: Connection refused"})] * 2),
         "RedisUnreachable"),
        (Seen(True, None, counts(), [stats(), stats()], tier=(2, 0)), "SharedTierStarting"),
        (Seen(True, None, counts(), [stats(), stats(dp0=OFF)]), "CacheOff"),
        (Seen(True, None, counts(), [stats(), stats()],
              vllm_breaker={"images": [{"image": "i", "pod": "p", "reason": "CrashLoopBackOff"}]}),
         "VLLMFailing"),
        (Seen(True, None, counts(), [stats(), stats()],
              sidecar_breaker={"pods": 1, "reason": "ErrImagePull"}),
         "SidecarNotStarting"),
    ],
)  # fmt: skip
def test_ready_only_while_the_pool_serves(seen: Seen, reason: str) -> None:
    ready, degraded = assess(seen)
    assert ready.reason == reason
    assert ready.status == (reason in ("Serving", "NoPods"))
    assert degraded.status == (not ready.status)


def test_a_refusal_outranks_what_follows_from_it_and_degraded_lists_all() -> None:
    ready, degraded = assess(Seen(True, "refused: quota", counts(ready=0), [], tier=(1, 0)))
    assert ready.reason == degraded.reason == "Refused"
    assert "quota" in degraded.message and "shards" in degraded.message


def test_unseen_pods_are_named_in_the_message() -> None:
    ready, _ = assess(Seen(True, None, counts(unseen=["a", "b", "c", "d"]), [stats(), stats()]))
    assert "a, b, c and 1 more" in ready.message and "kvpool.dev/injection=enabled" in ready.message


def test_a_shard_short_degrades_but_a_serving_pool_stays_ready() -> None:
    ready, degraded = assess(Seen(True, None, counts(), [stats(), stats()], tier=(3, 2)))
    assert (ready.status, degraded.status, degraded.reason) == (True, True, "ShardsNotReady")


def test_an_engine_kvpool_is_off_in_keeps_the_pool_from_ready_one_that_shares_nothing_degrades() -> None:
    ready, degraded = assess(Seen(True, None, counts(), [stats(), stats(dp0=OFF)]))
    assert (ready.status, ready.reason) == (False, "CacheOff")
    assert "1 of 2 pod(s)" in ready.message and "not per-token KV" in ready.message
    ready, degraded = assess(Seen(True, None, counts(), [stats(dp0=PRIVATE, dp1=PRIVATE), stats()]))
    assert (ready.status, degraded.status, degraded.reason) == (True, True, "NotSharedAcrossPods")
    assert "1 of 2 pod(s)" in degraded.message and "s3://m" in degraded.message
    ready, _ = assess(Seen(True, None, counts(), [{"hits": 1, "tiers": {}}] * 2))  # an older sidecar
    assert ready.reason == "Serving"


# --- the vLLM breaker -------------------------------------------------------------------------------


def crash_looping(pod: dict[str, Any], exit_code: int = 1, waiting: str = "CrashLoopBackOff") -> dict:
    pod = copy.deepcopy(pod)
    pod["status"] = {"containerStatuses": [{
        "name": "vllm", "state": {"waiting": {"reason": waiting}},
        "lastState": {"terminated": {"exitCode": exit_code, "reason": "Error",
                                     "message": "ModuleNotFoundError: No module named 'kvpool_connector'"}},
    }]}  # fmt: skip
    return pod


def test_only_a_crash_loop_with_an_error_opens_the_breaker() -> None:
    pod = injected()
    assert "ModuleNotFoundError" in (vllm_breaker.failure(crash_looping(pod)) or "")
    assert vllm_breaker.failure(crash_looping(pod, exit_code=0)) is None  # not an error
    assert vllm_breaker.failure(crash_looping(pod, waiting="ContainerCreating")) is None  # one try
    assert vllm_breaker.failure(crash_looping(vllm_pod())) is None  # not injected: not kvpool's doing


class Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str]] = []

    async def event(self, _ref: Any, _type: str, reason: str, message: str) -> None:
        self.posted.append((reason, message))


def test_the_breaker_opens_per_image_until_reset_and_new_pods_of_that_image_are_skipped() -> None:
    pool = parse_pool("ns", "llama", SPEC)
    kube = Events()
    failing = crash_looping(injected(name="crash"))
    state = asyncio.run(vllm_breaker.update(kube, pool, [failing], None, "", NOW))  # type: ignore[arg-type]
    assert state is not None and [b["image"] for b in state["images"]] == ["vllm/vllm-openai:v0.32.0"]
    ((reason, message),) = kube.posted
    assert reason == "VLLMFailing" and "crash" in message and "vllm/vllm-openai:v0.32.0" in message
    obj: dict[str, Any] = {"metadata": {"annotations": {}}, "status": {"vllmFailing": state}}
    blocked = dataclasses.replace(pool, vllm_failing=vllm_breaker.blocked_images(obj))
    same = decide(vllm_pod("next"), "ns", [blocked], SETTINGS).pod or {}
    assert same["metadata"]["annotations"]["kvpool.dev/skipped"].startswith("VLLMFailing: ")
    other = decide(vllm_pod("next", "vllm/vllm-openai:v0.33.0"), "ns", [blocked], SETTINGS).pod or {}
    assert "kvpool.dev/skipped" not in other["metadata"]["annotations"]
    # a person clears it: the index at once, the status at the next refresh, and the pod created
    # before the clearing does not open it again
    obj["metadata"]["annotations"] = {vllm_breaker.RESET_ANNOTATION: "1"}
    assert vllm_breaker.blocked_images(obj) == {}
    later = NOW + datetime.timedelta(minutes=1)
    cleared = asyncio.run(vllm_breaker.update(kube, pool, [failing], state, "1", later))  # type: ignore[arg-type]
    assert cleared == {"resetValue": "1", "resetAt": "2026-11-24T12:01:00Z", "images": []}
    assert asyncio.run(vllm_breaker.update(kube, pool, [], None, "", NOW)) is None  # type: ignore[arg-type]
