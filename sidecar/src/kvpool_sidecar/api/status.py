"""Probes, stats and metrics: read-only, served on the data port and on the pod's status port."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse

from kvpool_sidecar import metrics
from kvpool_sidecar import schemas as s
from kvpool_sidecar.api.deps import SidecarDep

router = APIRouter(tags=["status"])


@router.get("/healthz")
async def healthz(sidecar: SidecarDep) -> dict:
    # 200 while the process serves: a changed arena header is repaired in place (re-initialised),
    # not by a restart, and said here so a person sees it
    return {"status": "ok", "arena_fault": sidecar.store.arena_fault}


@router.get("/readyz", responses={503: {"model": s.Error}})
async def readyz(sidecar: SidecarDep, tier: Literal["all", "cpu"] = "all") -> JSONResponse:
    # tier=cpu: ready as soon as the CPU tier serves, whatever Redis does (a Redis outage is a miss,
    # not an error).
    ok, reason = sidecar.ready(cpu_only=tier == "cpu")
    if ok:
        return JSONResponse({"ready": True, "reason": reason})
    return JSONResponse({"ready": False, "reason": reason, "error": f"not ready: {reason}"}, status_code=503)


@router.get("/stats")
async def stats(sidecar: SidecarDep) -> dict:
    return sidecar.stats()


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus(sidecar: SidecarDep) -> PlainTextResponse:
    ok, _ = sidecar.ready()
    return PlainTextResponse(metrics.render(sidecar.stats(), ok), media_type="text/plain; version=0.0.4")
