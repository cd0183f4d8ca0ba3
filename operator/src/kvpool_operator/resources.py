"""The sidecar's resource requests and limits, and the checks that keep the pod the API server admits.

The API server refuses a container whose request is above its limit, and a pod whose every container
has equal CPU and memory requests and limits is Guaranteed only while the sidecar's are equal too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpool_operator.quantity import format_mebibytes, quantity_value

SIDECAR_CPU_REQUEST = "250m"
# What the sidecar's memory cgroup holds beyond the arena, measured with the real sidecar on tmpfs
# (tests/sidecar/test_sidecar_memory.py holds this formula against its peak RSS):
PROCESS_BYTES = 64 * 2**20  # the process: 33 MiB anonymous, 17 MiB of mapped libraries
PAGE_TABLE_DIVISOR = 512  # the populated mapping's page tables: 8 bytes per 4 KiB page, 2 MiB per GiB
SIDECAR_MAX_CHUNKS = 200_000  # the sidecar's --max-chunks default, which the index never exceeds
INDEX_BYTES_PER_CHUNK = 1024  # measured 750 at its peak, 200,000 chunks; 960 with as many block-prefix keys
IN_FLIGHT_BYTES = 64 * 2**20  # one chunk body of --max-chunk-bytes (default 64 MiB) being copied
JOURNAL_DIVISOR = 256  # the arena's journal, tmpfs beside it: the sidecar's journal.budget_bytes
QOS_RESOURCES = ("cpu", "memory")


def sidecar_resources(
    capacity_bytes: int, given: Mapping[str, Any] | None, guaranteed: bool = False
) -> dict[str, dict[str, Any]]:
    """The pool's values key by key over the defaults (memory: the arena plus the process). A default
    request never exceeds a given limit; in a Guaranteed pod requests equal limits, CPU included."""
    memory = format_mebibytes(sidecar_memory_bytes(capacity_bytes))
    given_requests = dict((given or {}).get("requests") or {})
    limits = {"memory": memory, **((given or {}).get("limits") or {})}
    requests: dict[str, Any] = {"cpu": SIDECAR_CPU_REQUEST, "memory": memory}
    for key, limit in limits.items():
        if key in requests and _above(requests[key], limit):
            requests[key] = limit
    requests.update(given_requests)
    if guaranteed:
        limits.setdefault("cpu", requests["cpu"])
        requests.update({key: limits[key] for key in QOS_RESOURCES})
    return {"requests": requests, "limits": limits}


def sidecar_memory_bytes(capacity_bytes: int) -> int:
    """The memory the sidecar of an arena this big uses at most: at 100 GiB the page tables alone take
    200 MiB, so no fixed overhead covers every capacity."""
    index = SIDECAR_MAX_CHUNKS * INDEX_BYTES_PER_CHUNK
    page_tables = capacity_bytes // PAGE_TABLE_DIVISOR
    return arena_files_bytes(capacity_bytes) + page_tables + PROCESS_BYTES + index + IN_FLIGHT_BYTES


def arena_files_bytes(capacity_bytes: int) -> int:
    """The arena file and its journal (what a restarted sidecar adopts; the sidecar's
    journal.budget_bytes), both on the pod's tmpfs."""
    return capacity_bytes + capacity_bytes // JOURNAL_DIVISOR + 2**20


def resource_problems(capacity_bytes: int, given: Mapping[str, Any] | None) -> list[str]:
    """What would make the API server refuse the injected pod, or the kernel kill the sidecar."""
    merged = sidecar_resources(capacity_bytes, given)
    found = []
    for key, value in [*merged["requests"].items(), *merged["limits"].items()]:
        try:
            quantity_value(value)
        except ValueError:
            return [f"spec.sidecar.resources: {key} {value!r} is not a quantity"]
    for key, request in merged["requests"].items():
        limit = merged["limits"].get(key)
        if limit is not None and _above(request, limit):
            found.append(f"spec.sidecar.resources.requests.{key} {request} is above its limit {limit}")
    needed = sidecar_memory_bytes(capacity_bytes)
    if quantity_value(merged["limits"]["memory"]) < needed:
        found.append(
            f"spec.sidecar.resources.limits.memory {merged['limits']['memory']} is less than the arena plus "
            f"the sidecar process ({format_mebibytes(needed)}): it would be OOM-killed"
        )
    return found


def guaranteed(pod: Mapping[str, Any]) -> bool:
    """Whether the pod is Guaranteed QoS (every container's CPU and memory limited, requests equal)."""
    spec = pod.get("spec") or {}
    containers = [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]
    if not containers:
        return False
    for c in containers:
        res = c.get("resources") or {}
        limits, requests = res.get("limits") or {}, res.get("requests") or {}
        for key in QOS_RESOURCES:
            if key not in limits:
                return False
            try:
                if key in requests and quantity_value(requests[key]) != quantity_value(limits[key]):
                    return False
            except ValueError:
                return False
    return True


def _above(request: Any, limit: Any) -> bool:
    try:
        return quantity_value(request) > quantity_value(limit)
    except ValueError:
        return False  # resource_problems names it
