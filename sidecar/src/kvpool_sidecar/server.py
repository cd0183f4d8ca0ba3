"""Runs the sidecar: the data API, the optional status port and the control socket in one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import uvicorn

from kvpool_sidecar import control_socket
from kvpool_sidecar.app import create_app, create_status_app
from kvpool_sidecar.listen import listen_tcp
from kvpool_sidecar.service import Sidecar

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """One of the sidecar's HTTP servers. Signals are handled once for all of them by `serve` below,
    which also tells each when to exit. uvicorn's own loop wakes every 0.1 s to poll for that and to
    refresh the Date header, which cost an idle sidecar about 0.2% of a core, on cores it shares with
    vLLM; here an idle server sleeps until a request or the exit comes."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._exiting = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    async def main_loop(self) -> None:
        await self.on_tick(0)  # sets the response headers once (no Date: see _uvicorn)
        await self._exiting.wait()

    def exit(self) -> None:
        self.should_exit = True
        self._exiting.set()


def _uvicorn(app, host: str, port: int, log_level: str) -> _Server:
    # No Date header: nothing that calls the sidecar (the connector, the kubelet's probes, the
    # operator, Prometheus) reads it, and keeping it current is what woke the loop 10 times a second.
    config = uvicorn.Config(
        app, host=host, port=port, loop="uvloop", http="httptools", lifespan="off",
        log_level=log_level, access_log=False, timeout_keep_alive=60, date_header=False,
    )  # fmt: skip
    return _Server(config)


async def serve(sidecar: Sidecar) -> None:
    settings = sidecar.settings
    servers = [(_uvicorn(create_app(sidecar), settings.host, settings.port, settings.log_level),
                listen_tcp(settings.host, settings.port))]  # fmt: skip
    if settings.status_port:  # the kubelet's probes and the operator: the pod's address, IPv4 or IPv6
        status_app = create_status_app(sidecar)
        servers.append((_uvicorn(status_app, settings.status_host, settings.status_port, settings.log_level),
                        listen_tcp(settings.status_host, settings.status_port)))  # fmt: skip
    sock_server = await control_socket.start(sidecar)
    loop = asyncio.get_running_loop()

    def stop() -> None:
        for s, _ in servers:
            s.exit()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    sidecar.start()
    log.info(
        "kvpool-sidecar serving on http://%s:%d, arena %s (%d bytes), control socket %s",
        settings.host, settings.port, sidecar.arena.path, sidecar.arena.size, sidecar.socket_path,
    )  # fmt: skip
    try:
        await asyncio.gather(*(s.serve(sockets=[sock]) for s, sock in servers))
    finally:
        if sock_server is not None:
            sock_server.close()
            control_socket.remove(sidecar)
        sidecar.close()
