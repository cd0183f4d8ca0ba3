"""Least privilege, derived from the code: the chart's RBAC grants exactly what the operator needs.

What it needs comes from two places, neither a hand-kept list of permissions:
- the operator's own calls, read from its source: every call on its Kubernetes client (kube.Kube)
  with the kind it names, e.g. `kube.ensure("Service", ...)` (create, then patch on conflict);
- kopf's calls, recorded: the real operator runs against kmock (a Kubernetes API emulator) through
  a scenario that creates, scales and deletes pools, watching all namespaces, and every request it
  sends is mapped to (apiGroup, resource, verb).
The rendered roles must allow every recorded request (names included where a rule lists
resourceNames) and grant nothing beyond the union of the two, plus the one need no request shows.

Watching only some namespaces cannot be recorded: kopf then starts by listing namespaces, a path
kmock 0.8 cannot parse (500). That mode's needs are the recorded ones with kopf's namespaced peering
in place of the cluster one, plus that namespace listing (kopf's observation.namespace_observer).
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from chartkit import CHART, REPO, find, of_kind
from kubeharness.emulator import KubeAPI, MemoryGauge, operator_on_kmock
from kubeharness.objects import CRD_PATH, apps_path, core_path, pool_path
from kvtest import free_port, wait_until

from kvpool_operator import kube

Grant = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)

# The verbs each method of the operator's client (kube.Kube) sends; a new method fails the test
# until it is described here.
CLIENT_METHOD_VERBS: dict[str, frozenset[str]] = {
    "get": frozenset({"get"}),
    "create": frozenset({"create"}),
    "patch": frozenset({"patch"}),
    "ensure": frozenset({"create", "patch"}),
    "create_once": frozenset({"create"}),
    "list_objects": frozenset({"list"}),
    "watch": frozenset({"watch"}),
    "patch_status": frozenset({"patch"}),
}
CLIENT_FIXED_KIND = {"list_pods": ("Pod", frozenset({"list"})), "event": ("Event", frozenset({"create"}))}
# Methods that act on a subresource of the kind they name.
CLIENT_SUBRESOURCE = {"patch_status": "status"}
# A need no request shows: creating objects whose ownerReference sets blockOwnerDeletion is checked
# by the API server against `update` on the owner's finalizers (OwnerReferencesPermissionEnforcement).
ADMISSION_ONLY: set[Grant] = {("kvpool.dev", "kvcachepools/finalizers", "update")}


def operator_calls() -> set[Grant]:
    """(group, resource, verb) of every call the operator's code makes through kube.Kube."""
    public = {
        node.name
        for cls in ast.parse(Path(kube.__file__).read_text()).body
        if isinstance(cls, ast.ClassDef) and cls.name == "Kube"
        for node in cls.body
        if isinstance(node, ast.AsyncFunctionDef) and not node.name.startswith("_")
    }
    undescribed = public - set(CLIENT_METHOD_VERBS) - set(CLIENT_FIXED_KIND) - {"close"}
    assert not undescribed, f"describe the verbs of kube.Kube.{undescribed} in CLIENT_METHOD_VERBS"

    grants: set[Grant] = set()
    for source in Path(kube.__file__).parent.glob("*.py"):
        if source.name == "kube.py":
            continue
        for node in ast.walk(ast.parse(source.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            receiver = ast.unparse(node.func.value)
            if not (receiver == "kube" or receiver.endswith(".kube")):
                continue
            method = node.func.attr
            if method in CLIENT_FIXED_KIND:
                kind_name, verbs = CLIENT_FIXED_KIND[method]
            elif method in CLIENT_METHOD_VERBS:
                first = node.args[0] if node.args else None
                assert isinstance(first, ast.Constant) and isinstance(first.value, str), (
                    f"{source.name}:{node.lineno}: the kind must be a literal so RBAC can be derived"
                )
                kind_name, verbs = first.value, CLIENT_METHOD_VERBS[method]
            else:
                continue
            kind = kube.KINDS[kind_name]
            resource = kind.plural + (
                f"/{CLIENT_SUBRESOURCE[method]}" if method in CLIENT_SUBRESOURCE else ""
            )
            grants |= {(kind.group, resource, verb) for verb in verbs}
    assert grants, "no calls found: has the client moved?"
    return grants


# --- the kmock scenario ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    group: str
    resource: str
    verb: str
    name: str | None


def to_request(r: Any) -> Request | None:
    """A kmock request as RBAC sees it; None for discovery, which every client may read."""
    if r.resource is None or r.resource.plural is None:
        return None
    method = str(r.method.value).upper()
    if method == "GET":
        verb = "watch" if r.params.get("watch") in ("true", "1") else ("get" if r.name else "list")
    else:
        verb = {"POST": "create", "PATCH": "patch", "PUT": "update"}.get(method) or (
            "delete" if r.name else "deletecollection"
        )
    resource = r.resource.plural + (f"/{r.subresource}" if r.subresource else "")
    return Request(r.resource.group or "", resource, verb, r.name)


def sent_by_operator(api: KubeAPI) -> list[Request]:
    """What the operator sent: it authenticates with the kubeconfig's token, the test's client does not."""

    async def read() -> list[Any]:
        return [r for r in list(api.emulator) if "authorization" in {k.lower() for k in r.headers}]

    return [req for req in map(to_request, api.thread.call(read())) if req is not None]


def shared_pool(namespace: str) -> dict[str, Any]:
    pool = yaml.safe_load((REPO / "examples" / "shared-redis.yaml").read_text())
    pool["metadata"]["namespace"] = namespace
    pool["spec"]["scaling"] = {"minReplicas": 1, "maxReplicas": 2, "capacityPercent": 300}
    pool["spec"]["redis"]["replicas"] = 1
    return pool


def external_pool(namespace: str) -> dict[str, Any]:
    pool = yaml.safe_load((REPO / "examples" / "external-redis.yaml").read_text())
    pool["metadata"]["namespace"] = namespace
    return pool


def run_scenario(tmp: Path) -> list[Request]:
    """Pools created, a pod matched, the shared tier scaled up, pools deleted; returns the requests."""
    crd = yaml.safe_load(CRD_PATH.read_text())
    memory = MemoryGauge()
    argv = ["--webhook-insecure", "--webhook-addr", "127.0.0.1", "--webhook-port", str(free_port()),
            "--stats-interval", "0.3", "--scale-cooldown", "0",
            "--liveness", "", "--readiness", ""]  # fmt: skip
    ns = "rbac"
    with operator_on_kmock(crd, tmp, argv, memory) as (api, operator):
        try:
            shared, external = shared_pool(ns), external_pool(ns)
            api.create(pool_path(ns), shared)
            api.create(pool_path(ns), external)
            labels = shared["spec"]["selector"]["matchLabels"]
            injected = {"kvpool.dev/pool": shared["metadata"]["name"]}  # as the webhook labels it
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": "vllm-0",
                    "namespace": ns,
                    "labels": {**labels, **injected},
                    "annotations": {"kvpool.dev/status-port": "7071"},
                },
                "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
            }
            api.create(core_path(ns, "pods"), pod)
            sts = apps_path(ns, "statefulsets", f"{shared['metadata']['name']}-kvpool-redis")
            wait_until(lambda: api.get(sts), 30, "the shard StatefulSet")
            # the pod turns Ready: its 8Gi arena x 300% needs more than one 11.2 GiB shard
            ready = {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "conditions": [{"type": "Ready", "status": "True"}],
            }
            api.patch(core_path(ns, "pods", "vllm-0"), {"status": ready})
            wait_until(
                lambda: (api.get(sts) or {}).get("spec", {}).get("replicas") == 2, 30, "the tier to scale up"
            )
            for pool in (shared, external):
                path = pool_path(ns, pool["metadata"]["name"])
                api.delete(path)
                wait_until(lambda path=path: api.get(path) is None, 30, "the pool's deletion to complete")
        finally:
            operator.stop()  # everything it sent, then the emulator goes
            requests = sent_by_operator(api)
    return requests


