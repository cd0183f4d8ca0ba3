"""The operator's own settings (flags with environment fallbacks, parsed in cli.py)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SIDECAR_IMAGE = "kvpool/sidecar:0.1.0"


@dataclass(frozen=True)
class OperatorSettings:
    stats_interval: float = 30.0  # seconds between status refreshes (pods, stats, shared-tier scaling)
    scale_cooldown: float = 300.0  # seconds after a shard-count change before the next shrink
    # how long a shrink waits for every sidecar to confirm it stopped using the shards that go
    # (the kubelet refreshes their ConfigMap file a minute or two after it changes)
    drain_timeout: float = 600.0
    sidecar_image: str = DEFAULT_SIDECAR_IMAGE  # a pool's spec.sidecar.image wins
    legacy_sidecar: bool = False  # clusters < 1.29: a plain container instead of a native sidecar
    scrape_timeout: float = 2.0  # per sidecar /stats and per Redis INFO
    namespaces: tuple[str, ...] = ()  # the watched namespaces; empty: all
    readiness: str = ""  # where /readyz is served (http://host:port/path); empty: nowhere
    liveness: str = ""  # where /healthz is served; empty: nowhere
    metrics: str = ""  # where Prometheus /metrics is served (metrics.py); empty: nowhere
