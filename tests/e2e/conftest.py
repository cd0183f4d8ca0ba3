"""The kind e2e suite's set-up: a kind cluster, kvpool's images built and loaded, the chart installed,
the shared-Redis pool and a two-replica vLLM CPU Deployment applied.

Every test here carries the `kind` marker (pyproject.toml); `make test` deselects it (no Docker in
that CI), and `make e2e-kind` (tests/e2e/run-kind.sh) runs only it. Outside CI a missing tool is a
skip that names it; in CI it is a failure.

Settings (environment):
  KVPOOL_E2E_CLUSTER      kind cluster name [kvpool-e2e]; an existing cluster of that name is reused
  KVPOOL_E2E_KEEP         1: keep the cluster afterwards (for looking around) [delete it]
  KVPOOL_E2E_VLLM_IMAGE   a CPU vLLM image to put the connector on, instead of building one
  TORCH_INDEX_URL         a package index serving torch==2.13.0+cpu, to build that image
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest
from kindkit import HERE, NAMESPACE, RELEASE_NAMESPACE, TAG, TOOLS, Cluster, condition, kubectl, run
from kvtest import need, wait_until


def _tools_present() -> None:
    if not (TOOLS / "helm").exists() or not (TOOLS / "kubectl").exists():
        run("bash", "scripts/get-helm.sh")
    missing = []
    if shutil.which("docker") is None:
        missing.append("docker (the Docker CLI)")
    elif subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        missing.append("a running Docker engine (docker info fails)")
    if shutil.which("kind") is None:
        missing.append("kind (sigs.k8s.io/kind)")
    need(not missing, ", ".join(missing))


def _build_images() -> None:
    build = ["docker", "build", "--quiet"]
    run(*build, "--target", "sidecar", "-t", f"kvpool/sidecar:{TAG}", ".")
    run(*build, "--target", "operator", "-t", f"kvpool/operator:{TAG}", ".")
    vllm_image = os.environ.get("KVPOOL_E2E_VLLM_IMAGE")
    if not vllm_image:
        index = os.environ.get("TORCH_INDEX_URL")
        need(bool(index), "TORCH_INDEX_URL (an index with torch==2.13.0+cpu) or KVPOOL_E2E_VLLM_IMAGE")
        vllm_image = f"kvpool/vllm-cpu:{TAG}"
        run(*build, "--target", "vllm-cpu", "--build-arg", f"TORCH_INDEX_URL={index}", "-t", vllm_image, ".",
            timeout=3600)  # fmt: skip
    run(
        *build,
        "--target",
        "connector",
        "--build-arg",
        f"VLLM_IMAGE={vllm_image}",
        "-t",
        f"kvpool/vllm:{TAG}",
        ".",
    )


@pytest.fixture(scope="session")
def cluster() -> Iterator[str]:
    """The cluster with kvpool installed and the e2e workload running; yields the kubectl context."""
    _tools_present()
    name = Cluster.name()
    created = name not in run("kind", "get", "clusters").split()
    if created:
        run("kind", "create", "cluster", "--name", name, "--wait", "180s")
    try:
        _build_images()
        for image in ("sidecar", "operator", "vllm"):
            run("kind", "load", "docker-image", "--name", name, f"kvpool/{image}:{TAG}", timeout=1800)
        run("helm", "--kube-context", f"kind-{name}", "upgrade", "--install", "kvpool", "charts/kvpool",
            "--namespace", RELEASE_NAMESPACE, "--create-namespace", "--wait", "--timeout", "5m",
            "--set", f"image.repository=kvpool/operator,image.tag={TAG},image.pullPolicy=Never",
            "--set", f"sidecarImage.repository=kvpool/sidecar,sidecarImage.tag={TAG}",
            "--set", "operator.statsIntervalSeconds=5")  # fmt: skip
        kubectl("create", "namespace", NAMESPACE, check=False)
        kubectl("label", "namespace", NAMESPACE, "kvpool.dev/injection=enabled", "--overwrite")
        kubectl("apply", "-f", str(HERE / "manifests" / "pool.yaml"))
        wait_until(lambda: condition("Ready") == "True", 300, "the pool to be Ready")
        kubectl("apply", "-f", str(HERE / "manifests" / "vllm.yaml"))
        kubectl("-n", NAMESPACE, "rollout", "status", "deployment/vllm", "--timeout", "900s", timeout=960)
        yield f"kind-{name}"
    finally:
        if os.environ.get("KVPOOL_E2E_KEEP") != "1" and created:
            run("kind", "delete", "cluster", "--name", name, check=False)
