"""The chart installed on the real control plane, and the operator run as the chart's own pod: the
Deployment's pod (scheduled onto kwok's node, with a loopback pod IP) is played by a local
`kvpool-operator` process that gets that pod's args, its ServiceAccount's token (TokenRequest) and the
webhook certificate from the chart's Secret, and serves on the pod's IP."""

from __future__ import annotations

import base64
import contextlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtest import REPO, Proc, spawn, wait_until

from kubeharness.controlplane import ControlPlane, get_json
from kubeharness.kubelet import readiness_probe_passes
from kubeharness.objects import condition, port_open

CHART = REPO / "charts" / "kvpool"
HELM = REPO / ".tools" / "bin" / "helm"
RELEASE, RELEASE_NAMESPACE = "kvpool", "kvpool-system"
WEBHOOK_PORT = 9443


def helm(cp: ControlPlane, *args: str, check: bool = True, stderr: bool = True) -> str:
    """Runs the pinned helm against the control plane; its output (with stderr unless told not)."""
    result = subprocess.run([str(HELM), "--kubeconfig", str(cp.kubeconfig), *args], capture_output=True,
                            text=True, timeout=300, cwd=REPO)  # fmt: skip
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args[:3])} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout + (result.stderr if stderr else "")


def operator_pods(cp: ControlPlane, release: str = RELEASE, namespace: str = RELEASE_NAMESPACE) -> list[dict]:
    selector = f"app.kubernetes.io/instance={release},app.kubernetes.io/name=kvpool"
    pods = get_json(cp, "-n", namespace, "pods", "-l", selector)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def running(pod: dict[str, Any]) -> bool:
    return pod.get("status", {}).get("phase") == "Running" and bool(pod["status"].get("podIP"))


@dataclass
class LocalOperator:
    """One operator replica: the chart's pod, played by a local process on the pod's IP."""

    pod: str
    ip: str
    proc: Proc
    kubeconfig: Path  # the ServiceAccount's token

    @property
    def webhook_up(self) -> bool:
        return self.proc.alive() and port_open(self.ip, WEBHOOK_PORT)


def webhook_routed(cp: ControlPlane, release: str = RELEASE, namespace: str = RELEASE_NAMESPACE) -> bool:
    """Whether the API server's calls to the release's webhook Service reach a pod now (through the
    service network, as its admission calls go): until then a pod is admitted uninjected (failing open)."""
    svc = cp.get(f"/api/v1/namespaces/{namespace}/services/{release}-webhook")
    return bool(svc) and cp.network.resolve(f"{svc['spec']['clusterIP']}:443") is not None


@contextlib.contextmanager
def one_replica_release(cp: ControlPlane, workdir: Path, *values: str) -> Iterator[LocalOperator]:
    """The chart installed (one replica, `values` as `--set`s) and its pod played by a local process;
    uninstalled at the end."""
    sets = [arg for value in ("replicaCount=1", *values) for arg in ("--set", value)]
    helm(cp, "install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--create-namespace",
         "--wait", "--timeout", "3m", *sets)  # fmt: skip
    (pod,) = wait_until(lambda: [p for p in operator_pods(cp) if running(p)], 60, "the operator's pod to run")
    op = start_operator_as(cp, pod, workdir)
    wait_until(lambda: webhook_routed(cp), 60, "the API server's route to the webhook")
    try:
        yield op
    finally:
        op.proc.stop()
        helm(
            cp,
            "uninstall",
            RELEASE,
            "--namespace",
            RELEASE_NAMESPACE,
            "--wait",
            "--timeout",
            "1m",
            check=False,
        )


def start_operator_as(cp: ControlPlane, pod: dict[str, Any], workdir: Path) -> LocalOperator:
    """Runs `kvpool-operator` as the pod and waits for its webhook and its readiness probe (the pools
    read), as a kubelet gates the webhook Service's endpoints: kwok marks the pod Ready at once."""
    proc = spawn_operator_as(cp, pod, workdir)
    operator = LocalOperator(pod["metadata"]["name"], pod["status"]["podIP"], proc, proc.info["kubeconfig"])
    try:
        wait_until(
            lambda: operator.webhook_up and readiness_probe_passes(pod, operator.ip),
            60,
            f"the operator playing {operator.pod} to serve its webhook, ready",
        )
    except TimeoutError:
        proc.kill()
        raise AssertionError(f"operator did not start:\n{proc.output()[-4000:]}") from None
    return operator


