"""What an injection added to a pod, found by comparing the pod with and without it, and its digest.

The digest is stamped on injected pods (kvpool.dev/config-hash) and recomputed for running pods: a pod
is outdated when anything kvpool would add now differs (sidecar image, resources, args, env, volumes,
the connector config, any container kvpool adds), without listing those parts by hand here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any


def added(before: Any, after: Any) -> Any:
    """The parts of `after` that `before` lacks or holds differently: for objects the differing keys,
    for lists of named objects (containers, volumes, env, mounts) the differing entries by name, for
    other lists the new elements, in order; None when nothing was added."""
    if isinstance(before, Mapping) and isinstance(after, Mapping):
        found = {k: d for k, v in after.items() if (d := added(before.get(k), v)) is not None}
        return found or None
    if isinstance(before, list) and isinstance(after, list):
        if all(isinstance(x, Mapping) and "name" in x for x in [*before, *after]):
            old = {x["name"]: x for x in before}
            entries = [d for x in after if (d := _named_difference(old.get(x["name"]), x)) is not None]
            return entries or None
        new = [x for x in after if x not in before]
        return new or None
    return None if before == after else after


def _named_difference(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> Any:
    diff = added(before or {}, after)
    return None if diff is None else {"name": after["name"], **diff}


def digest(before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    """A short digest of what `after` adds to `before` (key order and whitespace never matter)."""
    text = json.dumps(added(before, after), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
