"""Least privilege that holds, on a real API server: the chart's RBAC lets the operator's ServiceAccount
patch StatefulSets in every namespace, kube-system's included; the chart's ValidatingAdmissionPolicy
refuses it every write to an object that is not kvpool's own, naming the policy, and lets through what
the operator does (its own objects, created owned by a pool; events; its pools). Turned off with the
values toggle, the same foreign patch goes through: the refusal is the policy's, not RBAC's.

The ServiceAccount is impersonated (`kubectl --as`, as an admin may), so no operator process is needed;
the operator's own tests (test_operator_apiserver.py, test_ha_apiserver.py) run under the policy."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from typing import Any

from kubeharness.controlplane import ControlPlane, get_json
from kubeharness.objects import pool_manifest, pool_path
from kubeharness.operatorkit import helm
from kvtest import REPO, wait_until

from kvpool_operator import names

RELEASE, NAMESPACE, PEERING = "owned", "kvpool-owned", "kvpool-owned"
FULLNAME = f"{RELEASE}-kvpool"
POLICY = f"{FULLNAME}-owned-objects"
OPERATOR = f"system:serviceaccount:{NAMESPACE}:{FULLNAME}"  # the chart's ServiceAccount
APPS = "owned-apps"
MINE = {names.MANAGED_BY_LABEL: names.MANAGED_BY}


def statefulset(namespace: str, name: str, labels: dict[str, str]) -> dict[str, Any]:
    pod = {"metadata": {"labels": {"app": name}}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": 0,
            "serviceName": name,
            "selector": {"matchLabels": {"app": name}},
            "template": pod,
        },
    }


def as_operator(cp: ControlPlane, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return cp.kubectl_result(f"--as={OPERATOR}", *args, stdin=stdin)


def annotate(cp: ControlPlane, namespace: str, name: str, *args: str) -> subprocess.CompletedProcess:
    patch = '{"metadata":{"annotations":{"kvpool.dev/test":"patched"}}}'
    return as_operator(cp, "-n", namespace, "patch", "statefulset", name, "--type=merge", "-p", patch, *args)


def patch_as_operator(cp: ControlPlane, path: str, body: dict[str, Any]) -> int:
    """A merge patch sent as the operator's ServiceAccount, as kopf sends it (no GET first, unlike
    kubectl patch); the HTTP status."""
    headers = {"Content-Type": "application/merge-patch+json", "Impersonate-User": OPERATOR}
    data = json.dumps(body).encode()
    request = urllib.request.Request(cp.server + path, data=data, method="PATCH", headers=headers)
    try:
        with urllib.request.urlopen(request, context=cp.ssl_context, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return e.code


def refused_by_policy(result: subprocess.CompletedProcess) -> bool:
    return result.returncode != 0 and POLICY in result.stderr and "denied request" in result.stderr


def test_the_operator_may_write_only_what_it_owns(crd_installed: ControlPlane) -> None:
    cp = crd_installed
    chart = str(REPO / "charts" / "kvpool")
    helm(cp, "install", RELEASE, chart, "--namespace", NAMESPACE, "--create-namespace", "--set",
         f"operator.peering={PEERING}", "--set", "replicaCount=1")  # fmt: skip
    try:
        cp.kubectl("create", "namespace", APPS)
        for doc in (statefulset("kube-system", "not-kvpools", {"app": "x"}),
                    statefulset("kube-system", "kvpools", MINE)):  # fmt: skip
            cp.kubectl("apply", "-f", "-", stdin=json.dumps(doc))
        # RBAC grants it (the policy is all that stands in the way)
        assert (
            cp.kubectl(
                "auth", "can-i", "patch", "statefulsets", "-n", "kube-system", f"--as={OPERATOR}"
            ).strip()
            == "yes"
        )

        # the API server takes a new policy up within moments: polled by a dry run, which changes nothing
        wait_until(
            lambda: refused_by_policy(annotate(cp, "kube-system", "not-kvpools", "--dry-run=server")),
            30,
            "the API server to refuse the operator's patch of a StatefulSet in kube-system by the policy",
        )
        refusal = annotate(cp, "kube-system", "not-kvpools")
        assert refused_by_policy(refusal), refusal.stderr
        assert (
            "managed-by=kvpool-operator" in refusal.stderr
            and "kube-system/not-kvpools is not" in refusal.stderr
        )
        assert "kvpool.dev/test" not in (
            get_json(cp, "-n", "kube-system", "sts", "not-kvpools")["metadata"].get("annotations") or {}
        )
        allowed = annotate(cp, "kube-system", "kvpools")
        assert allowed.returncode == 0, allowed.stderr
        # nor can it make a foreign object its own
        relabel = as_operator(cp, "-n", "kube-system", "label", "statefulset", "not-kvpools",
                              f"{names.MANAGED_BY_LABEL}={names.MANAGED_BY}")  # fmt: skip
        assert refused_by_policy(relabel), relabel.stderr

        # what it creates carries its label and a pool as controller, as the operator's objects do
        cp.kubectl("apply", "-f", "-", stdin=json.dumps(pool_manifest(APPS, "fleet", {
            "selector": {"matchLabels": {"app": "vllm"}}})))  # fmt: skip
        pool = get_json(cp, "-n", APPS, "kvp", "fleet")
        owner = {"apiVersion": names.API_VERSION, "kind": names.KIND, "name": "fleet",
                 "uid": pool["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}  # fmt: skip
        meta: dict[str, Any] = {
            "name": "fleet-kvpool",
            "namespace": APPS,
            "labels": MINE,
            "ownerReferences": [owner],
        }
        owned: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "data": {"k": "v"},
            "metadata": meta,
        }
        created = as_operator(cp, "create", "-f", "-", stdin=json.dumps(owned))
        assert created.returncode == 0, created.stderr
        orphan = {**owned, "metadata": {"name": "orphan", "namespace": "kube-system", "labels": MINE}}
        refused = as_operator(cp, "create", "-f", "-", stdin=json.dumps(orphan))
        assert refused_by_policy(refused), refused.stderr
        unlabelled = {**owned, "metadata": {**meta, "name": "unlabelled", "labels": {}}}
        refused = as_operator(cp, "create", "-f", "-", stdin=json.dumps(unlabelled))
        assert refused_by_policy(refused), refused.stderr
        # its events and its pools are not the policy's business
        event = {"apiVersion": "v1", "kind": "Event", "metadata": {"name": "fleet.owned", "namespace": APPS},
                 "involvedObject": {"kind": names.KIND, "name": "fleet", "namespace": APPS},
                 "reason": "Test", "message": "from the operator", "type": "Normal"}  # fmt: skip
        posted = as_operator(cp, "create", "-f", "-", stdin=json.dumps(event))
        assert posted.returncode == 0, posted.stderr
        pool_url = pool_path(APPS, "fleet")  # as kopf patches: its annotations, then the status
        assert (
            patch_as_operator(cp, pool_url, {"metadata": {"annotations": {"kopf.zalando.org/x": "{}"}}})
            == 200
        )
        assert patch_as_operator(cp, f"{pool_url}/status", {"status": {"matchedPods": 0}}) == 200

        # turned off, the same patch goes through: RBAC alone would have let it
        helm(cp, "upgrade", RELEASE, chart, "--namespace", NAMESPACE, "--reuse-values",
             "--set", "rbac.ownedObjectsOnly=false")  # fmt: skip
        wait_until(
            lambda: annotate(cp, "kube-system", "not-kvpools").returncode == 0,
            30,
            "the foreign patch to go through without the policy",
        )
    finally:
        cp.kubectl("delete", "namespace", APPS, "--ignore-not-found", "--wait=false")
        cp.kubectl(
            "-n", "kube-system", "delete", "statefulset", "not-kvpools", "kvpools", "--ignore-not-found"
        )
        helm(cp, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "1m", check=False)
