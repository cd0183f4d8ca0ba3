"""`helm template` with the default values and each example values file, validated by
`kubernetes-validate --strict` against the oldest Kubernetes the chart supports and the newest known;
then what the schemas cannot see: probes, security, the webhook's wiring and TLS, selectors."""

from __future__ import annotations

import base64
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
import yaml
from chartkit import (
    CHART,
    EXAMPLE_VALUES,
    NAMESPACE,
    find,
    of_kind,
    render,
    render_text,
    run_helm,
    template_args,
)

VALUES = [None, *EXAMPLE_VALUES]
VALUE_IDS = ["defaults", *(p.name for p in EXAMPLE_VALUES)]
KUBERNETES_VERSIONS = ["1.28.0", "1.37.0"]  # Chart.yaml's kubeVersion floor, and the newest known
# Kinds kubernetes-validate has no schema for; each is checked below by other means.
CUSTOM_KINDS = {"ClusterKopfPeering", "KopfPeering", "PodMonitor", "ServiceMonitor", "PrometheusRule",
                "Certificate", "Issuer"}  # fmt: skip


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("values_file", VALUES, ids=VALUE_IDS)
def test_kubernetes_validate_strict(helm: Path, values_file: Path | None, version: str) -> None:
    manifest = render_text(values_file)
    result = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", version, "-"],
        input=manifest,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ERROR" not in result.stdout
    unknown = set(re.findall(r"Couldn't find schema for kind (\S+)", result.stdout))
    if tuple(map(int, version.split("."))) < (1, 30):  # policies came in 1.30: checked at the newest
        unknown -= {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    assert unknown <= CUSTOM_KINDS, f"not validated: {unknown - CUSTOM_KINDS}"
    passed = re.findall(r"passed for resource (\S+)/", result.stdout)
    assert len(passed) + result.stdout.count("WARN") == len([d for d in yaml.safe_load_all(manifest) if d])


def _crd_schema(objects: list[dict], kind: str) -> dict:
    crd = next(o for o in of_kind(objects, "CustomResourceDefinition") if o["spec"]["names"]["kind"] == kind)
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("values_file", VALUES, ids=VALUE_IDS)
def test_peering_objects_match_their_crd(rendered: Callable, values_file: Path | None) -> None:
    objects = rendered(values_file)
    peerings = of_kind(objects, "ClusterKopfPeering") + of_kind(objects, "KopfPeering")
    assert peerings, "the chart creates the peering object kopf needs"
    for peering in peerings:
        jsonschema.validate(peering, _crd_schema(objects, peering["kind"]))
        assert peering["metadata"]["name"] == "kvpool" or values_file is not None


def _operator(objects: list[dict]) -> dict:
    return find(objects, "Deployment")["spec"]["template"]


@pytest.mark.parametrize("values_file", VALUES, ids=VALUE_IDS)
def test_operator_pod_is_locked_down(rendered: Callable, values_file: Path | None) -> None:
    pod = _operator(rendered(values_file))
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["runAsUser"] != 0
    for c in pod["spec"]["containers"]:
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"]
    spec = pod["spec"]
    assert not spec.get("hostNetwork") and not spec.get("hostIPC") and not spec.get("hostPID")
    assert all("hostPath" not in v for v in spec["volumes"])


@pytest.mark.parametrize("values_file", VALUES, ids=VALUE_IDS)
def test_operator_accepts_its_arguments(rendered: Callable, values_file: Path | None) -> None:
    """The Deployment's arguments parse with the operator's own parser and mean what the chart says."""
    from kvpool_operator.cli import parser

    objects = rendered(values_file)
    container = _operator(objects)["spec"]["containers"][0]
    args = parser().parse_args(container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert args.webhook_port == ports["webhook"] and args.webhook_addr == ""
    assert not args.webhook_insecure and not args.standalone
    peerings = of_kind(objects, "ClusterKopfPeering") + of_kind(objects, "KopfPeering")
    assert {p["metadata"]["name"] for p in peerings} == {args.peering}
    assert bool(of_kind(objects, "ClusterKopfPeering")) == (not args.namespace)


@pytest.mark.parametrize("values_file", VALUES, ids=VALUE_IDS)
def test_probes_use_kopfs_liveness_endpoint(rendered: Callable, values_file: Path | None) -> None:
    container = _operator(rendered(values_file))["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    liveness = next(a for a in container["args"] if a.startswith("--liveness="))
    url = re.fullmatch(r"--liveness=http://0\.0\.0\.0:(\d+)(/\S+)", liveness)
    assert url, liveness
    for probe in ("startupProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert ports[get["port"]] == int(url.group(1)) and get["path"] == url.group(2)
    readiness = next(a for a in container["args"] if a.startswith("--readiness="))
    ready = re.fullmatch(r"--readiness=http://0\.0\.0\.0:(\d+)(/\S+)", readiness)
    get = container["readinessProbe"]["httpGet"]
    assert ready and ports[get["port"]] == int(ready.group(1)) and get["path"] == ready.group(2)


@pytest.mark.parametrize("values_file", VALUES, ids=VALUE_IDS)
def test_webhook_is_wired_to_the_operator(rendered: Callable, values_file: Path | None) -> None:
    objects = rendered(values_file)
    pod = _operator(objects)
    container = pod["spec"]["containers"][0]
    (hook,) = find(objects, "MutatingWebhookConfiguration")["webhooks"]
    assert (
        hook["failurePolicy"] == "Ignore"
        and hook["sideEffects"] == "NoneOnDryRun"
        and hook["timeoutSeconds"] <= 5
    )
    assert hook["rules"] == [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "operations": ["CREATE"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    ref = hook["clientConfig"]["service"]
    assert ref["path"] == "/kvpool-inject" and ref["namespace"] == NAMESPACE
    service = find(objects, "Service", ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]]
    assert port["targetPort"] in {p["name"] for p in container["ports"]}
    labels = pod["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    # The operator's own pods are never sent to its webhook.
    assert {"key": "kvpool.dev/inject", "operator": "NotIn", "values": ["false"]} in hook["objectSelector"][
        "matchExpressions"
    ]
    assert labels["kvpool.dev/inject"] == "false"


HELM_TLS = [(v, i) for v, i in zip(VALUES, VALUE_IDS, strict=True) if i != "cert-manager-values.yaml"]


@pytest.mark.parametrize("values_file", [v for v, _ in HELM_TLS], ids=[i for _, i in HELM_TLS])
def test_webhook_certificate_is_signed_by_the_ca_bundle(
    rendered: Callable, values_file: Path | None, tmp_path: Path
) -> None:
    objects = rendered(values_file)
    (hook,) = find(objects, "MutatingWebhookConfiguration")["webhooks"]
    ref = hook["clientConfig"]["service"]
    secret = next(s for s in of_kind(objects, "Secret") if s["type"] == "kubernetes.io/tls")
    (tmp_path / "ca.crt").write_bytes(base64.b64decode(hook["clientConfig"]["caBundle"]))
    (tmp_path / "tls.crt").write_bytes(base64.b64decode(secret["data"]["tls.crt"]))
    (tmp_path / "tls.key").write_bytes(base64.b64decode(secret["data"]["tls.key"]))
    dns = f"{ref['name']}.{ref['namespace']}.svc"
    verify = subprocess.run(
        ["openssl", "verify", "-verify_hostname", dns, "-CAfile", tmp_path / "ca.crt", tmp_path / "tls.crt"],
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    key_pub = subprocess.run(
        ["openssl", "pkey", "-in", tmp_path / "tls.key", "-pubout"], capture_output=True, text=True
    ).stdout
    cert_pub = subprocess.run(
        ["openssl", "x509", "-in", tmp_path / "tls.crt", "-pubkey", "-noout"], capture_output=True, text=True
    ).stdout
    assert key_pub and key_pub == cert_pub, "the key does not belong to the certificate"
    # The operator serves the Secret's files.
    pod = _operator(objects)
    mount = next(m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "webhook-tls")
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "webhook-tls")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    args = pod["spec"]["containers"][0]["args"]
    assert f"--webhook-cert={mount['mountPath']}/tls.crt" in args
    assert f"--webhook-key={mount['mountPath']}/tls.key" in args


def test_namespaced_install_stays_in_its_namespaces(rendered: Callable) -> None:
    values = CHART / "ci" / "namespaced-values.yaml"
    watched = yaml.safe_load(values.read_text())["watch"]["namespaces"]
    objects = rendered(values)
    args = _operator(objects)["spec"]["containers"][0]["args"]
    assert "--all-namespaces" not in args
    assert [a for a in args if a.startswith("--namespace=")] == [f"--namespace={n}" for n in watched]
    assert sorted(b["metadata"]["namespace"] for b in of_kind(objects, "RoleBinding")) == sorted(watched)
    assert sorted(p["metadata"]["namespace"] for p in of_kind(objects, "KopfPeering")) == sorted(watched)
    assert not of_kind(objects, "ClusterKopfPeering")
    (hook,) = find(objects, "MutatingWebhookConfiguration")["webhooks"]
    assert hook["namespaceSelector"]["matchExpressions"] == [
        {"key": "kvpool.dev/injection", "operator": "In", "values": ["enabled"]},
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn",
         "values": ["kube-system", "kube-public", "kube-node-lease", "kvpool-system"]},
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": watched},
    ]  # fmt: skip
    # Only the namespaced role's binding is cluster-wide-free.
    assert [b["roleRef"]["name"] for b in of_kind(objects, "ClusterRoleBinding")] == ["kvp-kvpool-cluster"]


def test_disruption_budget_selects_the_operator(rendered: Callable) -> None:
    objects = rendered(CHART / "ci" / "namespaced-values.yaml")
    pdb = find(objects, "PodDisruptionBudget")
    labels = _operator(objects)["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in pdb["spec"]["selector"]["matchLabels"].items())
    assert find(objects, "Deployment")["spec"]["replicas"] > pdb["spec"]["minAvailable"]
    assert of_kind(rendered(None), "PodDisruptionBudget")  # two replicas by default
    assert not of_kind(rendered(None, "replicaCount=1"), "PodDisruptionBudget")  # would block drains


@pytest.mark.parametrize("legacy", [False, True], ids=["native-sidecar", "legacy-sidecar"])
def test_pod_monitor_scrapes_the_injected_sidecars(rendered: Callable, legacy: bool) -> None:
    """The PodMonitor selects what the operator's own injection makes of a pod, on its status port."""
    from kvpool_operator.injection import inject
    from kvpool_operator.pool import parse_pool
    from kvpool_operator.settings import OperatorSettings

    assert not of_kind(rendered(None), "PodMonitor")
    monitor = find(rendered(CHART / "ci" / "monitoring-values.yaml"), "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"

    example = yaml.safe_load((CHART.parents[1] / "examples" / "cpu-only.yaml").read_text())
    pool = parse_pool("default", example["metadata"]["name"], example["spec"])
    labels = example["spec"]["selector"].get("matchLabels", {})
    pod = {"metadata": {"name": "vllm-0", "namespace": "default", "labels": labels},
           "spec": {"containers": [{"name": "vllm", "image": "vllm"}]}}  # fmt: skip
    injected = inject(pod, pool, OperatorSettings(legacy_sidecar=legacy))
    pod_labels = injected["metadata"]["labels"]
    for expr in monitor["spec"]["selector"]["matchExpressions"]:
        assert expr["operator"] == "Exists" and expr["key"] in pod_labels
    assert not of_kind(rendered(None), "PodMonitor")
    spec = injected["spec"]
    ports = {p["name"]: p["containerPort"] for c in spec["containers"] + spec.get("initContainers", [])
             for p in c.get("ports", [])}  # fmt: skip
    assert endpoint["port"] in ports
    assert str(ports[endpoint["port"]]) == injected["metadata"]["annotations"]["kvpool.dev/status-port"]


@pytest.mark.parametrize("values_file", VALUES, ids=VALUE_IDS)
def test_the_webhook_is_opt_in_and_never_sees_system_namespaces(
    rendered: Callable, values_file: Path | None
) -> None:
    (hook,) = find(rendered(values_file), "MutatingWebhookConfiguration")["webhooks"]
    expressions = hook["namespaceSelector"]["matchExpressions"]
    assert {"key": "kvpool.dev/injection", "operator": "In", "values": ["enabled"]} in expressions
    (never,) = [e for e in expressions if e["operator"] == "NotIn"]
    assert {"kube-system", "kube-public", "kube-node-lease", "kvpool-system"} <= set(never["values"])
    (hook,) = find(rendered(None, "webhook.optIn=false"), "MutatingWebhookConfiguration")["webhooks"]
    assert [e["operator"] for e in hook["namespaceSelector"]["matchExpressions"]] == ["NotIn"]


def test_kubernetes_1_28_needs_the_legacy_sidecar_and_1_29_refuses_it() -> None:
    """1.28 has native sidecars off by default: an injected init container with restartPolicy Always
    would be refused there (or never start), so the chart refuses the install and says what to set.
    From 1.29 the plain-container sidecar only loses (no start order; a Job's pod never completes)."""
    refused = run_helm(*template_args(), "--kube-version", "1.28.9")
    assert refused.returncode != 0 and "legacySidecar=true" in refused.stderr
    assert run_helm(*template_args(None, "legacySidecar=true"), "--kube-version", "1.28.9").returncode == 0
    assert run_helm(*template_args(), "--kube-version", "1.29.0").returncode == 0
    refused = run_helm(*template_args(None, "legacySidecar=true"), "--kube-version", "1.29.0")
    assert refused.returncode != 0 and "leave legacySidecar off" in refused.stderr


def test_operator_replicas_prefer_different_nodes(rendered: Callable) -> None:
    """Soft: a node lost never takes every webhook replica where the scheduler could spread them, and
    a one-node cluster still runs them all. A user's affinity replaces it; one replica needs none."""
    deployment = _operator(rendered(None))
    (term,) = deployment["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    selector = term["podAffinityTerm"]["labelSelector"]["matchLabels"]
    assert selector == find(rendered(None), "Deployment")["spec"]["selector"]["matchLabels"]
    assert "affinity" not in _operator(rendered(None, "replicaCount=1"))["spec"]
    mine = _operator(rendered(None, "affinity.nodeAffinity.x=y"))["spec"]["affinity"]
    assert mine == {"nodeAffinity": {"x": "y"}}


def test_a_pod_monitor_only_where_the_cluster_has_the_kind_and_the_notes_say_so() -> None:
    values = CHART / "ci" / "monitoring-values.yaml"
    plain = ["template", "kvp", str(CHART), "--namespace", NAMESPACE, "--values", str(values)]
    without = run_helm(*plain)
    assert without.returncode == 0 and "kind: PodMonitor" not in without.stdout
    assert (
        "kind: PodMonitor" in run_helm(*plain, "--api-versions", "monitoring.coreos.com/v1/PodMonitor").stdout
    )
    notes = run_helm(
        "install", "kvp", str(CHART), "--dry-run=client", "--namespace", NAMESPACE, "--values", str(values)
    )
    assert notes.returncode == 0 and "none was made, so nothing scrapes the sidecars" in notes.stdout


def test_with_cert_manager_every_render_is_the_same_and_the_ca_is_injected() -> None:
    """GitOps renders with `helm template`, which cannot look the webhook's Secret up: by default each
    render makes a new CA. With cert-manager nothing random is rendered: its CA Issuer signs the serving
    certificate the operator mounts, and its cainjector writes that CA into the webhook."""
    values = CHART / "ci" / "cert-manager-values.yaml"
    assert render_text(values) == render_text(values)
    assert render_text(None) != render_text(None)  # why: helm's genCA, fresh in every render
    objects = render(values)
    assert not [o for o in of_kind(objects, "Secret") if o.get("type") == "kubernetes.io/tls"]
    hook = find(objects, "MutatingWebhookConfiguration")
    (webhook,) = hook["webhooks"]
    assert "caBundle" not in webhook["clientConfig"]
    namespace, name = hook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"].split("/")
    serving = find(objects, "Certificate", name)
    assert namespace == NAMESPACE == serving["metadata"]["namespace"]
    volume = next(v for v in _operator(objects)["spec"]["volumes"] if v["name"] == "webhook-tls")
    assert serving["spec"]["secretName"] == volume["secret"]["secretName"]
    service = find(objects, "Service", webhook["clientConfig"]["service"]["name"])
    assert f"{service['metadata']['name']}.{NAMESPACE}.svc" in serving["spec"]["dnsNames"]
    ca_issuer = find(objects, "Issuer", serving["spec"]["issuerRef"]["name"])
    ca = next(c for c in of_kind(objects, "Certificate") if c["spec"].get("isCA"))
    assert ca_issuer["spec"]["ca"]["secretName"] == ca["spec"]["secretName"]
