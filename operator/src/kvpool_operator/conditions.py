"""The pool's `Ready` and `Degraded` conditions: their type, and how a new set merges into status."""

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


def failed(reason: str, problems: list[str]) -> tuple[Condition, Condition]:
    """(Ready, Degraded) for a pool the operator could not set up, for `reason` (pool_health judges
    the others)."""
    message = "; ".join(problems)
    return Condition("Ready", False, reason, message), Condition("Degraded", True, reason, message)


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
