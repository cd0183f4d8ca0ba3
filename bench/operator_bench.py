"""Operator figures: what kvpool's webhook adds to a pod's creation, through a real API server.

The control plane of the k8s tests (etcd, kube-apiserver with its default admission plugins, the
controller manager; tests/kubeharness) with the Helm chart installed and its operator pod played by a
local `kvpool-operator` (the chart's args, its ServiceAccount, TLS from the chart's Secret), as the
apiserver tests run it. Each call is a server-side dry-run create of a pod (`?dryRun=All`: every
admission step runs, the webhook included, nothing is stored) over one kept-alive HTTPS connection,
so what differs between the arms is admission alone:
- a pod a pool claims, in a namespace the webhook serves: injected (the webhook lists the
  namespace's LimitRanges and ResourceQuotas to check the pod still fits, then returns a JSON patch);
- a pod no pool claims, in that namespace: the webhook is called and admits it untouched;
- the baseline: the same pod in a namespace the webhook does not serve (no webhook call).
The arms take turns call by call, the order rotating. The API server reaches the webhook through
the harness's service network (servicenet.py), whose hop is not kvpool's, so the webhook's own share
is measured too: AdmissionReviews sent straight to the operator. Plus `decide()` in-process.
Run: `.venv/bin/python -m bench operator` (about 80 s; needs scripts/get-k8s.sh and
scripts/get-helm.sh's binaries, as `make test` does).
"""

from __future__ import annotations

import http.client
import json
import ssl
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.stats import bootstrap, latencies_ms, load_note, pct

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kubeharness.controlplane import ControlPlane, crd_established
from kubeharness.objects import CRD_PATH, pool_manifest
from kubeharness.operatorkit import WEBHOOK_PORT, apply, namespace, one_replica_release, restricted_pod_spec
from kubeharness.webhooks import review
from kvtest import wait_until

from kvpool_operator import names
from kvpool_operator.injection import decide
from kvpool_operator.pool import parse_pool
from kvpool_operator.settings import OperatorSettings

CALLS = 400  # per arm, after 20 warm-up rounds
BASELINE = "baseline: a namespace the webhook does not serve"
SPEC = {"selector": {"matchLabels": {"app": "vllm"}}, "capacity": "8Gi", "vllmContainer": "vllm"}


def pod(app: str) -> dict[str, Any]:
    spec = restricted_pod_spec(args=["--model", "m"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "vllm-", "labels": {"app": app}},
            "spec": spec}  # fmt: skip


