"""Bounded JSON bodies: FastAPI reads and parses a whole JSON body on the event loop before any
schema limit applies, so a huge one holds every lookup (the control socket's frames are bounded the
same way, MAX_FRAME_BYTES). Chunk bodies (PUT) are bounded by --max-chunk-bytes in their route."""

from __future__ import annotations

import json
from typing import Any

from kvpool_sidecar.wire import MAX_FRAME_BYTES

Scope = dict[str, Any]


class BoundedJsonBodies:
    """ASGI middleware: a POST must declare its length (411 if not), and one longer than `limit` is
    refused (413) before a byte of it is read."""

    def __init__(self, app: Any, limit: int = MAX_FRAME_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            declared = dict(scope["headers"]).get(b"content-length")
            if declared is None or not declared.isdigit():
                return await _refuse(send, 411, "a POST body must declare its Content-Length")
            if int(declared) > self.limit:
                return await _refuse(send, 413, f"body of {int(declared)} bytes; at most {self.limit}")
        await self.app(scope, receive, send)


async def _refuse(send: Any, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    # the unread body is the server's to discard: uvicorn closes the connection after this answer
    headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
