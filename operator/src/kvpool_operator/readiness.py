"""The operator's probe endpoints: readiness, 200 once its pool index is built (503 before), and
liveness, 200 while its event loop runs.

A replica that answered the webhook before it knew the pools would admit pods without their cache, so
it stays out of the webhook Service's endpoints until then. Liveness is served here rather than by kopf,
whose endpoint binds one address family: a wildcard host (0.0.0.0, ::) here means every address of
IPv4 and IPv6, as an IPv6-only cluster's kubelet needs.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Awaitable, Callable

from aiohttp import web

WILDCARDS = frozenset({"", "0.0.0.0", "::", "*"})
Handler = Callable[[web.Request], Awaitable[web.Response]]


async def serve(readiness: str, liveness: str, ready: asyncio.Event) -> list[web.AppRunner]:
    """Serves GET <path> on <host>:<port> of each endpoint given (http://host:port/path)."""

    async def readyz(_: web.Request) -> web.Response:
        if ready.is_set():
            return web.Response(text="ok")
        return web.Response(status=503, text="the pool index is not built yet")

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    endpoints = ((readiness, readyz), (liveness, healthz))
    return [await serve_endpoint(url, handler) for url, handler in endpoints if url]


async def serve_endpoint(endpoint: str, handler: Handler, default_path: str = "/") -> web.AppRunner:
    """Serves GET on one endpoint (http://host:port/path); a port that cannot be bound raises OSError,
    with nothing left running."""
    url = urllib.parse.urlsplit(endpoint)
    app = web.Application()
    app.router.add_get(url.path or default_path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host = None if (url.hostname or "") in WILDCARDS else url.hostname  # None: every address, both families
    try:
        await web.TCPSite(runner, host, url.port or 80).start()
    except OSError:
        await runner.cleanup()
        raise
    return runner
