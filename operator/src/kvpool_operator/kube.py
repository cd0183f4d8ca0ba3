"""Every Kubernetes API call the operator's own code makes (kopf makes its own: watching pools,
patching their status, peering, posting its events).

`RBAC` lists, per resource, the verbs these calls need; the Helm chart's ClusterRole is checked
against it, and the kmock scenario test checks the requests really sent stay inside it.
Credentials come from kopf's own login functions (service account in a pod, else kubeconfig).
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import ssl
import tempfile
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

from kvpool_operator.selector import matches, to_query


@dataclass(frozen=True)
class Kind:
    prefix: str  # "api/v1" or "apis/<group>/<version>"
    plural: str
    verbs: frozenset[str]  # what this module does with it (RBAC verbs)

    @property
    def group(self) -> str:
        return "" if self.prefix == "api/v1" else self.prefix.split("/")[1]


KINDS: dict[str, Kind] = {
    "ConfigMap": Kind("api/v1", "configmaps", frozenset({"get", "create", "patch"})),
    "Secret": Kind("api/v1", "secrets", frozenset({"create"})),  # created once, never read
    "Service": Kind("api/v1", "services", frozenset({"create", "patch"})),
    "StatefulSet": Kind("apis/apps/v1", "statefulsets", frozenset({"get", "create", "patch"})),
    "Pod": Kind("api/v1", "pods", frozenset({"list"})),
    # events; PodNotInjected's are counted up in place (skip_events.py): read, then patched
    "Event": Kind("api/v1", "events", frozenset({"get", "create", "patch"})),
    # the webhook: does the pod still fit its namespace's limits with the sidecar (admission_fit.py)
    "LimitRange": Kind("api/v1", "limitranges", frozenset({"list"})),
    "ResourceQuota": Kind("api/v1", "resourcequotas", frozenset({"list"})),
    # the webhook's pool index (pool_index.py), followed by every replica
    "KVCachePool": Kind("apis/kvpool.dev/v1alpha1", "kvcachepools", frozenset({"list", "watch"})),
    # which replica leads: leading.py reads kopf's peering (its verbs are with kopf's, below)
    "ClusterKopfPeering": Kind("apis/kopf.dev/v1", "clusterkopfpeerings", frozenset()),
    "KopfPeering": Kind("apis/kopf.dev/v1", "kopfpeerings", frozenset()),
}

# What kopf itself needs for this operator: watching pools and patching them (finalizer, progress
# annotations) and their status, peering (cluster-wide or, with --namespace, namespaced), its events,
# and discovery of namespaces and CRDs.
KOPF_RBAC: dict[tuple[str, str], frozenset[str]] = {
    ("kvpool.dev", "kvcachepools"): frozenset({"list", "watch", "patch"}),
    ("kvpool.dev", "kvcachepools/status"): frozenset({"patch"}),
    ("kopf.dev", "clusterkopfpeerings"): frozenset({"get", "list", "watch", "patch"}),  # get: leading.py
    ("kopf.dev", "kopfpeerings"): frozenset({"get", "list", "watch", "patch"}),
    ("", "events"): frozenset({"create"}),
    ("", "namespaces"): frozenset({"list", "watch"}),
    ("apiextensions.k8s.io", "customresourcedefinitions"): frozenset({"list", "watch"}),
}

# (apiGroup, resource) -> verbs: everything the operator's ClusterRole must grant.
RBAC: dict[tuple[str, str], frozenset[str]] = dict(KOPF_RBAC)
for _kind in KINDS.values():
    _key = (_kind.group, _kind.plural)
    RBAC[_key] = RBAC.get(_key, frozenset()) | _kind.verbs
# ownerReferences with blockOwnerDeletion need update on the owner's finalizers subresource
RBAC[("kvpool.dev", "kvcachepools/finalizers")] = frozenset({"update"})


def rbac_rules() -> list[dict[str, list[str]]]:
    """RBAC as ClusterRole rules (what `kvpool-operator --print-rbac` prints), sorted for diffing."""
    return [
        {"apiGroups": [group], "resources": [resource], "verbs": sorted(verbs)}
        for (group, resource), verbs in sorted(RBAC.items())
    ]


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status

    @property
    def gone(self) -> bool:
        """The object, or the namespace it would live in, is being deleted: nothing left to do (a 404, or
        the 403 a terminating namespace answers every create with; not a refusal worth reporting)."""
        return self.status == 404 or (self.status == 403 and "because it is being terminated" in str(self))

    @property
    def transient(self) -> bool:
        """Worth retrying as is: the server's errors, conflicts, throttling. Other 4xx (invalid, forbidden,
        over quota) answer the same until someone changes the pool, the quota or the RBAC."""
        return self.status >= 500 or self.status in (404, 408, 409, 429)


RETRY_DELAY = 10.0  # seconds before kopf runs a handler again after a transient ApiError

MESSAGE_LIMIT = 1024  # the API server's limit on an Event's message


def event_body(
    involved: Mapping[str, Any],
    type_: str,
    reason: str,
    message: str,
    *,
    name: str | None = None,
    count: int = 1,
    now: str | None = None,
) -> dict[str, Any]:
    """A core/v1 Event about `involved` (a body), named `name` (else a random name), seen `count` times."""
    meta = involved.get("metadata", {})
    namespace = meta.get("namespace") or "default"
    now = now or datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": name or f"{meta.get('name', 'kvpool')}.{uuid.uuid4().hex[:12]}",
            "namespace": namespace,
        },
        "involvedObject": {
            "apiVersion": involved.get("apiVersion"),
            "kind": involved.get("kind"),
            "name": meta.get("name"),
            "namespace": namespace,
            "uid": meta.get("uid"),
        },
        "type": type_,
        "reason": reason,
        "message": message[:MESSAGE_LIMIT],
        "source": {"component": "kvpool-operator"},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": count,
    }


def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf's login handler and this module's credentials: the pod's service account, else kubeconfig."""
    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.LoginError("no service account token and no kubeconfig")
    return info


