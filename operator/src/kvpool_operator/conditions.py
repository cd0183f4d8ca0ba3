"""The pool's `Ready` and `Degraded` conditions from what the operator knows."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str


def assess(
    problems: list[str], tier: tuple[int, int] | None, reason: str = "InvalidSpec"
) -> tuple[Condition, Condition]:
    """(Ready, Degraded) from the problems (`reason`: spec problems by default) and the shared tier's
    (desired, ready)."""
    if problems:
        message = "; ".join(problems)
        return Condition("Ready", False, reason, message), Condition("Degraded", True, reason, message)
    if tier is not None:
        desired, ready = tier
        if ready < 1:
            message = f"shared Redis tier starting: 0/{desired} shards ready"
            return (
                Condition("Ready", False, "SharedTierStarting", message),
                Condition("Degraded", True, "SharedTierStarting", message),
            )
        if ready < desired:
            message = f"shared Redis tier: {ready}/{desired} shards ready"
            return Condition("Ready", True, "Configured", message), Condition(
                "Degraded", True, "ShardsNotReady", message
            )
    message = "connector config stored; matched pods get the cache when they are created"
    return Condition("Ready", True, "Configured", message), Condition("Degraded", False, "Healthy", "")


def merge(
    current: Iterable[Mapping[str, Any]],
    new: Iterable[Condition],
    generation: int | None,
    now: datetime.datetime,
) -> list[dict[str, Any]]:
    """The full conditions list: lastTransitionTime kept while a condition's status does not change."""
    by_type = {c.get("type"): dict(c) for c in current}
    stamp = now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    for cond in new:
        status = "True" if cond.status else "False"
        old = by_type.get(cond.type)
        entry = {
            "type": cond.type,
            "status": status,
            "reason": cond.reason,
            "message": cond.message,
            "lastTransitionTime": old["lastTransitionTime"]
            if old and old.get("status") == status and old.get("lastTransitionTime")
            else stamp,
        }
        if generation is not None:
            entry["observedGeneration"] = generation
        by_type[cond.type] = entry
    return [by_type[k] for k in sorted(by_type, key=str)]