def spawn_operator_as(cp: ControlPlane, pod: dict[str, Any], workdir: Path) -> Proc:
    """Starts `kvpool-operator` with the pod's own args and identity, serving on the pod's IP."""
    name, namespace = pod["metadata"]["name"], pod["metadata"]["namespace"]
    ip = pod["status"]["podIP"]
    (container,) = pod["spec"]["containers"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "webhook-tls")["mountPath"]
    secret_name = next(v for v in pod["spec"]["volumes"] if v["name"] == "webhook-tls")["secret"][
        "secretName"
    ]
    tls = get_json(cp, "-n", namespace, "secret", secret_name)["data"]
    files = workdir / name
    files.mkdir(parents=True, exist_ok=True)
    for key in ("tls.crt", "tls.key"):
        (files / key).write_bytes(base64.b64decode(tls[key]))
    args = [a.replace(mount, str(files)).replace("0.0.0.0", ip) for a in container["args"]]
    kubeconfig = cp.token_kubeconfig(namespace, pod["spec"]["serviceAccountName"], files / "kubeconfig")
    env = {"KUBECONFIG": str(kubeconfig), "POD_ID": name, "POD_NAMESPACE": namespace}
    argv = [sys.executable, "-m", "kvpool_operator", *args, f"--webhook-addr={ip}"]
    proc = spawn(argv, workdir / f"{name}.log", env=env)
    proc.info["kubeconfig"] = kubeconfig
    return proc


REFUSED = re.compile(r"forbidden|(?<![\d,])403[:,]", re.IGNORECASE)  # not a timestamp's ",403]" milliseconds


def forbidden_calls(log: str) -> list[str]:
    """Lines of an operator log that show the API server refusing it (RBAC): its "forbidden" message, or
    the status as our client ("403: GET ...") and aiohttp ("403, message=...") print it."""
    return [line for line in log.splitlines() if REFUSED.search(line)]


OPT_IN = {"kvpool.dev/injection": "enabled"}  # the chart's webhook sees only namespaces labelled so


def namespace(cp: ControlPlane, name: str, labels: dict[str, str] | None = None, opt_in: bool = True) -> str:
    labels = {**(OPT_IN if opt_in else {}), **(labels or {})}
    apply(cp, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}})
    return name


def restricted_pod_spec(**vllm: Any) -> dict[str, Any]:
    """A pod spec with one container `vllm` that Pod Security `restricted` admits (as a careful platform
    team writes it); `vllm` adds to or overrides the container's fields."""
    return {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{
            "name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
            **vllm,
        }],
    }  # fmt: skip


def restricted_deployment(ns: str, replicas: int = 2, name: str = "vllm") -> dict[str, Any]:
    """A vLLM Deployment that Pod Security `restricted` admits."""
    resources = {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"memory": "8Gi"}}
    spec = restricted_pod_spec(
        command=["vllm", "serve"], args=["/models/llama", "--port", "8000"], resources=resources
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "vllm"}},
            "template": {"metadata": {"labels": {"app": "vllm"}}, "spec": spec},
        },
    }


def pods_of(cp: ControlPlane, ns: str, selector: str = "app=vllm") -> list[dict[str, Any]]:
    items = get_json(cp, "-n", ns, "pods", "-l", selector)["items"]
    return sorted(
        (p for p in items if not p["metadata"].get("deletionTimestamp")), key=lambda p: p["metadata"]["name"]
    )


def all_ready(pods: list[dict[str, Any]], n: int) -> list[dict[str, Any]] | None:
    ready = [p for p in pods if running(p) and condition(p, "Ready") == "True"]
    return ready if len(ready) == n else None


def pool_ready(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any] | None:
    """The pool, once the operator has reconciled it (Ready, its connector config published)."""
    pool = get_json(cp, "-n", namespace, "kvp", name)
    return pool if condition(pool, "Ready") == "True" and pool["status"].get("connectorConfig") else None


def pool_status(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    return get_json(cp, "-n", namespace, "kvp", name).get("status", {})


def apply(cp: ControlPlane, *docs: dict[str, Any]) -> None:
    for doc in docs:
        cp.kubectl("apply", "-f", "-", stdin=json.dumps(doc))
