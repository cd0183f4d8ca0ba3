"""Kubernetes resource quantities (`4Gi`, `512Mi`, `1G`, plain bytes) as integers."""

from __future__ import annotations

import re
from decimal import Decimal

_SUFFIXES = {
    "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")


def parse_quantity(value: str | int) -> int:
    """Bytes in a quantity, rounded up; ValueError on anything that is not a non-negative quantity."""
    if isinstance(value, bool):
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"not a quantity: {value!r}")
        return value
    match = _QUANTITY.match(str(value).strip())
    if not match:
        raise ValueError(f"not a quantity: {value!r}")
    number, suffix = match.groups()
    scaled = Decimal(number) * _SUFFIXES[suffix or ""]
    return int(scaled.to_integral_value(rounding="ROUND_CEILING"))


def format_mebibytes(n: int) -> str:
    """A quantity in whole MiB, rounded up: what resource requests and sizeLimits are written in."""
    return f"{-(-n // 2**20)}Mi"
