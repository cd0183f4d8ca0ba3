"""PodNotInjected events counted per (pool, reason, owner) instead of one per pod: against an in-memory
Events API that checks resourceVersions as the API server does, with two operator replicas writing."""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any

import pytest

from kvpool_operator.kube import ApiError
from kvpool_operator.pool import parse_pool
from kvpool_operator.skip_events import SkipEvents, event_name, owner_of
from kvpool_operator.vllm_target import Skip

POOL = parse_pool("ns", "llama", {"selector": {"matchLabels": {"app": "vllm"}}, "capacity": "1Gi"})
HOST_NETWORK = Skip("HostNetwork", "the pod uses the host's network")


def replica(owner: str = "vllm-7d9f8", kind: str = "ReplicaSet") -> dict[str, Any]:
    """A pod as its controller sends it to admission: a generateName, no name."""
    ref = {"apiVersion": "apps/v1", "kind": kind, "name": owner, "uid": "u", "controller": True}
    return {"metadata": {"generateName": f"{owner}-", "ownerReferences": [ref]}}


class EventsAPI:
    """Events by name, with the API server's answers: 404 for none, 409 for a name taken or a stale
    resourceVersion in a patch. Every call yields to the loop, so concurrent writers interleave."""

    def __init__(self) -> None:
        self.events: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.calls: list[str] = []
        self.fail_with: ApiError | None = None
        self.conflicts = 0

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        await self._call("GET")
        found = self.events.get(name)
        return copy.deepcopy(found) if found else None

    async def create(self, kind: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        await self._call("POST")
        name = body["metadata"]["name"]
        if name in self.events:
            self.conflicts += 1
            raise ApiError(409, "already exists")
        self.events[name] = self._stored(copy.deepcopy(body))
        return self.events[name]

    async def patch(self, kind: str, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        await self._call("PATCH")
        current = self.events.get(name)
        if current is None:
            raise ApiError(404, "not found")
        if body["metadata"]["resourceVersion"] != current["metadata"]["resourceVersion"]:
            self.conflicts += 1
            raise ApiError(409, "the object has been modified")
        current.update({k: v for k, v in body.items() if k != "metadata"})
        return self._stored(current)

    async def _call(self, method: str) -> None:
        self.calls.append(method)
        await asyncio.sleep(0)  # a real call yields: let the other writers run between read and write
        if self.fail_with is not None:
            raise self.fail_with

    def _stored(self, event: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        event["metadata"]["resourceVersion"] = str(self.version)
        return event


async def settle(*recorders: SkipEvents) -> None:
    """Until every writer the recorders started has finished."""
    while running := [t for r in recorders for t in r._writers.values()]:
        await asyncio.gather(*running)


def test_the_owner_is_the_controller_and_a_bare_pod_is_its_own() -> None:
    assert owner_of(replica()) == "ReplicaSet/vllm-7d9f8"
    assert owner_of({"metadata": {"name": "solo"}}) == "Pod/solo"
    assert owner_of({"metadata": {"generateName": "x-"}}) == "Pod/x-"
    two = {
        "metadata": {
            "ownerReferences": [{"kind": "A", "name": "a"}, {"kind": "B", "name": "b", "controller": True}]
        }
    }
    assert owner_of(two) == "B/b"


def test_a_hundred_skipped_replicas_make_one_event_with_count_100_naming_owner_and_pod() -> None:
    async def scenario() -> EventsAPI:
        api = EventsAPI()
        recorder = SkipEvents(api)  # type: ignore[arg-type]
        for i in range(100):
            recorder.record(POOL, HOST_NETWORK, replica())
            if i % 10 == 0:
                await asyncio.sleep(0)  # some admissions interleave with the writer's calls
        recorder.record(POOL, HOST_NETWORK, {"metadata": {"name": "solo"}})  # another owner
        await settle(recorder)
        return api

    api = asyncio.run(scenario())
    ours = api.events[event_name(POOL, "HostNetwork", "ReplicaSet/vllm-7d9f8")]
    assert ours["count"] == 100 and ours["reason"] == "PodNotInjected" and ours["type"] == "Warning"
    assert (
        ours["message"]
        == "pod vllm-7d9f8- of ReplicaSet/vllm-7d9f8: HostNetwork: the pod uses the host's network"
    )
    assert ours["involvedObject"]["kind"] == "KVCachePool" and ours["involvedObject"]["name"] == "llama"
    assert ours["lastTimestamp"] >= ours["firstTimestamp"]
    solo = api.events[event_name(POOL, "HostNetwork", "Pod/solo")]
    assert solo["count"] == 1 and solo["message"].startswith("pod solo: HostNetwork: ")
    assert len(api.events) == 2
    assert api.calls.count("POST") == 2 and len(api.calls) < 40  # skips batched while a write is under way


def test_two_replicas_writing_at_once_lose_no_count_and_raise_nothing() -> None:
    async def scenario() -> EventsAPI:
        api = EventsAPI()
        one, two = SkipEvents(api), SkipEvents(api)  # type: ignore[arg-type]
        for _ in range(50):
            one.record(POOL, HOST_NETWORK, replica())
            two.record(POOL, HOST_NETWORK, replica())
            await asyncio.sleep(0)
        await settle(one, two)
        return api

    api = asyncio.run(scenario())
    (event,) = api.events.values()
    assert event["count"] == 100
    assert api.conflicts > 0  # the race was run: each replica wrote over the other's read


def test_an_api_that_fails_loses_the_count_with_a_log_line_and_the_next_skip_starts_over(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> EventsAPI:
        api = EventsAPI()
        recorder = SkipEvents(api)  # type: ignore[arg-type]
        api.fail_with = ApiError(403, "forbidden")
        recorder.record(POOL, HOST_NETWORK, replica())
        await settle(recorder)
        api.fail_with = None
        recorder.record(POOL, HOST_NETWORK, replica())
        await settle(recorder)
        return api

    with caplog.at_level(logging.WARNING, "kvpool.events"):
        api = asyncio.run(scenario())
    assert "could not count 1 PodNotInjected event(s) for ns/llama: 403: forbidden" in caplog.text
    (event,) = api.events.values()
    assert event["count"] == 1


def test_an_event_that_expired_between_read_and_patch_is_created_again() -> None:
    async def scenario() -> EventsAPI:
        api = EventsAPI()
        recorder = SkipEvents(api)  # type: ignore[arg-type]
        recorder.record(POOL, HOST_NETWORK, replica())
        await settle(recorder)
        real_get = api.get

        async def get_then_expire(*args: Any) -> dict[str, Any] | None:
            found = await real_get(*args)
            api.events.clear()  # the API server's TTL removes it before the patch lands
            api.get = real_get  # type: ignore[method-assign]
            return found

        api.get = get_then_expire  # type: ignore[method-assign]
        recorder.record(POOL, HOST_NETWORK, replica())
        await settle(recorder)
        return api

    (event,) = asyncio.run(scenario()).events.values()
    assert event["count"] == 1
