"""The e2e suite's set-up: a cluster with kvpool's images on it and the chart installed.

KVPOOL_E2E_ON picks the cluster:
  node  (default; `make test`) the real node of tests/node: images built by tests/node/images.sh
        (cached), the node started by up.sh and always stopped by down.sh, also after a failure
  kind  (`make e2e-kind`) a kind cluster with Docker; builds the images with docker, including the
        CPU vLLM image the vLLM scenarios (test_vllm_kind.py, marker kind) need

Settings (environment):
  KVPOOL_NODE_RUN         the node's state directory [/tmp/kvpool-node]
  KVPOOL_E2E_CLUSTER      kind cluster name [kvpool-e2e]; an existing cluster of that name is reused
  KVPOOL_E2E_KEEP         1: keep the cluster afterwards, to look around [delete it; the node's next
                          run stops a kept node first]
  KVPOOL_E2E_VLLM_IMAGE   a CPU vLLM image to put the connector on, instead of building one (kind)
  TORCH_INDEX_URL         a package index serving torch==2.13.0+cpu, to build that image (kind)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import clusterkit
import pytest
from clusterkit import HERE, NAMESPACE, NODE_SCRIPTS, RELEASE_NAMESPACE, TOOLS, Cluster, kubectl, run
from kvtest import need, wait_until

TIMINGS: dict[str, float] = {}  # what each part of the set-up took, printed at the end of the run
KIND_TAG = "e2e"


@contextlib.contextmanager
def timed(what: str) -> Iterator[None]:
    t0 = time.monotonic()
    try:
        yield
    finally:
        TIMINGS[what] = time.monotonic() - t0


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TIMINGS:
        terminalreporter.section("e2e set-up times")
        for what, seconds in TIMINGS.items():
            terminalreporter.write_line(f"{what:<44} {seconds:7.1f} s")


HOST_KNOBS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops", "net/ipv4/ip_forward")


def host_state() -> dict[str, object]:
    """What the node must leave as it found it: the sysctls a kubelet or kube-proxy would set, the
    host's links, routes and mounts, and the kubelet's cgroup root."""
    return {
        **{knob: Path("/proc/sys", knob).read_text() for knob in HOST_KNOBS},
        "links": run("ip", "-o", "link", "show").count("kvnode0"),
        "routes": run("ip", "route", "show").count("10.250.0.2"),
        "mounts": Path("/proc/self/mounts").read_text().count("kvpool-node"),
        "cgroups": sorted(str(p) for p in Path("/sys/fs/cgroup").glob("*/kvpool-node")),
    }


@contextlib.contextmanager
def _node() -> Iterator[Cluster]:
    run_dir = Path(os.environ.get("KVPOOL_NODE_RUN", "/tmp/kvpool-node"))
    env = {"NODE_RUN": str(run_dir)}
    if (run_dir / "pids").exists():  # an earlier run that died before its teardown
        run("bash", NODE_SCRIPTS / "down.sh", env=env, check=False)
    before = host_state()
    with timed("images (tests/node/images.sh; cached)"):
        images = Path(run("bash", NODE_SCRIPTS / "images.sh", timeout=1800).split()[-1])
    tars = " ".join(str(images / f"{n}.tar") for n in ("pause", "sidecar", "operator", "redis"))
    try:
        with timed("node up, images imported (tests/node/up.sh)"):
            run("bash", NODE_SCRIPTS / "up.sh", env={**env, "IMAGES": tars}, timeout=600)
        yield Cluster(
            kind="node",
            kube_args=["--kubeconfig", str(run_dir / "kubeconfig")],
            images={
                "operator": "localhost/kvpool/operator:node",
                "sidecar": "localhost/kvpool/sidecar:node",
                "redis": "localhost/kvpool/redis:7",
            },
            run_dir=run_dir,
        )
    finally:
        if os.environ.get("KVPOOL_E2E_KEEP") != "1":
            with timed("node down (tests/node/down.sh)"):
                run("bash", NODE_SCRIPTS / "down.sh", env=env, check=False, timeout=300)
            assert host_state() == before, "the node left something on the host"


@contextlib.contextmanager
def _kind() -> Iterator[Cluster]:
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
    name = os.environ.get("KVPOOL_E2E_CLUSTER", "kvpool-e2e")
    created = name not in run("kind", "get", "clusters").split()
    if created:
        run("kind", "create", "cluster", "--name", name, "--wait", "180s")
    try:
        build = ["docker", "build", "--quiet"]
        run(*build, "--target", "sidecar", "-t", f"kvpool/sidecar:{KIND_TAG}", ".")
        run(*build, "--target", "operator", "-t", f"kvpool/operator:{KIND_TAG}", ".")
        for image in ("sidecar", "operator"):
            run("kind", "load", "docker-image", "--name", name, f"kvpool/{image}:{KIND_TAG}", timeout=1800)
        yield Cluster(
            kind="kind",
            kube_args=["--context", f"kind-{name}"],
            images={
                "operator": f"kvpool/operator:{KIND_TAG}",
                "sidecar": f"kvpool/sidecar:{KIND_TAG}",
                "redis": "redis:7.4",
            },
            extra={"name": name},
        )
    finally:
        if os.environ.get("KVPOOL_E2E_KEEP") != "1" and created:
            run("kind", "delete", "cluster", "--name", name, check=False)


def install_chart(cluster: Cluster) -> None:
    """The chart with the cluster's operator image: two replicas, the webhook behind its Service."""
    operator, _, tag = cluster.images["operator"].rpartition(":")
    sidecar, _, sidecar_tag = cluster.images["sidecar"].rpartition(":")
    clusterkit.helm("upgrade", "--install", "kvpool", "charts/kvpool", "--namespace", RELEASE_NAMESPACE,
                    "--create-namespace", "--wait", "--timeout", "5m",
                    "--set", f"image.repository={operator},image.tag={tag},image.pullPolicy=Never",
                    "--set", f"sidecarImage.repository={sidecar},sidecarImage.tag={sidecar_tag}",
                    "--set", "operator.statsIntervalSeconds=5", timeout=400)  # fmt: skip


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """The cluster with kvpool installed; yields it (clusterkit's helpers point at it meanwhile)."""
    on = os.environ.get("KVPOOL_E2E_ON", "node")
    assert on in ("node", "kind"), f"KVPOOL_E2E_ON={on!r}: node or kind"
    with _node() if on == "node" else _kind() as found:
        clusterkit.ACTIVE = found
        try:
            with timed("helm install (2 operator replicas Ready)"):
                install_chart(found)
            kubectl("create", "namespace", NAMESPACE, check=False)
            kubectl("label", "namespace", NAMESPACE, "kvpool.dev/injection=enabled", "--overwrite")
            yield found
        finally:
            clusterkit.ACTIVE = None


