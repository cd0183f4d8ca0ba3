"""The clusters the e2e scenarios run on, and the helpers they share: kubectl and helm pointed at the
active cluster, the workload's pods, port-forwards, and killing a container the way a node would.

Two clusters run the same scenarios:
  node  the real node of tests/node (kubelet, containerd, runc, CNI, CoreDNS, kube-proxy in a network
        namespace the suite creates); `make test` runs it
  kind  a kind cluster (Docker); `make e2e-kind` runs it
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtest import REPO, free_port, http_ok, wait_until

HERE = Path(__file__).parent
TOOLS = REPO / ".tools" / "bin"
NODE_SCRIPTS = REPO / "tests" / "node"
NAMESPACE = "kvpool-e2e"
RELEASE_NAMESPACE = "kvpool-system"


def tools_env(**extra: str) -> dict[str, str]:
    """The environment with the project's helm and kubectl first on PATH."""
    return {**os.environ, "PATH": f"{TOOLS}:{os.environ.get('PATH', '')}", **extra}


def run(*argv: str | Path, timeout: float = 900, check: bool = True, stdin: str | None = None,
        env: dict[str, str] | None = None) -> str:  # fmt: skip
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout,
                            env=tools_env(**(env or {})), input=stdin, cwd=REPO)  # fmt: skip
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv[:4]))} failed ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")  # fmt: skip
    return result.stdout


@dataclass
class Cluster:
    """What the scenarios need to know of the cluster they run on."""

    kind: str  # "node" or "kind"
    kube_args: list[str]  # how kubectl and helm reach it
    images: dict[str, str]  # operator, sidecar, redis: name:tag, present on the node
    run_dir: Path | None = None  # node: the state directory of tests/node/up.sh
    extra: dict[str, str] = field(default_factory=dict)
    importing: subprocess.Popen[bytes] | None = None  # node: the vLLM images' import, beside the scenarios

    def wait_for_images(self) -> None:
        """The vLLM images are on the node (on the node they are imported while the first scenarios run)."""
        if self.importing is not None:
            rc = self.importing.wait(timeout=900)
            assert rc == 0, f"importing the vLLM images failed ({rc}): see {self.run_dir}/import.log"

    def kill_container(self, container_id: str) -> None:
        """SIGKILL one container's process, as the OOM killer or a crash would."""
        cid = container_id.split("://", 1)[-1]
        if self.kind == "node":
            assert self.run_dir is not None
            keeper = node_pid(self.run_dir, "keeper")
            sock = self.run_dir / "containerd" / "containerd.sock"
            run("nsenter", "-t", keeper, "-n", "-m", "ctr", "-a", sock, "-n", "k8s.io", "tasks", "kill",
                "-s", "SIGKILL", cid)  # fmt: skip
        else:
            node = f"{self.extra['name']}-control-plane"
            run("docker", "exec", node, "ctr", "-n", "k8s.io", "tasks", "kill", "-s", "SIGKILL", cid)


ACTIVE: Cluster | None = None


def active() -> Cluster:
    assert ACTIVE is not None, "no e2e cluster: the `cluster` fixture sets one"
    return ACTIVE


def node_pid(run_dir: Path, name: str) -> str:
    for line in (run_dir / "pids").read_text().splitlines():
        key, _, pid = line.partition(" ")
        if key == name:
            return pid
    raise AssertionError(f"{name} is not in {run_dir / 'pids'}")


def kubectl(*args: str, **kw: Any) -> str:
    return run("kubectl", *active().kube_args, *args, **kw)


def helm(*args: str, **kw: Any) -> str:
    kube = active().kube_args
    helm_kube = ["--kubeconfig", kube[1]] if kube[0] == "--kubeconfig" else ["--kube-context", kube[1]]
    return run("helm", *helm_kube, *args, **kw)


def kubectl_json(*args: str) -> Any:
    return json.loads(kubectl(*args, "-o", "json"))


def condition(pool: str, kind: str, namespace: str = NAMESPACE) -> str | None:
    found = kubectl_json("-n", namespace, "get", "kvp", pool)
    for c in found.get("status", {}).get("conditions", []):
        if c["type"] == kind:
            return c["status"]
    return None


def pods(selector: str, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    """The live (not terminating) pods matching a label selector, by name."""
    found = kubectl_json("-n", namespace, "get", "pods", "-l", selector)["items"]
    return sorted(
        (p for p in found if not p["metadata"].get("deletionTimestamp")), key=lambda p: p["metadata"]["name"]
    )


def container_statuses(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """Every container's status, the native sidecar's (an init container) included."""
    return pod["status"].get("initContainerStatuses", []) + pod["status"].get("containerStatuses", [])


def container_status(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [s for s in container_statuses(pod) if s["name"] == name]
    return found


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def pod_json(pod: str, port: int, path: str, namespace: str = NAMESPACE) -> Any:
    """GET a pod's port through the API server's proxy: no port-forward to lose when the container
    behind the port restarts (kubectl port-forward exits on the first connection it cannot make)."""
    return json.loads(
        kubectl("get", "--raw", f"/api/v1/namespaces/{namespace}/pods/{pod}:{port}/proxy{path}")
    )


@contextlib.contextmanager
def port_forward(pod: str, port: int, namespace: str = NAMESPACE) -> Iterator[str]:
    """`kubectl port-forward` to a pod's port; yields the local base URL.

    kubectl exits when a forwarded connection fails (say, the pod's network is not up at the first
    one), so a forward that exited is started again until the deadline; its output names the cause."""
    local = free_port()
    argv = ["kubectl", *active().kube_args, "-n", namespace, "port-forward", f"pod/{pod}", f"{local}:{port}"]
    url = f"http://127.0.0.1:{local}"
    with tempfile.TemporaryFile("w+") as log:

        def start() -> subprocess.Popen[bytes]:
            return subprocess.Popen(argv, env=tools_env(), stdout=log, stderr=subprocess.STDOUT)

        proc = start()

        def forwarding() -> bool:
            nonlocal proc
            if proc.poll() is not None:
                proc = start()
                return False
            return http_ok(url + "/healthz") or http_ok(url + "/health")

        try:
            try:
                wait_until(forwarding, 30, f"port-forward to {pod}:{port}")
            except TimeoutError as e:
                log.seek(0)
                raise TimeoutError(f"{e}; kubectl said:\n{log.read()[-2000:]}") from None
            yield url
        finally:
            proc.terminate()
            proc.wait(10)
