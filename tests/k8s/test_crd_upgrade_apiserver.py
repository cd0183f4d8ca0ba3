"""Upgrading the CRD, as the README's "Upgrade" says, on a real API server with the real helm: helm
creates the chart's CRDs (crds/) on install and never touches them again, so the new CRD is applied
first, by server-side apply taking the fields over from helm (`--force-conflicts`), then the chart is
upgraded. The paths that do not work are shown not to: `helm upgrade` alone leaves the old schema (the
new field is dropped), and server-side apply without --force-conflicts conflicts with helm."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import yaml
from kubeharness.controlplane import ControlPlane, crd_established, get_json, kubectl_binary
from kubeharness.objects import CRD_PATH, pool_manifest
from kubeharness.operatorkit import HELM, helm
from kvtest import REPO, wait_until

from kvpool_operator.objects import REDIS_MAXMEMORY_FRACTION

RELEASE, NAMESPACE, PEERING = "upgrade", "kvpool-upgrade", "kvpool-upgrade"
CRD = "kvcachepools.kvpool.dev"
POOLS = "upgrade-pools"
FIELD = "upgradeNote"  # the field the next chart's CRD adds
SPEC = {"selector": {"matchLabels": {"app": "vllm"}}, "capacity": "64Mi"}


def next_chart(tmp_path: Path) -> Path:
    """This chart as its next version: the same, with one more optional field in the pool's spec."""
    chart = tmp_path / "kvpool"
    shutil.copytree(REPO / "charts" / "kvpool", chart, symlinks=False)  # the CRD's link becomes its file
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    (chart / "Chart.yaml").write_text(yaml.safe_dump({**meta, "version": "0.1.1"}))
    path = chart / "crds" / CRD_PATH.name
    crd = yaml.safe_load(path.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    spec[FIELD] = {"type": "string", "description": "A note the next version of kvpool reads."}
    path.write_text(yaml.safe_dump(crd, sort_keys=False))
    return chart


def ssa(cp: ControlPlane, manifest: str, *extra: str) -> subprocess.CompletedProcess:
    return cp.kubectl_result("apply", "--server-side", *extra, "-f", "-", stdin=manifest)


def explain(cp: ControlPlane, field: str) -> subprocess.CompletedProcess:
    return cp.kubectl_result("explain", f"kvp.spec.{field}")


def served(cp: ControlPlane) -> bool:
    """The API server publishes the new field (kubectl explain reads the published OpenAPI)."""
    return crd_established(cp) and explain(cp, FIELD).returncode == 0


def test_the_crd_upgrades_by_server_side_apply_before_helm_upgrade(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = control_plane
    remove_crd(cp)  # helm installs CRDs only when absent: this install must be the one that creates it
    helm(cp, "install", RELEASE, str(REPO / "charts" / "kvpool"), "--namespace", NAMESPACE,
         "--create-namespace", "--set", f"operator.peering={PEERING}", "--set", "replicaCount=1")  # fmt: skip
    try:
        wait_until(lambda: crd_established(cp), 60, "the chart's CRD to be Established")
        cp.kubectl("create", "namespace", POOLS)
        cp.kubectl("apply", "-f", "-", stdin=json.dumps(pool_manifest(POOLS, "kept", SPEC)))
        before = get_json(cp, "-n", POOLS, "kvp", "kept")
        chart = next_chart(tmp_path)
        noted = pool_manifest(POOLS, "noted", {**SPEC, FIELD: "hello"})

        # helm upgrade alone: the release is upgraded, the CRD is not (helm never upgrades crds/)
        helm(cp, "upgrade", RELEASE, str(chart), "--namespace", NAMESPACE, "--reuse-values")
        assert explain(cp, FIELD).returncode != 0
        refused = cp.kubectl_result("apply", "-f", "-", stdin=json.dumps(noted))
        assert refused.returncode != 0 and f'unknown field "spec.{FIELD}"' in refused.stderr

        # server-side apply without --force-conflicts: helm is the fields' manager
        crds = helm(cp, "show", "crds", str(chart), stderr=False)
        conflict = ssa(cp, crds)
        assert conflict.returncode != 0 and "conflict" in conflict.stderr.lower()
        assert '"helm"' in conflict.stderr, conflict.stderr
        assert explain(cp, FIELD).returncode != 0

        # the README's path: the chart's CRDs by server-side apply, taking them over, then helm upgrade
        upgraded = pipe_crds(cp, chart)
        assert upgraded.returncode == 0, upgraded.stderr
        helm(cp, "upgrade", RELEASE, str(chart), "--namespace", NAMESPACE, "--reuse-values")
        wait_until(lambda: served(cp), 60, f"the API server to serve spec.{FIELD}")
        assert "A note the next version of kvpool reads." in explain(cp, FIELD).stdout
        cp.kubectl("apply", "-f", "-", stdin=json.dumps(noted))
        assert get_json(cp, "-n", POOLS, "kvp", "noted")["spec"][FIELD] == "hello"  # kept, not pruned
        after = get_json(cp, "-n", POOLS, "kvp", "kept")
        assert after["metadata"]["uid"] == before["metadata"]["uid"] and after["spec"] == before["spec"]
        managers = {
            m["manager"]
            for m in get_json(cp, "crd", CRD, "--show-managed-fields")["metadata"]["managedFields"]
        }
        assert "kubectl" in managers
        # the next upgrade is the same two commands, and still works
        again = pipe_crds(cp, chart)
        assert again.returncode == 0, again.stderr
        (release,) = json.loads(helm(cp, "list", "--namespace", NAMESPACE, "-o", "json", stderr=False))
        assert (release["status"], release["chart"]) == ("deployed", "kvpool-0.1.1")

        # what kubectl explain says of the served CRD is the code's (as test_crd_descriptions.py holds)
        memory = " ".join(explain(cp, "redis.memory").stdout.split())
        assert f"maxmemory is {REDIS_MAXMEMORY_FRACTION:.0%} of it" in memory
        assert "(default 4Gi)" in " ".join(explain(cp, "capacity").stdout.split())
    finally:
        helm(cp, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "1m", check=False)
        # gone before the next module's operators start: they would reconcile its pools as it terminates
        cp.kubectl("delete", "namespace", POOLS, "--ignore-not-found", "--wait=true", timeout=120)
        # the tests after this one get this repository's CRD back
        cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_PATH))
        wait_until(lambda: explain(cp, FIELD).returncode != 0, 60, "the repository's CRD to be served again")


def pipe_crds(cp: ControlPlane, chart: Path) -> subprocess.CompletedProcess:
    """`helm show crds CHART | kubectl apply --server-side --force-conflicts -f -`, as the README has it."""
    show = f"{HELM} show crds {chart}"
    apply = f"{kubectl_binary()} --kubeconfig {cp.kubeconfig} apply --server-side --force-conflicts -f -"
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", f"{show} | {apply}"], capture_output=True, text=True
    )


def remove_crd(cp: ControlPlane) -> None:
    if cp.kubectl_result("get", "crd", CRD).returncode != 0:
        return
    for pool in get_json(cp, "kvp", "-A")["items"]:  # an older kvpool's finalizer, released
        meta = pool["metadata"]
        if meta.get("finalizers"):
            cp.kubectl("-n", meta["namespace"], "patch", "kvp", meta["name"], "--type=merge",
                       "-p", '{"metadata":{"finalizers":[]}}')  # fmt: skip
    cp.kubectl("delete", "crd", CRD, "--wait=true", timeout=120)
