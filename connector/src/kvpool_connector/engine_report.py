"""An engine tells its pod's sidecar, once at start, whether kvpool serves it and whether its chunks
are shared with other pods. The operator reads that from the sidecar's /stats into the pool's status:
a pool whose vLLM runs without the cache is not Ready, though only the engine log said so before.
"""

from __future__ import annotations

import threading
from typing import Any

from kvpool_sidecar.client import SidecarClient
from kvpool_sidecar.client_errors import SidecarError, SidecarRefused

from .config import KVPoolConfig, sidecar_client
from .logs import connector_logger

log = connector_logger(__name__)

# waits between tries while the sidecar does not answer (on a bare host it may start after vLLM)
RETRY_WAITS = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0)


def engine_name(vllm_config: Any) -> str:
    """The engine's name within its pod: its data parallel rank (a restarted vLLM reuses it)."""
    return f"dp{getattr(vllm_config.parallel_config, 'data_parallel_rank', 0) or 0}"


def report_engine(cfg: KVPoolConfig, engine: str, report: dict[str, Any]) -> threading.Thread | None:
    """Sends `report` (the sidecar's EngineReport) now; if the sidecar does not answer, again in the
    background until it does. A report that cannot be sent costs nothing but the pool's status."""
    client = sidecar_client(cfg)
    if _send(client, engine, report):
        client.close()
        return None
    thread = threading.Thread(
        target=_retry, args=(client, engine, report), name="kvpool-engine-report", daemon=True
    )
    thread.start()
    return thread


def _retry(client: SidecarClient, engine: str, report: dict[str, Any]) -> None:
    waiting = threading.Event()  # never set: each wait is a pause between tries, not a sync
    try:
        for wait in RETRY_WAITS:
            waiting.wait(wait)
            if _send(client, engine, report):
                return
        log.warning("kvpool: the sidecar at %s never took this engine's report", client.url)
    finally:
        client.close()


def _send(client: SidecarClient, engine: str, report: dict[str, Any]) -> bool:
    """True when the report is taken or can never be (a sidecar refusing it: older, or no token)."""
    try:
        client.report_engine(engine, report)
    except SidecarRefused as e:
        log.warning("kvpool: the sidecar refused this engine's report: %s", e)
        return True
    except SidecarError:
        return False
    return True