class DryRun:
    """Server-side dry-run pod creates as the cluster admin, over one kept-alive connection."""

    def __init__(self, cp: ControlPlane) -> None:
        self.conn = http.client.HTTPSConnection("127.0.0.1", cp.apiserver_port, context=cp.ssl_context)

    def create(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        self.conn.request(
            "POST",
            f"/api/v1/namespaces/{ns}/pods?dryRun=All",
            json.dumps(body),
            {"Content-Type": "application/json"},
        )
        response = self.conn.getresponse()
        answer = json.loads(response.read())
        if response.status != 201:
            raise RuntimeError(f"dry-run create in {ns}: {response.status} {answer.get('message')}")
        return answer

    def close(self) -> None:
        self.conn.close()


def injected(created: dict[str, Any]) -> bool:
    containers = created["spec"].get("containers", []) + created["spec"].get("initContainers", [])
    return any(c["name"] == names.SIDECAR_CONTAINER for c in containers)


def turns(
    arms: dict[str, Callable[[], object]], calls: int = CALLS, warmup: int = 20
) -> dict[str, list[float]]:
    """Milliseconds per call of each arm, the arms taking turns call by call, the order rotating."""
    ms: dict[str, list[float]] = {arm: [] for arm in arms}
    order = list(arms)
    for i in range(warmup + calls):
        k = i % len(order)
        for arm in order[k:] + order[:k]:
            t0 = time.perf_counter()
            arms[arm]()
            if i >= warmup:
                ms[arm].append((time.perf_counter() - t0) * 1e3)
    return ms


def report(ms: dict[str, list[float]], base: str) -> None:
    """p50 / p99 of each arm, and its p50 minus the baseline's (95% interval, rounds resampled)."""
    for arm, xs in ms.items():
        rounds = list(zip(xs, ms[base], strict=True))
        low, high = bootstrap(
            rounds, lambda r: statistics.median(x for x, _ in r) - statistics.median(b for _, b in r)
        )
        added = statistics.median(xs) - statistics.median(ms[base])
        p50, p99 = statistics.median(xs), pct(xs, 0.99)
        print(f"  {arm:<58} {p50:6.2f} / {p99:6.2f}   {added:+6.2f} ({low:+.2f} to {high:+.2f})")


def expect(injects: bool, created: dict[str, Any]) -> None:
    if injected(created) != injects:
        raise RuntimeError(f"expected {'an injected' if injects else 'an untouched'} pod, got {created}")


def admissions(cp: ControlPlane, webhook: str) -> None:
    served, outside = namespace(cp, "bench"), namespace(cp, "bench-outside", opt_in=False)
    apply(cp, pool_manifest(served, "p", SPEC))
    api = DryRun(cp)
    try:
        wait_until(
            lambda: injected(api.create(served, pod("vllm"))), 60, "the webhook to inject the pool's pods"
        )
        print(f"  pod creation through the API server: {CALLS} dry-run creates an arm; p50 / p99 ms, and")
        print("  the p50 over the baseline's (95% interval)")
        report(
            turns({
                "a pod a pool claims (injected: JSON patch returned)": lambda: expect(
                    True, api.create(served, pod("vllm"))),
                "a pod no pool claims (the webhook called, untouched)": lambda: expect(
                    False, api.create(served, pod("web"))),
                BASELINE: lambda: expect(False, api.create(outside, pod("vllm"))),
            }),
            BASELINE,
        )  # fmt: skip
        # the API server calls the webhook again after the in-tree plugins change the pod it
        # injected (reinvocationPolicy: IfNeeded; the ServiceAccount plugin mounts its token into
        # the sidecar); every call is one CONNECT through the service network
        for what, ns, app in (("claimed", served, "vllm"), ("unclaimed", served, "web")):
            before = len(cp.network.connects)
            for _ in range(20):
                api.create(ns, pod(app))
            print(
                f"  webhook calls per create of a {what} pod: {(len(cp.network.connects) - before) / 20:.2f}"
            )
    finally:
        api.close()
    # the webhook's own share: the AdmissionReview straight to the operator, a new TLS connection
    # each (the API server's calls arrive so: the webhook closes every connection after answering)
    tls = ssl.create_default_context()
    tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
    print(f"  the webhook alone, over HTTPS to the operator's pod ({CALLS} reviews an arm):")
    claimed, unclaimed = "a pod a pool claims", "a pod no pool claims (baseline)"
    report(
        turns({
            claimed: lambda: review(webhook, pod("vllm"), served, tls=tls)["patch"],
            unclaimed: lambda: review(webhook, pod("web"), served, tls=tls),
        }),
        unclaimed,
    )  # fmt: skip


def main() -> None:
    print(f" {load_note()}")
    with tempfile.TemporaryDirectory(prefix="kvpool-operator-bench-") as d:
        cp = ControlPlane(Path(d) / "controlplane").start()
        try:
            cp.kubectl("apply", "-f", str(CRD_PATH))
            wait_until(lambda: crd_established(cp), 60, "the KVCachePool CRD to be Established")
            with one_replica_release(cp, Path(d) / "operator") as op:
                admissions(cp, f"https://{op.ip}:{WEBHOOK_PORT}/kvpool-inject")
        finally:
            cp.stop()
    pool = parse_pool("bench", "p", SPEC)
    p50, p99 = latencies_ms(lambda: decide(pod("vllm"), "bench", [pool], OperatorSettings()), 1000)
    what = "in-process decide() + inject(), claimed pod (no HTTP, no kopf)"
    print(f"  {what:<55} {p50:6.3f} / {p99:6.3f}")
