"""What each of the pod's vLLM engines says of itself at start (kvpool on or off, and why)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path
from fastapi.responses import Response

from kvpool_sidecar import schemas as s
from kvpool_sidecar.api.deps import ERRORS, WRITES, SidecarDep

router = APIRouter(prefix="/v1/engines", tags=["engines"])


@router.put("/{engine}", status_code=204, responses=ERRORS, dependencies=WRITES)
async def engine_report(
    sidecar: SidecarDep, engine: Annotated[str, Path(pattern=s.ENGINE_PATTERN)], report: s.EngineReport
) -> Response:
    sidecar.engines.put(engine, report.model_dump())
    return Response(status_code=204)