def as_namespaced(requests: list[Request]) -> list[Request]:
    """The recorded requests as an operator watching some namespaces sends them (see the docstring)."""
    peering = [
        Request(r.group, "kopfpeerings", r.verb, r.name)
        for r in requests
        if r.resource == "clusterkopfpeerings"
    ]
    others = [r for r in requests if r.resource != "clusterkopfpeerings"]
    return (
        others + peering + [Request("", "namespaces", "list", None), Request("", "namespaces", "watch", None)]
    )


# --- the chart's side -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    groups: frozenset[str]
    resources: frozenset[str]
    verbs: frozenset[str]
    names: frozenset[str]  # empty: any name

    def allows(self, req: Request) -> bool:
        return (
            req.group in self.groups
            and req.resource in self.resources
            and req.verb in self.verbs
            and (not self.names or req.name in self.names)
        )


def chart_rules(objects: list[dict]) -> list[Rule]:
    """The rules of every ClusterRole the operator's service account is bound to."""
    bound = {
        b["roleRef"]["name"] for b in of_kind(objects, "ClusterRoleBinding") + of_kind(objects, "RoleBinding")
    }
    sa = find(objects, "ServiceAccount")["metadata"]["name"]
    for b in of_kind(objects, "ClusterRoleBinding") + of_kind(objects, "RoleBinding"):
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "kvpool-system"}]
    assert not of_kind(objects, "Role"), "every rule is in a ClusterRole"
    rules = [
        r
        for role in of_kind(objects, "ClusterRole")
        if role["metadata"]["name"] in bound
        for r in role["rules"]
    ]
    return [
        Rule(*(frozenset(r.get(k, [])) for k in ("apiGroups", "resources", "verbs", "resourceNames")))
        for r in rules
    ]


