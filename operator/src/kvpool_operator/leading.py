"""Whether this replica leads: kopf's own rule, read from kopf's peering object.

kopf pauses its handlers on every replica but the one with the highest priority among the live peers
(operator/cli.py's seniority: the oldest process). The refresh loop runs outside kopf (a kopf timer
would put a finalizer on every pool, which outlives an uninstalled operator and keeps pools and their
namespaces from ever being deleted), so it asks the same question of the same object each round.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from kvpool_operator.kube import Kube


@dataclass(frozen=True)
class Peering:
    name: str  # the peering object's name (--peering)
    clusterwide: bool  # a ClusterKopfPeering; else a KopfPeering in each watched namespace
    identity: str  # this replica's key in the peering object's status
    priority: int
    standalone: bool  # no peering: this replica always leads


def _alive(peer: dict[str, Any], now: datetime.datetime) -> bool:
    try:
        seen = datetime.datetime.fromisoformat(str(peer["lastseen"]))
        if seen.tzinfo is None:
            seen = seen.replace(tzinfo=datetime.UTC)
        return seen + datetime.timedelta(seconds=int(peer.get("lifetime", 60))) > now
    except (KeyError, TypeError, ValueError):
        return False


def leads(peers: dict[str, Any], peering: Peering, now: datetime.datetime) -> bool:
    """No live peer but this one has this one's priority or higher (kopf pauses on a tie too)."""
    return not any(
        isinstance(info, dict) and _alive(info, now) and int(info.get("priority", 0)) >= peering.priority
        for identity, info in peers.items()
        if identity != peering.identity
    )


async def leading(kube: Kube, peering: Peering, namespace: str) -> bool:
    """Whether this replica acts for pools of `namespace` now. A peering object that cannot be read
    means not leading: two replicas both acting would fight over the shared tier's size."""
    if peering.standalone:
        return True
    if peering.clusterwide:
        obj = await kube.get("ClusterKopfPeering", "", peering.name)
    else:
        obj = await kube.get("KopfPeering", namespace, peering.name)
    if obj is None:
        return False
    return leads(obj.get("status") or {}, peering, datetime.datetime.now(datetime.UTC))
