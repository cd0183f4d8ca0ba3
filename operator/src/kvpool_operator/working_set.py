"""What a pool's pods share: the union of their sidecars' working-set sketches, in bytes.

Each sidecar reports, in /stats working_set.sketch, a HyperLogLog sketch (4,096 one-byte registers,
base64) of the distinct chunk keys its engine asked for lately (sidecar working_set.py). The union
of several is their registers' maximum; its distinct count times the pool's mean stored chunk is
what a shared tier must hold. The estimate is the sidecar's own (the images share no code; a test
holds the two equal).
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Sequence
from typing import Any

REGISTERS = 4096


def estimate(registers: bytes | bytearray) -> float:
    """HyperLogLog's distinct count, with linear counting for small counts."""
    m = len(registers)
    raw = 0.7213 / (1 + 1.079 / m) * m * m / sum(2.0**-r for r in registers)
    zeros = registers.count(0)
    return m * math.log(m / zeros) if raw <= 2.5 * m and zeros else raw


def shared_bytes(stats: Sequence[dict[str, Any]], expected: int) -> int | None:
    """The bytes of the distinct chunks the pool's sidecars asked for lately: the union of their
    sketches times their mean stored chunk. None unless all `expected` sidecars sent a sketch (an
    older sidecar, or one that did not answer, could hold anything: the caller falls back)."""
    union = bytearray(REGISTERS)
    stored = chunks = 0
    for s in stats:
        try:
            sketch = base64.b64decode(s["working_set"]["sketch"], validate=True)
            stored += int(s.get("stored_bytes") or 0)
            chunks += int(s.get("chunks") or 0)
        except (KeyError, TypeError, ValueError, binascii.Error):
            return None
        if len(sketch) != REGISTERS:
            return None
        union = bytearray(map(max, union, sketch))
    if len(stats) < expected:
        return None
    distinct = estimate(union)
    if not chunks:
        return 0 if distinct < 1 else None  # asked for, nothing stored yet: no size to go by
    return round(distinct * stored / chunks)
