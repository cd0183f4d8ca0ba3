"""kvpool-operator's flags, their environment fallbacks, and what the operator image must not carry."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import yaml

from kvpool_operator import kube
from kvpool_operator.cli import build, main, seniority


def test_defaults_follow_the_contract() -> None:
    op = build(["--webhook-insecure"])
    assert (op.peering_name, op.standalone, op.clusterwide) == ("kvpool", False, True)
    assert op.settings.peering.mandatory and op.settings.peering.clusterwide
    server = op.settings.admission.server
    assert (server.addr, server.port) == ("", 9443)  # type: ignore[union-attr]  # every address
    assert op.settings.admission.managed is None  # the chart owns the webhook configuration
    assert op.memo.settings.liveness == "http://0.0.0.0:8080/healthz"
    ours = op.memo.settings
    assert (ours.stats_interval, ours.scale_cooldown, ours.legacy_sidecar) == (30.0, 300.0, False)


def test_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_STATS_INTERVAL", "5")
    monkeypatch.setenv("KVPOOL_LEGACY_SIDECAR", "true")
    monkeypatch.setenv("KVPOOL_SIDECAR_IMAGE", "registry.local/kvpool/sidecar:1")
    monkeypatch.setenv("KVPOOL_NAMESPACE", "team-a,team-b")
    op = build(["--webhook-cert", "/c.pem", "--webhook-key", "/k.pem", "--scale-cooldown", "60",
                "--stats-interval", "7"])  # fmt: skip
    ours = op.memo.settings
    assert (ours.stats_interval, ours.scale_cooldown, ours.legacy_sidecar) == (
        7.0,
        60.0,
        True,
    )  # the flag wins
    assert ours.sidecar_image == "registry.local/kvpool/sidecar:1"
    assert (op.clusterwide, op.namespaces) == (False, ["team-a", "team-b"])
    assert op.settings.admission.server.certfile == "/c.pem"  # type: ignore[union-attr]


def test_service_links_in_the_environment_lose_to_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a real kubelet gives the operator's pod when the release's webhook Service is named
    kvpool-webhook (found on the real node: the operator crash-looped before its first log line)."""
    monkeypatch.setenv("KVPOOL_WEBHOOK_PORT", "tcp://10.96.210.117:443")
    monkeypatch.setenv("KVPOOL_WEBHOOK_SERVICE_PORT", "443")
    op = build(["--webhook-insecure", "--webhook-port", "9443"])
    assert op.settings.admission.server.port == 9443  # type: ignore[union-attr]


def test_refuses_to_serve_the_webhook_without_tls_or_an_explicit_insecure() -> None:
    with pytest.raises(SystemExit, match="webhook-cert"):
        main(["--standalone"])


def test_print_rbac_is_what_kube_needs(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--print-rbac"])
    rules = yaml.safe_load(capsys.readouterr().out)["rules"]
    assert {(r["apiGroups"][0], r["resources"][0]): frozenset(r["verbs"]) for r in rules} == kube.RBAC


def test_the_operator_imports_no_torch_vllm_or_sidecar() -> None:
    code = (
        "import sys, kvpool_operator.cli, kvpool_operator.handlers; "
        "bad = [m for m in ('torch', 'vllm', 'kvpool_sidecar', 'kvpool_connector') if m in sys.modules]; "
        "print(*bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_older_replica_has_the_higher_peering_priority() -> None:
    """kopf pauses every replica sharing the top priority: each gets its own, the oldest leading."""
    older = seniority()
    time.sleep(0.001)  # not a wait: a process started a millisecond later
    newer = seniority()
    assert newer < older < 0 and older > -(2**63)