def granted(rules: list[Rule]) -> set[Grant]:
    return {(g, r, v) for rule in rules for g in rule.groups for r in rule.resources for v in rule.verbs}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> list[Request]:
    return run_scenario(tmp_path_factory.mktemp("rbac"))


MODES = {
    "all-namespaces": (None, lambda r: r),
    "namespaced": (CHART / "ci" / "namespaced-values.yaml", as_namespaced),
}


@pytest.fixture(params=list(MODES))
def mode(request: pytest.FixtureRequest, recorded: list[Request]) -> tuple:
    values, translate = MODES[request.param]
    return values, translate(recorded)


def test_every_request_the_operator_sent_is_allowed(rendered: Callable, mode: tuple) -> None:
    values, requests = mode
    rules = chart_rules(rendered(values))
    denied = sorted(
        {(r.group, r.resource, r.verb, r.name) for r in requests if not any(x.allows(r) for x in rules)}
    )
    assert not denied, f"the chart's roles deny: {denied}"


def test_nothing_more_is_granted(rendered: Callable, mode: tuple) -> None:
    values, requests = mode
    needed = operator_calls() | {(r.group, r.resource, r.verb) for r in requests} | ADMISSION_ONLY
    extra = granted(chart_rules(rendered(values))) - needed
    assert not extra, f"granted but never needed: {sorted(extra)}"
    grants = granted(chart_rules(rendered(values)))
    # leading.py reads the peering kopf uses in the chart's mode: the cluster one or the namespaced one
    cluster = ("kopf.dev", "clusterkopfpeerings", "patch") in grants
    other_mode = {("kopf.dev", "kopfpeerings" if cluster else "clusterkopfpeerings", "get")}
    missing = operator_calls() - other_mode - grants
    assert not missing, f"the operator's code calls but the chart does not grant: {sorted(missing)}"


def test_operator_calls_are_found_in_the_source() -> None:
    calls = operator_calls()
    # spot checks that the derivation reads the code (each line exists in reconcile.py / shards.py)
    assert ("apps", "statefulsets", "patch") in calls and ("", "pods", "list") in calls
    assert ("", "secrets", "create") in calls and ("", "events", "create") in calls
