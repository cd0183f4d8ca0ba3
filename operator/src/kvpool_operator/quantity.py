"""Kubernetes resource quantities (`4Gi`, `512Mi`, `1G`, `250m`, plain numbers)."""

from __future__ import annotations

import re
from decimal import Decimal

_SUFFIXES: dict[str, Decimal | int] = {
    "": 1, "m": Decimal("0.001"),
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$")


def quantity_value(value: str | int) -> Decimal:
    """The exact value of a quantity (CPU's `250m` is 0.25); ValueError on anything that is not a
    non-negative quantity."""
    if isinstance(value, bool) or (isinstance(value, int) and value < 0):
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, int):
        return Decimal(value)
    match = _QUANTITY.match(str(value).strip())
    if not match:
        raise ValueError(f"not a quantity: {value!r}")
    number, suffix = match.groups()
    return Decimal(number) * _SUFFIXES[suffix or ""]


def parse_quantity(value: str | int) -> int:
    """Bytes in a quantity, rounded up; ValueError on anything that is not a non-negative quantity."""
    return int(quantity_value(value).to_integral_value(rounding="ROUND_CEILING"))


def format_mebibytes(n: int) -> str:
    """A quantity in whole MiB, rounded up: what resource requests and sizeLimits are written in."""
    return f"{-(-n // 2**20)}Mi"