class Kube:
    """A small async client over aiohttp; one session, re-login once on 401."""

    def __init__(self, timeout: float = 10.0) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._info: kopf.ConnectionInfo | None = None
        self._tmp: list[Any] = []
        self._lock = asyncio.Lock()  # handlers run concurrently: one session, made once

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        for f in self._tmp:
            f.close()
        self._tmp.clear()

    # --- typed calls ------------------------------------------------------------------------------

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._request("GET", self._path(kind, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def create(self, kind: str, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self._request("POST", self._path(kind, namespace), body)

    async def patch(self, kind: str, namespace: str, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self._request(
            "PATCH", self._path(kind, namespace, name), body, content_type="application/merge-patch+json"
        )

    async def patch_status(self, kind: str, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """Merge-patches the status subresource (RBAC: `<plural>/status`, granted with kopf's)."""
        await self._request(
            "PATCH",
            self._path(kind, namespace, name) + "/status",
            {"status": status},
            content_type="application/merge-patch+json",
        )

    async def ensure(self, kind: str, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Creates the object, or merge-patches it to `body` when it exists."""
        try:
            return await self.create(kind, namespace, body)
        except ApiError as e:
            if e.status != 409:
                raise
        return await self.patch(kind, namespace, body["metadata"]["name"], body)

    async def create_once(self, kind: str, namespace: str, body: Mapping[str, Any]) -> bool:
        """Creates the object unless it exists (True: made now); an existing one is kept as it is and
        never read (a generated Secret: the operator may create Secrets, not read them)."""
        try:
            await self.create(kind, namespace, body)
        except ApiError as e:
            if e.status != 409:
                raise
            return False
        return True

    async def list_pods(self, namespace: str, selector: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Pods the selector picks; the API server filters, and so do we (a proxy or mock may not)."""
        rsp = await self._request(
            "GET", self._path("Pod", namespace), params={"labelSelector": to_query(selector)}
        )
        return [
            p for p in rsp.get("items", []) if matches(selector, p.get("metadata", {}).get("labels") or {})
        ]

    async def list_objects(self, kind: str, namespace: str | None) -> tuple[list[dict[str, Any]], str]:
        """All objects of a kind in a namespace (every namespace for None), and the list's resourceVersion."""
        rsp = await self._request("GET", self._path(kind, namespace))
        return rsp.get("items", []), rsp.get("metadata", {}).get("resourceVersion", "")

    async def watch(
        self, kind: str, namespace: str | None, resource_version: str, timeout: int = 300
    ) -> AsyncIterator[dict[str, Any]]:
        """Watch events from `resource_version` until the server ends the stream (after `timeout` s)."""
        session, info = await self._connect(None)
        params = {"watch": "true", "resourceVersion": resource_version, "timeoutSeconds": str(timeout),
                  "allowWatchBookmarks": "true"}  # fmt: skip
        url, headers = self._target(info, self._path(kind, namespace))
        limits = aiohttp.ClientTimeout(total=None, connect=self._timeout.total, sock_read=timeout + 30)
        async with session.get(url, params=params, headers=headers, timeout=limits) as rsp:
            if rsp.status >= 400:
                raise ApiError(rsp.status, f"watch {url}: {(await rsp.text())[:200]}")
            async for line in rsp.content:
                if line.strip():
                    yield json.loads(line)

    async def event(self, involved: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event about `involved` (a body); failures are logged by the caller, never fatal."""
        body = event_body(involved, type_, reason, message)
        await self.create("Event", body["metadata"]["namespace"], body)

    # --- transport --------------------------------------------------------------------------------

    @staticmethod
    def _path(kind: str, namespace: str | None, name: str | None = None) -> str:
        k = KINDS[kind]
        path = f"/{k.prefix}/namespaces/{namespace}/{k.plural}" if namespace else f"/{k.prefix}/{k.plural}"
        return f"{path}/{name}" if name else path

    @staticmethod
    def _target(info: kopf.ConnectionInfo, path: str) -> tuple[str, dict[str, str]]:
        """The URL of `path` on the API server, and the headers that authenticate a JSON request."""
        return info.server.rstrip("/") + path, {"Accept": "application/json", **info.as_http_headers()}

    async def _request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        stale: aiohttp.ClientSession | None = None
        for attempt in (1, 2):
            session, info = await self._connect(stale)
            url, headers = self._target(info, path)
            if body is not None:
                headers["Content-Type"] = content_type
            async with session.request(method, url, json=body, params=params, headers=headers) as rsp:
                if rsp.status == 401 and attempt == 1:
                    stale = session  # a rotated service-account token: log in again once
                    continue
                data = await rsp.json(content_type=None) if rsp.content_length != 0 else {}
                if rsp.status >= 400:
                    message = data.get("message", "") if isinstance(data, dict) else str(data)
                    raise ApiError(rsp.status, f"{method} {path}: {message}")
                return data if isinstance(data, dict) else {}
        raise ApiError(401, f"{method} {path}: unauthorized")  # pragma: no cover (loop returns or raises)

    async def _connect(
        self, stale: aiohttp.ClientSession | None
    ) -> tuple[aiohttp.ClientSession, kopf.ConnectionInfo]:
        """The shared session; a new one (after a new login) when `stale` is still the current one."""
        async with self._lock:
            if self._session is None or self._info is None or self._session is stale:
                await self.close()
                info = await asyncio.to_thread(login)
                self._info = info
                self._session = aiohttp.ClientSession(
                    timeout=self._timeout, connector=aiohttp.TCPConnector(ssl=self._ssl(info))
                )
            return self._session, self._info

    def _ssl(self, info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
        if not info.server.startswith("https"):
            return False
        if info.insecure:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        else:
            cadata = base64.b64decode(info.ca_data).decode() if info.ca_data else None
            ctx = ssl.create_default_context(cafile=info.ca_path, cadata=cadata)
        cert = self._file(info.certificate_path, info.certificate_data)
        key = self._file(info.private_key_path, info.private_key_data)
        if cert:
            ctx.load_cert_chain(cert, key)
        return ctx

    def _file(self, path: Any, data: str | bytes | None) -> str | None:
        """Client certificates given inline (kubeconfig *-data) as a private temp file for ssl."""
        if path:
            return str(path)
        if not data:
            return None
        f = tempfile.NamedTemporaryFile(prefix="kvpool-", suffix=".pem")  # noqa: SIM115 (closed in close())
        f.write(base64.b64decode(data))
        f.flush()
        self._tmp.append(f)
        return f.name
