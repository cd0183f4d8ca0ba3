"""Test support for the operator: kmock (a Kubernetes API emulator) and the operator, each in its own
thread with its own event loop, and a small synchronous client that talks to kmock like kubectl.

kmock's known gaps are worked around here, never in the operator: its objects get resourceVersion,
uid and generation from us; it ignores labelSelector (the operator filters too); it has no
validation, defaulting or garbage collection (tests check ownerReferences instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import kmock
import kopf
import pytest
from kvtest import wait_until

from kubeharness.objects import pool_path, write_kubeconfig
from kvpool_operator.cli import build
from kvpool_operator.pool import Pool, parse_pool

T = TypeVar("T")
TEST_AGENT = "kvpool-tests"  # marks the tests' own requests, to tell them from the operator's
_versions = itertools.count(1000)


class LoopThread:
    """An event loop running in a daemon thread; `call` runs a coroutine there and waits for it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def call(self, coro: Awaitable[T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class KubeAPI:
    """kmock's KubernetesEmulator on a free port, with the resources kopf and the operator use."""

    def __init__(self, crd: dict[str, Any]) -> None:
        self.thread = LoopThread("kmock")
        self.emulator: kmock.KubernetesEmulator = self.thread.call(self._start(crd))
        self.url = f"http://127.0.0.1:{self.server.port}"

    async def _start(self, crd: dict[str, Any]) -> kmock.KubernetesEmulator:
        emulator = kmock.KubernetesEmulator()
        await emulator.__aenter__()
        # without these kopf waits for namespace/resource discovery that kmock does not serve
        emulator.resources.load_bundled()
        names = crd["spec"]["names"]
        for version in crd["spec"]["versions"]:
            emulator.resources[f"{crd['spec']['group']}/{version['name']}/{names['plural']}"] = (
                kmock.ResourceInfo(
                    kind=names["kind"],
                    singular=names["singular"],
                    namespaced=crd["spec"]["scope"] == "Namespaced",
                    verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
                    shortnames=set(names.get("shortNames", [])),
                    subresources=set(version.get("subresources", {})),
                )
            )
        emulator.resources["kopf.dev/v1/clusterkopfpeerings"] = kmock.ResourceInfo(
            kind="ClusterKopfPeering", namespaced=False, verbs={"get", "list", "watch", "patch"}
        )
        emulator.resources["kopf.dev/v1/kopfpeerings"] = kmock.ResourceInfo(
            kind="KopfPeering", namespaced=True, verbs={"get", "list", "watch", "patch"}
        )
        self.server = kmock.Server(emulator)
        await self.server.__aenter__()
        return emulator

    def stop(self) -> None:
        async def _stop() -> None:
            await self.server.__aexit__(None, None, None)
            await self.emulator.__aexit__(None, None, None)

        try:
            self.thread.call(_stop())
        finally:
            self.thread.stop()

    def kubeconfig(self, path: Path) -> Path:
        return write_kubeconfig(path, self.url, {"token": "test-token"})

    # --- what tests read -----------------------------------------------------------------------

    def requests(self) -> list[tuple[str, str, dict[str, str], Any]]:
        """(method, path, query, JSON body) of every request the operator (not the tests) sent so far."""

        async def read() -> list[tuple[str, str, dict[str, str], Any]]:
            return [
                (str(r.method.value), r.url.path, dict(r.url.query), r.data)
                for r in list(self.emulator)
                if r.headers.get("User-Agent") != TEST_AGENT
            ]

        return self.thread.call(read())

    # --- kubectl-like calls over HTTP ----------------------------------------------------------

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Content-Type": content_type, "User-Agent": TEST_AGENT},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as rsp:
                return json.loads(rsp.read() or b"{}")
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise

    def get(self, path: str) -> dict[str, Any] | None:
        return self.request("GET", path)

    def read(self, path: str) -> dict[str, Any]:
        """GET of an object that must exist."""
        found = self.get(path)
        assert found is not None, f"{path} not found"
        return found

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST, with the metadata a real API server would add (kmock adds none)."""
        meta = body.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("resourceVersion", str(next(_versions)))
        meta.setdefault("generation", 1)
        meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
        return self.request("POST", path, body)

    def patch(self, path: str, body: dict[str, Any], *, new_generation: bool = False) -> dict[str, Any]:
        """A merge patch; a spec change bumps generation as a real API server would."""
        meta = body.setdefault("metadata", {})
        meta["resourceVersion"] = str(next(_versions))
        if new_generation:
            current = self.get(path) or {}
            meta["generation"] = int(current.get("metadata", {}).get("generation", 1)) + 1
        return self.request("PATCH", path, body, "application/merge-patch+json")

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)

    def events(self, namespace: str, name: str) -> list[dict[str, Any]]:
        items = (self.get(f"/api/v1/namespaces/{namespace}/events") or {}).get("items", [])
        return [e for e in items if e.get("involvedObject", {}).get("name") == name]


class MemoryGauge:
    """The shared tier's memory utilization as the test sets it, per pool name (None: unknown)."""

    def __init__(self) -> None:
        self.values: dict[str, float | None] = {}
        self.reads: dict[str, int] = {}  # how often the operator measured each pool: once per refresh

    async def __call__(self, pool: Pool, shard_pods: list[dict[str, Any]]) -> float | None:
        self.reads[pool.name] = self.reads.get(pool.name, 0) + 1
        return self.values.get(pool.name)


class OperatorThread:
    """The real operator (cli.build + kopf.operator) in its own thread and event loop.

    Run in the test's loop, kopf's stop would cancel the test's own teardown; in a thread it is
    stopped through its stop flag and joined.
    """

    def __init__(self, argv: list[str], memory: Callable[..., Awaitable[float | None]]) -> None:
        self.op = build(argv, memory)
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="kopf", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            asyncio.run(
                kopf.operator(**self.op.kwargs(), stop_flag=self.stop_flag, ready_flag=self.ready_flag)
            )
        except BaseException as e:  # reported by the fixture
            self.error = e

    def stop(self) -> None:
        self.stop_flag.set()
        self.thread.join(30)


@contextlib.contextmanager
def operator_on_kmock(
    crd: dict[str, Any], workdir: Path, argv: list[str], memory: MemoryGauge
) -> Iterator[tuple[KubeAPI, OperatorThread]]:
    """kmock serving the CRD and the cluster peering, and the real operator running against it
    (KUBECONFIG points at kmock meanwhile). Both are stopped on the way out; stopping the operator
    earlier inside the block is fine."""
    api = KubeAPI(crd)
    api.create(
        "/apis/kopf.dev/v1/clusterkopfpeerings",
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "kvpool"}},
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KUBECONFIG", str(api.kubeconfig(workdir / "kubeconfig")))
        operator = OperatorThread(argv, memory)
        try:
            wait_until(lambda: operator.ready_flag.is_set() or operator.error, 60, "the operator to start")
            assert operator.error is None, operator.error
            yield api, operator
        finally:
            operator.stop()
            api.stop()
    assert operator.error is None, operator.error


@dataclass
class Cluster:
    api: KubeAPI
    operator: OperatorThread
    memory: MemoryGauge
    webhook_url: str


def wait_indexed(cluster: Cluster, namespace: str, timeout: float = 30) -> None:
    """Until the webhook's pool index (a watch of its own, pool_index.py) has every usable pool of the
    namespace: it may see a pool a moment after the operator has reconciled it."""
    index = cluster.operator.op.memo.pool_index

    def usable(item: dict[str, Any]) -> bool:
        try:
            parse_pool(namespace, item["metadata"]["name"], item.get("spec") or {})
        except ValueError:
            return False
        return True

    def caught_up() -> bool:
        items = (cluster.api.get(pool_path(namespace)) or {}).get("items", [])
        want = {i["metadata"]["name"] for i in items if usable(i)}
        return want <= {p.name for p in index.in_namespace(namespace)}

    wait_until(caught_up, timeout, f"the webhook's index to have the pools of {namespace}")
