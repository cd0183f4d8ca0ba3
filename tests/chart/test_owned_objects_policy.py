"""The ValidatingAdmissionPolicy that keeps the operator's ServiceAccount to the objects it owns: it
covers every kind the operator writes (kube.KINDS, events aside), by the label the operator puts on
what it makes (names.owned_labels), for that ServiceAccount only; off with the values toggle, and left
out where the cluster has no admissionregistration.k8s.io/v1 policies. The API server's verdicts are
in tests/k8s/test_owned_objects_apiserver.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from chartkit import CHART, NAMESPACE, RELEASE, find, of_kind, run_helm

from kvpool_operator import kube, names

WRITES = {"create", "update", "patch", "delete"}
POLICY_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


def policy_objects(*args: str) -> list[dict]:
    result = run_helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)
    assert result.returncode == 0, result.stderr
    return [o for o in yaml.safe_load_all(result.stdout) if o and o["kind"] in POLICY_KINDS]


def test_the_policy_covers_every_kind_the_operator_writes_but_its_events(rendered: Callable) -> None:
    policy = find(rendered(None), "ValidatingAdmissionPolicy")
    covered = set()
    for rule in policy["spec"]["matchConstraints"]["resourceRules"]:
        assert sorted(rule["operations"]) == ["CREATE", "DELETE", "UPDATE"]
        covered |= {(group, resource) for group in rule["apiGroups"] for resource in rule["resources"]}
    written = {(k.group, k.plural) for name, k in kube.KINDS.items() if k.verbs & WRITES and name != "Event"}
    assert covered == written
    # kopf's writes (pools, their status, the peering) and the events are not these kinds
    assert not {group for group, _ in covered} & {"kvpool.dev", "kopf.dev", "events.k8s.io"}


def test_the_policy_binds_the_operators_service_account_to_its_own_label(rendered: Callable) -> None:
    objects = rendered(None)
    policy = find(objects, "ValidatingAdmissionPolicy")
    (account,) = of_kind(objects, "ServiceAccount")
    (condition,) = policy["spec"]["matchConditions"]
    user = f"system:serviceaccount:{NAMESPACE}:{account['metadata']['name']}"
    assert condition["expression"] == f'request.userInfo.username == "{user}"'
    label, ownership = policy["spec"]["validations"]
    assert f"'{names.MANAGED_BY_LABEL}'].orValue('') == '{names.MANAGED_BY}'" in label["expression"]
    assert names.owned_labels("p", "redis")[names.MANAGED_BY_LABEL] == names.MANAGED_BY
    assert f"r.kind == '{names.KIND}'" in ownership["expression"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert {v["reason"] for v in policy["spec"]["validations"]} == {"Forbidden"}
    binding = find(objects, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], 2),
        (["--set", "rbac.ownedObjectsOnly=false"], 0),
        (["--set", "rbac.create=false", "--set", "serviceAccount.name=mine"], 0),
        (["--kube-version", "1.29.9"], 0),  # no admissionregistration.k8s.io/v1 policies before 1.30
        (
            [
                "--kube-version",
                "1.29.9",
                "--api-versions",
                "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy",
            ],
            2,
        ),
    ],
    ids=["default", "toggled off", "no rbac", "1.29", "1.29 with the kind"],
)
def test_the_policy_is_rendered_where_it_can_hold(helm: Path, args: list[str], expected: int) -> None:
    assert len(policy_objects(*args)) == expected


def test_cert_manager_is_refused_where_the_cluster_has_none(helm: Path) -> None:
    """Without cert-manager's API the Certificate and Issuer would fail the install half-way ("no
    matches for kind"): the render stops first, saying what to do."""
    values = ["--values", str(CHART / "ci" / "cert-manager-values.yaml")]
    refused = run_helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *values)
    assert refused.returncode != 0
    assert "install cert-manager first, or leave webhook.certManager.enabled off" in refused.stderr
    with_it = ["--api-versions", "cert-manager.io/v1"]
    accepted = run_helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *values, *with_it)
    assert accepted.returncode == 0, accepted.stderr
    assert "kind: Certificate" in accepted.stdout
