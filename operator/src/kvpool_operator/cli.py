"""`kvpool-operator`: flags (each with a KVPOOL_<FLAG> environment fallback) -> a running kopf operator."""

from __future__ import annotations

import argparse
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import kopf
import yaml

from kvpool_operator.handlers import register
from kvpool_operator.kube import rbac_rules
from kvpool_operator.leading import Peering
from kvpool_operator.scaling import MemorySource, redis_info_source
from kvpool_operator.settings import DEFAULT_SIDECAR_IMAGE, OperatorSettings
from kvpool_operator.state import OperatorState
from kvpool_operator.webhook import WebhookServer


def _env(flag: str, default: Any) -> Any:
    """The flag's KVPOOL_<FLAG> fallback. Typed flags get it as a string default, which argparse
    converts only when the flag is not given: Kubernetes puts service links such as
    KVPOOL_WEBHOOK_PORT=tcp://10.96.0.7:443 into every pod of a namespace holding a Service named
    kvpool-webhook, and an explicit flag must win over them, not crash on them."""
    return os.environ.get("KVPOOL_" + flag.upper().replace("-", "_"), default)


def _truthy(value: Any) -> bool:
    return str(value).lower() in ("1", "true", "yes", "on")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpool-operator", description=__doc__)
    p.add_argument(
        "--namespace",
        action="append",
        default=None,
        help="watch only this namespace (repeatable; env: comma-separated) [all namespaces]",
    )
    p.add_argument("--all-namespaces", action="store_true", help="watch every namespace (the default)")
    p.add_argument("--peering", default=_env("peering", "kvpool"), help="kopf peering name [kvpool]")
    p.add_argument(
        "--standalone",
        action="store_true",
        default=_truthy(_env("standalone", "")),
        help="no peering (development only: two replicas would both act)",
    )
    p.add_argument(
        "--liveness",
        default=_env("liveness", "http://0.0.0.0:8080/healthz"),
        help="where to answer 200 while the operator runs (0.0.0.0 or ::: every address, IPv4 and IPv6)",
    )
    p.add_argument(
        "--readiness",
        default=_env("readiness", "http://0.0.0.0:8081/readyz"),
        help="where to answer 200 once the webhook knows the pools (empty: nowhere)",
    )
    p.add_argument(
        "--metrics",
        default=_env("metrics", "http://0.0.0.0:8082/metrics"),
        help="where to serve Prometheus metrics, kvpool_operator_* (empty: nowhere)",
    )
    p.add_argument(
        "--peering-lifetime",
        type=int,
        default=str(_env("peering-lifetime", 30)),
        help="seconds a replica's peering entry lives without a refresh: how soon a standby takes over "
        "from a leader that died without saying so [30]",
    )
    p.add_argument(
        "--webhook-addr",
        default=_env("webhook-addr", ""),
        help="the webhook's address (empty: every address, IPv4 and IPv6)",
    )
    p.add_argument("--webhook-port", type=int, default=str(_env("webhook-port", 9443)))
    p.add_argument("--webhook-cert", default=_env("webhook-cert", None), help="TLS certificate (PEM)")
    p.add_argument("--webhook-key", default=_env("webhook-key", None), help="TLS private key (PEM)")
    p.add_argument(
        "--webhook-insecure",
        action="store_true",
        default=_truthy(_env("webhook-insecure", "")),
        help="plain HTTP (tests, or TLS terminated in front)",
    )
    p.add_argument("--stats-interval", type=float, default=str(_env("stats-interval", 30)))
    p.add_argument("--scale-cooldown", type=float, default=str(_env("scale-cooldown", 300)))
    p.add_argument("--drain-timeout", type=float, default=str(_env("drain-timeout", 600)))
    p.add_argument("--sidecar-image", default=_env("sidecar-image", DEFAULT_SIDECAR_IMAGE))
    p.add_argument(
        "--legacy-sidecar",
        action="store_true",
        default=_truthy(_env("legacy-sidecar", "")),
        help="clusters older than 1.29: the sidecar as a plain container, not a native sidecar",
    )
    p.add_argument("--verbose", action="store_true")
    p.add_argument(
        "--print-rbac", action="store_true", help="print the ClusterRole rules it needs (YAML) and exit"
    )
    return p


