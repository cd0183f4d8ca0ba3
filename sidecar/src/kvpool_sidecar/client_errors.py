"""What the sidecar's client raises: SidecarError, unavailable (try again later) or refused (a bug)."""

from __future__ import annotations

import json


class SidecarError(Exception):
    """Any failure talking to the sidecar; callers turn it into a miss."""


class SidecarUnavailable(SidecarError):
    """The sidecar cannot be reached, timed out, or failed (5xx): try again later, reconnecting."""


class SidecarTimeout(SidecarUnavailable):
    """The sidecar did not answer in time (hung, or overloaded): the call waited out its timeout."""


def unavailable(message: str, cause: BaseException) -> SidecarUnavailable:
    return (SidecarTimeout if isinstance(cause, TimeoutError) else SidecarUnavailable)(message)


class SidecarRefused(SidecarError):
    """The sidecar refused the request as wrong (4xx): a caller's bug; retrying cannot help."""


def status_error(status: int, message: str) -> SidecarError:
    return SidecarRefused(message) if 400 <= status < 500 else SidecarUnavailable(message)


def error_text(data: bytes) -> str:
    """The `error` of a JSON error answer, else the answer's start."""
    try:
        return str(json.loads(data).get("error"))
    except (ValueError, AttributeError):
        return data[:200].decode(errors="replace")
