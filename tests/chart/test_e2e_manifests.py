"""The kind suite's manifests, checked without a cluster (the API-server tier applies its pool, in
tests/k8s): the Deployment is valid Kubernetes, and the operator's own injection turns its pod into what
the suite expects (the sidecar, and --kv-transfer-config reaching the server through the command's "$@")."""

from __future__ import annotations

import subprocess
import sys

import yaml
from chartkit import REPO
from podchecks import sidecar_of

MANIFESTS = REPO / "tests" / "e2e" / "manifests"


def test_deployment_is_valid_kubernetes() -> None:
    argv = [sys.executable, "-m", "kubernetes_validate", "--strict", str(MANIFESTS / "vllm.yaml")]
    result = subprocess.run(argv, capture_output=True, text=True)
    assert result.returncode == 0 and "passed" in result.stdout, result.stdout + result.stderr


def test_injection_reaches_the_vllm_server() -> None:
    from kvpool_operator.injection import inject
    from kvpool_operator.pool import parse_pool
    from kvpool_operator.settings import OperatorSettings

    pool_doc = yaml.safe_load((MANIFESTS / "pool.yaml").read_text())
    deployment = yaml.safe_load((MANIFESTS / "vllm.yaml").read_text())
    meta = pool_doc["metadata"]
    pool = parse_pool(meta["namespace"], meta["name"], pool_doc["spec"])
    template = deployment["spec"]["template"]
    pod = {"metadata": {"name": "vllm-0", "namespace": meta["namespace"], **template["metadata"]},
           "spec": template["spec"]}  # fmt: skip
    injected = inject(pod, pool, OperatorSettings(sidecar_image="kvpool/sidecar:e2e"))
    sidecar = sidecar_of(injected)
    assert sidecar["name"] == "kvpool-sidecar" and sidecar["restartPolicy"] == "Always"
    (vllm,) = injected["spec"]["containers"]
    assert vllm["args"][-2] == "--kv-transfer-config"
    script = vllm["command"][2]
    assert vllm["command"][:2] == ["sh", "-c"] and script.rstrip().endswith('"$@"')
    # sh hands the args, the injected flag included, to the server as separate words
    echo = subprocess.run(["sh", "-c", 'printf "%s\\n" "$@"', *vllm["command"][3:], *vllm["args"]],
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert echo.stdout.splitlines() == vllm["args"]
    assert injected["metadata"]["labels"]["app"] == deployment["spec"]["selector"]["matchLabels"]["app"]