@dataclass
class Operator:
    """Everything kopf.operator() needs, built the same way for the CLI and for tests."""

    registry: kopf.OperatorRegistry
    settings: kopf.OperatorSettings
    memo: OperatorState
    clusterwide: bool
    namespaces: list[str]
    peering_name: str
    standalone: bool

    def kwargs(self) -> dict[str, Any]:
        return {
            "registry": self.registry,
            "settings": self.settings,
            "memo": self.memo,
            "clusterwide": self.clusterwide,
            "namespaces": self.namespaces,
            "peering_name": self.peering_name,
            "standalone": self.standalone,
            "identity": self.memo.peering.identity,  # the refresh loop finds itself in the peering by it
        }


def seniority() -> int:
    """This replica's kopf peering priority: unique, and higher for an older process.

    kopf pauses every replica that shares the highest priority, so equal priorities (a Deployment
    gives all its replicas the same flags) would leave no replica acting. The oldest process leads: a
    restarted replica comes back as a standby instead of taking the lead back, and in a rolling
    update the old leader acts until it exits (its peering entry goes with it, so the next takes over
    at once). Microseconds, and a random part for replicas started in the same one (an int64 still).
    """
    return -(time.time_ns() // 1000) * 1000 - random.randrange(1000)


def build(argv: Sequence[str] | None = None, memory_source: MemorySource | None = None) -> Operator:
    args = parser().parse_args(argv)
    namespaces = args.namespace or [n for n in str(_env("namespace", "")).split(",") if n]
    ours = OperatorSettings(
        stats_interval=args.stats_interval,
        scale_cooldown=args.scale_cooldown,
        drain_timeout=args.drain_timeout,
        sidecar_image=args.sidecar_image,
        legacy_sidecar=args.legacy_sidecar,
        namespaces=tuple(namespaces),
        readiness=args.readiness or "",
        liveness=args.liveness or "",
        metrics=args.metrics or "",
    )
    registry = kopf.OperatorRegistry()
    register(registry, ours)

    settings = kopf.OperatorSettings()
    settings.peering.name = args.peering
    settings.peering.standalone = args.standalone
    settings.peering.clusterwide = not namespaces
    settings.peering.mandatory = not args.standalone
    settings.peering.priority = priority = seniority()
    settings.peering.lifetime = args.peering_lifetime
    settings.posting.level = logging.WARNING  # kopf's per-handler "succeeded" events are noise
    settings.persistence.finalizer = "kvpool.dev/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvpool.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kvpool.dev", key="last-handled-configuration"
    )
    settings.background.cancellation_polling = (
        2.0  # a deleted pool waits on its timer's last run, not a minute
    )
    settings.admission.server = WebhookServer(
        addr=args.webhook_addr,
        port=args.webhook_port,
        certfile=args.webhook_cert,
        pkeyfile=args.webhook_key,
        insecure=args.webhook_insecure,
    )
    settings.admission.managed = None  # the chart owns the MutatingWebhookConfiguration
    peering = Peering(
        name=args.peering,
        clusterwide=not namespaces,
        # as kopf's own default (private to kopf): the pod's name where the chart sets POD_ID, else
        # unique per process; the refresh loop finds itself in the peering by it
        identity=os.environ.get("POD_ID") or f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(3)}",
        priority=priority,
        standalone=args.standalone,
    )
    memo = OperatorState(ours, memory_source or redis_info_source(ours.scrape_timeout), peering)
    return Operator(
        registry=registry,
        settings=settings,
        memo=memo,
        clusterwide=not namespaces,
        namespaces=namespaces,
        peering_name=args.peering,
        standalone=args.standalone,
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.print_rbac:
        print(yaml.safe_dump({"rules": rbac_rules()}, sort_keys=False), end="")
        return
    op = build(argv)
    # kopf's own format: every line about a pool says which ([namespace/name])
    kopf.configure(verbose=args.verbose, log_prefix=True)
    if not op.settings.admission.server.insecure and not op.settings.admission.server.certfile:  # type: ignore[union-attr]
        raise SystemExit("kvpool-operator: give --webhook-cert and --webhook-key, or --webhook-insecure")
    kopf.run(**op.kwargs())
