"""The shared arena: where it is, and the reserve/commit/pin/release protocol over HTTP."""

from __future__ import annotations

from fastapi import APIRouter

from kvpool_sidecar import schemas as s
from kvpool_sidecar.api.control_ops import run
from kvpool_sidecar.api.deps import ERRORS, WRITES, SidecarDep

router = APIRouter(prefix="/v1/arena", tags=["arena"])
# the same operations the control socket serves (control.py); HTTP is the fallback without the socket
ops = APIRouter(prefix="/v1/arena", tags=["arena"], responses=ERRORS, dependencies=WRITES)


@router.get("")
async def arena_info(sidecar: SidecarDep) -> s.ArenaInfo:
    return s.ArenaInfo(
        path=str(sidecar.arena.path),
        size=sidecar.arena.size,
        socket=sidecar.socket_path,
        max_chunk_bytes=sidecar.settings.max_chunk_bytes,
    )


@ops.post("/reserve")
async def reserve(sidecar: SidecarDep, req: s.ReserveRequest) -> s.ReserveResponse:
    return await run(sidecar, "reserve", req)


@ops.post("/commit")
async def commit(sidecar: SidecarDep, req: s.CommitRequest) -> s.CommitResponse:
    return await run(sidecar, "commit", req)


@ops.post("/abort")
async def abort(sidecar: SidecarDep, req: s.AbortRequest) -> dict:
    return await run(sidecar, "abort", req)


@ops.post("/pin")
async def pin(sidecar: SidecarDep, req: s.PinRequest) -> s.PinResponse:
    return await run(sidecar, "pin", req)


@ops.post("/verify")
async def verify(sidecar: SidecarDep, req: s.VerifyRequest) -> s.VerifyResponse:
    return await run(sidecar, "verify", req)


@ops.post("/release")
async def release(sidecar: SidecarDep, req: s.ReleaseRequest) -> s.ReleaseResponse:
    return await run(sidecar, "release", req)
