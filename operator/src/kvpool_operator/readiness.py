"""The operator's readiness endpoint: 200 once its pool index is built, 503 before.

A replica that answered the webhook before it knew the pools would admit pods without their cache, so
it stays out of the webhook Service's endpoints until then (kopf's liveness endpoint says nothing of it).
"""

from __future__ import annotations

import asyncio
import urllib.parse

from aiohttp import web


async def serve(endpoint: str, ready: asyncio.Event) -> web.AppRunner | None:
    """Serves GET <path> on <host>:<port> of `endpoint` (http://host:port/path); None when empty."""
    if not endpoint:
        return None
    url = urllib.parse.urlsplit(endpoint)

    async def readyz(_: web.Request) -> web.Response:
        if ready.is_set():
            return web.Response(text="ok")
        return web.Response(status=503, text="the pool index is not built yet")

    app = web.Application()
    app.router.add_get(url.path or "/readyz", readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, url.hostname, url.port or 80).start()
    return runner
