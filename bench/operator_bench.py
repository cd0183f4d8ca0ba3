"""Operator figures: the webhook's admission latency through kopf's real server, beside kmock.

The API server waits on the webhook for every pod it creates (timeoutSeconds: 5, then it admits
the pod untouched), so this latency is what kvpool adds to a pod's creation. Baseline of the same
run: an admission of a pod no pool selects (same server, same request size, no patch).
Run: `.venv/bin/python -m bench operator`.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
from pathlib import Path

import yaml

from bench.stats import latencies_ms, load_note

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kubeharness.emulator import KubeAPI, MemoryGauge, OperatorThread
from kubeharness.objects import CRD_PATH, pool_manifest, pool_path, port_open
from kubeharness.webhooks import review
from kvtest import free_port, wait_until

from kvpool_operator.injection import decide
from kvpool_operator.pool import parse_pool
from kvpool_operator.settings import OperatorSettings

CALLS = 1000
SPEC = {
    "selector": {"matchLabels": {"app": "vllm"}},
    "capacity": "8Gi",
    "backend": "redis",
    "redis": {"mode": "shared"},
}


def pod(app: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "vllm-", "labels": {"app": app}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai", "args": ["--model", "m"]}]},
    }


def _review(url: str, app: str) -> object:
    """One admission review over HTTP of a fresh pod labelled `app`."""
    return review(url, pod(app), "bench")


def main() -> None:
    print(f" {load_note()}")
    crd = yaml.safe_load(CRD_PATH.read_text())
    api = KubeAPI(crd)
    api.create(
        "/apis/kopf.dev/v1/clusterkopfpeerings",
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "kvpool"}},
    )
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        os.environ["KUBECONFIG"] = str(api.kubeconfig(Path(d) / "kubeconfig"))
        operator = OperatorThread(
            [
                "--webhook-insecure",
                "--webhook-addr",
                "127.0.0.1",
                "--webhook-port",
                str(port),
                "--liveness",
                "",
            ],
            MemoryGauge(),
        )
        try:
            wait_until(
                lambda: operator.ready_flag.is_set() and port_open("127.0.0.1", port), 60, "the operator"
            )
            api.create(pool_path("bench"), pool_manifest("bench", "p", SPEC))
            url = f"http://127.0.0.1:{port}/kvpool-inject"
            wait_until(lambda: "patch" in review(url, pod("vllm"), "bench"), 60, "the pool indexed")
            for what, app in (
                ("matched pod (injected, JSON patch returned)", "vllm"),
                ("unmatched pod (baseline: admitted untouched)", "web"),
            ):
                p50, p99 = latencies_ms(functools.partial(_review, url, app), CALLS)
                print(f"  admission over HTTP, {what:<46} p50 {p50:6.3f} ms  p99 {p99:6.3f} ms")
        finally:
            operator.stop()
            api.stop()
    pool = parse_pool("bench", "p", SPEC)
    p50, p99 = latencies_ms(lambda: decide(pod("vllm"), "bench", [pool], OperatorSettings()), CALLS)
    what = "in-process decide() + inject(), matched pod (no HTTP, no kopf)"
    print(f"  {what:<67} p50 {p50:6.3f} ms  p99 {p99:6.3f} ms")
