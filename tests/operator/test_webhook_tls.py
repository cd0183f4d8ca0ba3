"""The operator as the chart runs it: the webhook over TLS from certificate files (as helm's
genSignedCert makes them), and peering on. (kmock cannot serve GET /api/v1/namespaces, which kopf
needs for --namespace, so this runs cluster-wide too.)"""

from __future__ import annotations

import base64
import json
import ssl
import subprocess
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubeharness.emulator import KubeAPI, MemoryGauge, OperatorThread
from kubeharness.objects import pool_path, port_open
from kubeharness.webhooks import review
from kvtest import free_port, need_tool, wait_until

NS = "tls"


@pytest.fixture(scope="module")
def tls_operator(
    crd: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[KubeAPI, str, Path]]:
    openssl = need_tool("openssl", "openssl")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=kvpool-webhook", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(d / "tls.key"), "-out", str(d / "tls.crt")],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    api = KubeAPI(crd)
    api.create(
        "/apis/kopf.dev/v1/clusterkopfpeerings",
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "kvpool"}},
    )
    port = free_port()
    argv = [
        "--webhook-addr", "127.0.0.1", "--webhook-port", str(port),
        "--webhook-cert", str(d / "tls.crt"), "--webhook-key", str(d / "tls.key"),
        "--stats-interval", "1", "--sidecar-image", "kvpool/sidecar:test",
        "--liveness", "", "--readiness", "",
    ]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KUBECONFIG", str(api.kubeconfig(d / "kubeconfig")))
        operator = OperatorThread(argv, MemoryGauge())
        try:
            wait_until(lambda: operator.ready_flag.is_set() or operator.error, 60, "the operator to start")
            assert operator.error is None, operator.error
            wait_until(lambda: port_open("127.0.0.1", port), 30, "the webhook server")
            yield api, f"https://127.0.0.1:{port}/kvpool-inject", d / "tls.crt"
        finally:
            operator.stop()
            api.stop()
    assert operator.error is None, operator.error


def test_webhook_over_tls_injects_in_its_namespace(tls_operator: tuple[KubeAPI, str, Path]) -> None:
    api, url, ca = tls_operator
    tls = ssl.create_default_context(cafile=str(ca))
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"labels": {"app": "vllm"}},
           "spec": {"containers": [{"name": "vllm", "image": "vllm"}]}}  # fmt: skip
    assert "patch" not in review(url, pod, NS, tls=tls)  # no pool yet: untouched

    api.create(pool_path(NS), {"apiVersion": "kvpool.dev/v1alpha1", "kind": "KVCachePool",
                               "metadata": {"name": "p", "namespace": NS},
                               "spec": {"selector": {"matchLabels": {"app": "vllm"}}}})  # fmt: skip
    # the webhook's own index of the pools sees the new pool within moments: ask until it patches
    response = wait_until(lambda: (r := review(url, pod, NS, tls=tls)).get("patch") and r, 30, "an injection")
    assert response["allowed"] is True and response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    assert any(op["path"] == "/spec/initContainers" for op in ops)

    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        review(url, pod, NS, tls=ssl.create_default_context())  # a client that does not trust its CA


def test_peering_keeps_itself_alive(tls_operator: tuple[KubeAPI, str, Path]) -> None:
    """Two replicas never act at once: each announces itself in the KopfPeering and the lower pauses."""
    api, _, _ = tls_operator
    keepalive = "/apis/kopf.dev/v1/clusterkopfpeerings/kvpool"
    wait_until(
        lambda: any(m == "PATCH" and p == keepalive for m, p, *_ in api.requests()), 30, "a keep-alive"
    )
    peers = (api.get(keepalive) or {}).get("status", {})
    (peer,) = peers.values()
    assert peer["priority"] < 0 and peer["lifetime"] == 30  # seniority: -(start time in µs) * 1000 - noise