@pytest.fixture(scope="session")
def vllm_workload(cluster: Cluster) -> str:
    """kind only: the shared-Redis pool under a two-replica vLLM CPU Deployment (test_vllm_kind.py)."""
    assert cluster.kind == "kind", "the vLLM scenarios need a CPU vLLM image, built on kind only"
    vllm_image = os.environ.get("KVPOOL_E2E_VLLM_IMAGE")
    build = ["docker", "build", "--quiet"]
    if not vllm_image:
        index = os.environ.get("TORCH_INDEX_URL")
        need(bool(index), "TORCH_INDEX_URL (an index with torch==2.13.0+cpu) or KVPOOL_E2E_VLLM_IMAGE")
        vllm_image = f"kvpool/vllm-cpu:{KIND_TAG}"
        run(*build, "--target", "vllm-cpu", "--build-arg", f"TORCH_INDEX_URL={index}", "-t", vllm_image, ".",
            timeout=3600)  # fmt: skip
    connector = f"kvpool/vllm:{KIND_TAG}"
    run(*build, "--target", "connector", "--build-arg", f"VLLM_IMAGE={vllm_image}", "-t", connector, ".")
    run("kind", "load", "docker-image", "--name", cluster.extra["name"], connector, timeout=1800)
    kubectl("apply", "-f", str(HERE / "manifests" / "pool.yaml"))
    wait_until(lambda: clusterkit.condition("shared", "Ready") == "True", 300, "the pool to be Ready")
    kubectl("apply", "-f", str(HERE / "manifests" / "vllm.yaml"))
    kubectl("-n", NAMESPACE, "rollout", "status", "deployment/vllm", "--timeout", "900s", timeout=960)
    return "app=vllm-e2e"
