"""Helpers of the kind e2e suite: kubectl/helm/kind invocations, the workload's pods, port-forwards."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtest import REPO, free_port, http_ok, wait_until

HERE = Path(__file__).parent
TOOLS = REPO / ".tools" / "bin"
NAMESPACE = "kvpool-e2e"
RELEASE_NAMESPACE = "kvpool-system"
TAG = "e2e"


def run(*argv: str | Path, timeout: float = 900, check: bool = True, stdin: str | None = None) -> str:
    env = {**os.environ, "PATH": f"{TOOLS}:{os.environ.get('PATH', '')}"}
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, env=env,
                            input=stdin, cwd=REPO)  # fmt: skip
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv[:4]))} failed ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")  # fmt: skip
    return result.stdout


def kubectl(*args: str, **kw: Any) -> str:
    return run("kubectl", "--context", f"kind-{Cluster.name()}", *args, **kw)


def kubectl_json(*args: str) -> Any:
    return json.loads(kubectl(*args, "-o", "json"))


@dataclass
class Cluster:
    @staticmethod
    def name() -> str:
        return os.environ.get("KVPOOL_E2E_CLUSTER", "kvpool-e2e")


def condition(kind: str) -> str | None:
    pool = kubectl_json("-n", NAMESPACE, "get", "kvp", "shared")
    for c in pool.get("status", {}).get("conditions", []):
        if c["type"] == kind:
            return c["status"]
    return None


def vllm_pods() -> list[dict[str, Any]]:
    pods = kubectl_json("-n", NAMESPACE, "get", "pods", "-l", "app=vllm-e2e")["items"]
    return sorted(
        (p for p in pods if not p["metadata"].get("deletionTimestamp")), key=lambda p: p["metadata"]["name"]
    )


@contextlib.contextmanager
def port_forward(pod: str, port: int) -> Iterator[str]:
    """`kubectl port-forward` to a pod's port; yields the local base URL."""
    local = free_port()
    env = {**os.environ, "PATH": f"{TOOLS}:{os.environ.get('PATH', '')}"}
    argv = ["kubectl", "--context", f"kind-{Cluster.name()}", "-n", NAMESPACE, "port-forward", f"pod/{pod}",
            f"{local}:{port}"]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{local}"
    try:
        wait_until(lambda: proc.poll() is None and (http_ok(url + "/healthz") or http_ok(url + "/health")),
                   30, f"port-forward to {pod}:{port}")  # fmt: skip
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
