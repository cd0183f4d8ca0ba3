"""The arena control operations as the HTTP routes run them: those that hash or ask Redis off the loop."""

from __future__ import annotations

from typing import Any

from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel

from kvpool_sidecar import control
from kvpool_sidecar.service import Sidecar


async def run(sidecar: Sidecar, op: str, req: BaseModel) -> Any:
    store, max_chunk = sidecar.store, sidecar.settings.max_chunk_bytes
    if control.OPS[op].off_loop(store, req):
        return await run_in_threadpool(control.run, store, op, req, max_chunk)
    return control.run(store, op, req, max_chunk)
