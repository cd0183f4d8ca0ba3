"""What the chart tests share: paths, helm invocations, and looking objects up in a render."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvpool"
HELM = REPO / ".tools" / "bin" / "helm"
CRD_SOURCE = REPO / "crds" / "kvcachepool.yaml"
EXAMPLE_VALUES = sorted((CHART / "ci").glob("*.yaml"))
RELEASE, NAMESPACE = "kvp", "kvpool-system"


def run_helm(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, input=stdin, cwd=REPO)


# What `helm template` offers a chart that asks for optional APIs: a cluster with the Prometheus Operator
# and cert-manager.
API_VERSIONS = [
    "--api-versions", "monitoring.coreos.com/v1/PodMonitor",
    "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor",
    "--api-versions", "monitoring.coreos.com/v1/PrometheusRule",
    "--api-versions", "cert-manager.io/v1",  # the chart refuses cert-manager where the cluster has none
]  # fmt: skip


def kube_version(values_file: Path | None) -> list[str]:
    """A values file for clusters older than 1.29 (legacySidecar) renders and lints for one."""
    if values_file is not None and (yaml.safe_load(values_file.read_text()) or {}).get("legacySidecar"):
        return ["--kube-version", "1.28.15"]
    return []


def template_args(values_file: Path | None = None, *sets: str) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--include-crds", *API_VERSIONS]
    args += kube_version(values_file)
    if values_file is not None:
        args += ["--values", str(values_file)]
    for s in sets:
        args += ["--set", s]
    return args


def render_text(values_file: Path | None = None, *sets: str) -> str:
    result = run_helm(*template_args(values_file, *sets))
    if result.returncode != 0:
        raise AssertionError(f"helm template failed:\n{result.stderr}")
    return result.stdout


def render(values_file: Path | None = None, *sets: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(render_text(values_file, *sets)) if doc]


def find(objects: list[dict], kind: str, name: str | None = None) -> dict:
    matches = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]
