"""The e2e suite's set-up: a cluster with kvpool's images on it and the chart installed.

KVPOOL_E2E_ON picks the cluster:
  node  (default; `make test`) the real node of tests/node: images built by tests/node/images.sh
        (cached), the node started by up.sh and always stopped by down.sh, also after a failure
  kind  (`make e2e-kind`) a kind cluster with Docker; builds the same images with docker
Both build the two vLLM images of the vLLM scenarios (test_vllm.py) from the Dockerfile: a stock CPU
vLLM server (--target vllm-cpu) and the same image with kvpool's connector built in (--target connector).

Settings (environment):
  KVPOOL_NODE_RUN         the node's state directory [/tmp/kvpool-node]
  KVPOOL_E2E_CLUSTER      kind cluster name [kvpool-e2e]; an existing cluster of that name is reused
  KVPOOL_E2E_KEEP         1: keep the cluster afterwards, to look around [delete it; the node's next
                          run stops a kept node first]
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import clusterkit
import pytest
import yaml
from clusterkit import HERE, NAMESPACE, NODE_SCRIPTS, RELEASE_NAMESPACE, TOOLS, Cluster, kubectl, run
from kvtest import REPO, need, wait_until

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The uninstall scenario goes last, whichever files run (it removes what every other one uses).
    An e2e scenario's timeout (pyproject's) covers the scenario alone, not the session's set-up:
    building the images from a cold cache takes 8-17 minutes on CI's machines and importing vLLM's
    5 GB more, and every step of the set-up has its own deadline (a subprocess timeout or wait_until)."""
    items.sort(key=lambda item: item.name == "test_uninstall_leaves_nothing")
    for item in items:
        if item.get_closest_marker("e2e") is not None:
            item.add_marker(pytest.mark.timeout(func_only=True))  # the timeout itself stays the ini's


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
        images = Path(run("bash", NODE_SCRIPTS / "images.sh", timeout=3600).split()[-1])
    tars = " ".join(str(images / f"{n}.tar") for n in ("pause", "sidecar", "operator", "redis"))
    importing = None
    try:
        with timed("node up, images imported (tests/node/up.sh)"):
            run("bash", NODE_SCRIPTS / "up.sh", env={**env, "IMAGES": tars}, timeout=600)
        # the vLLM images (5 GB) go in while the scenarios that do not need them run
        sock = run_dir / "containerd" / "containerd.sock"
        with open(run_dir / "import.log", "wb") as log:
            importing = subprocess.Popen(
                ["nsenter", "-t", clusterkit.node_pid(run_dir, "keeper"), "-n", "-m", "ctr", "-a", str(sock),
                 "-n", "k8s.io", "images", "import", str(images / "vllm.tar")],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        yield Cluster(
            kind="node",
            kube_args=["--kubeconfig", str(run_dir / "kubeconfig")],
            images={
                "operator": "localhost/kvpool/operator:node",
                "sidecar": "localhost/kvpool/sidecar:node",
                "redis": "localhost/kvpool/redis:7",
                "vllm": "localhost/kvpool/vllm-cpu:node",
                "vllm-connector": "localhost/kvpool/vllm:node",
            },
            run_dir=run_dir,
            importing=importing,
        )
    finally:
        if importing is not None and importing.poll() is None:
            importing.kill()
            importing.wait()
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
        images = {t: f"kvpool/{t}:{KIND_TAG}" for t in ("sidecar", "operator", "vllm-cpu", "vllm")}
        for target in ("sidecar", "operator", "vllm-cpu"):
            run(*build, "--target", target, "-t", images[target], ".", timeout=3600)
        run(*build, "--target", "connector", "--build-arg", f"VLLM_IMAGE={images['vllm-cpu']}",
            "-t", images["vllm"], ".")  # fmt: skip
        for image in images.values():
            run("kind", "load", "docker-image", "--name", name, image, timeout=1800)
        yield Cluster(
            kind="kind",
            kube_args=["--context", f"kind-{name}"],
            images={
                "operator": images["operator"],
                "sidecar": images["sidecar"],
                "redis": "redis:7.4",
                "vllm": images["vllm-cpu"],
                "vllm-connector": images["vllm"],
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
    """The shared-Redis pool under a two-replica vLLM CPU Deployment (test_vllm.py), from the stock
    vLLM image (nothing of kvpool in it): the webhook stages the connector into the pods."""
    deployment = yaml.safe_load((HERE / "manifests" / "vllm.yaml").read_text())
    (vllm,) = deployment["spec"]["template"]["spec"]["containers"]
    vllm["image"] = cluster.images["vllm"]
    with timed("vLLM images imported (waited for, after the scenarios)"):
        cluster.wait_for_images()
    pool = yaml.safe_load((HERE / "manifests" / "pool.yaml").read_text())
    pool["spec"]["redis"]["image"] = cluster.images["redis"]
    kubectl("apply", "-f", "-", stdin=json.dumps(pool))
    wait_until(lambda: clusterkit.condition("shared", "Ready") is not None, 60, "the pool's first status")
    tinymodel = REPO / "demo" / "src" / "kvpool_demo" / "tinymodel.py"  # not in any image: mounted
    kubectl("-n", NAMESPACE, "create", "configmap", "tinymodel", f"--from-file={tinymodel}")
    kubectl("apply", "-f", "-", stdin=json.dumps(deployment))
    with timed("vLLM Deployment rolled out (2 replicas)"):
        kubectl("-n", NAMESPACE, "rollout", "status", "deployment/vllm", "--timeout", "900s", timeout=960)
    return "app=vllm-e2e"
