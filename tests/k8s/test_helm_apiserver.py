"""The chart's life on a real API server with the real helm: install (its CRD included, which the
server must accept and establish), upgrade with changed values, uninstall (the CRD stays, as helm
keeps CRDs). Its own release and peering name, so it shares the control plane with the operator's."""

from __future__ import annotations

import json

from kubeharness.controlplane import ControlPlane, crd_established, get_json
from kubeharness.operatorkit import helm
from kvtest import REPO, wait_until

RELEASE, NAMESPACE, PEERING = "lifecycle", "kvpool-lifecycle", "kvpool-lifecycle"
FULLNAME = f"{RELEASE}-kvpool"  # the chart names its objects <release>-kvpool
CRD = "kvcachepools.kvpool.dev"


def test_install_upgrade_uninstall(control_plane: ControlPlane) -> None:
    cp = control_plane
    # helm installs CRDs only when absent: start without it, so this install is the one that creates it.
    # Pools other tests left may carry a finalizer (as an older kvpool's did): released as the
    # README says to.
    remove_crd(cp)
    chart = str(REPO / "charts" / "kvpool")
    helm(cp, "install", RELEASE, chart, "--namespace", NAMESPACE, "--create-namespace", "--wait",
         "--timeout", "3m", "--set", f"operator.peering={PEERING}")  # fmt: skip
    wait_until(lambda: crd_established(cp), 60, "the chart's CRD to be Established")
    assert "Established" in cp.kubectl("get", "crd", CRD, "-o", "jsonpath={.status.conditions[*].type}")
    deployment = get_json(cp, "-n", NAMESPACE, "deployment", FULLNAME)
    assert deployment["spec"]["replicas"] == 2  # the default: a standby that also serves the webhook
    webhook = get_json(cp, "mutatingwebhookconfiguration", FULLNAME)["webhooks"][0]
    assert webhook["failurePolicy"] == "Ignore" and webhook["clientConfig"]["caBundle"]

    changed = ["--set", "operator.statsIntervalSeconds=7", "--set", "webhook.timeoutSeconds=3"]
    helm(cp, "upgrade", RELEASE, chart, "--namespace", NAMESPACE, "--reuse-values", "--wait", *changed)
    args = get_json(cp, "-n", NAMESPACE, "deployment", FULLNAME)["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert "--stats-interval=7" in args and f"--peering={PEERING}" in args
    assert get_json(cp, "mutatingwebhookconfiguration", FULLNAME)["webhooks"][0]["timeoutSeconds"] == 3
    status = json.loads(helm(cp, "status", RELEASE, "--namespace", NAMESPACE, "-o", "json", stderr=False))
    assert status["version"] == 2 and status["info"]["status"] == "deployed"

    helm(cp, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "2m")
    gone = cp.kubectl("get", f"mutatingwebhookconfiguration/{FULLNAME}", f"clusterrole/{FULLNAME}",
                      f"clusterkopfpeering/{PEERING}", "--ignore-not-found", "-o", "name")  # fmt: skip
    assert gone.strip() == ""
    assert cp.kubectl("-n", NAMESPACE, "get", "deployment", "--ignore-not-found", "-o", "name").strip() == ""
    assert crd_established(cp)  # helm keeps CRDs


def remove_crd(cp: ControlPlane) -> None:
    if cp.kubectl_result("get", "crd", CRD).returncode != 0:
        return
    pools = get_json(cp, "kvp", "-A")["items"]
    for pool in pools:
        meta = pool["metadata"]
        cp.kubectl("-n", meta["namespace"], "patch", "kvp", meta["name"], "--type=merge",
                   "-p", '{"metadata":{"finalizers":[]}}')  # fmt: skip
    cp.kubectl("delete", "crd", CRD, "--wait=true", timeout=120)
