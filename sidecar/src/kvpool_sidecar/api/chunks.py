"""Chunks by key: lookup, and PUT/GET/DELETE of one chunk's bytes (the path for clients without the arena)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from kvpool_sidecar import schemas as s
from kvpool_sidecar.api.control_ops import run
from kvpool_sidecar.api.deps import ERRORS, WRITES, KeyPath, SidecarDep, UploadsDep
from kvpool_sidecar.store import PutResult

router = APIRouter(prefix="/v1", tags=["chunks"])
BINARY = {"schema": {"type": "string", "format": "binary"}}
_REFUSED = {
    PutResult.FULL: (507, "no room for this chunk even after eviction"),
    PutResult.BUSY: (409, "another client is writing this chunk right now"),
    PutResult.EXPIRED: (409, "the chunk's reservation expired while its body was sent: not stored"),
}


@router.post("/lookup", responses=ERRORS)
async def lookup(sidecar: SidecarDep, req: s.LookupRequest) -> s.LookupResponse:
    return await run(sidecar, "lookup", req)


@router.put(
    "/chunks/{key}",
    status_code=201,
    dependencies=WRITES,
    responses={200: {"description": "already stored"}, 507: {"model": s.Error}, **ERRORS},
    openapi_extra={"requestBody": {"required": True, "content": {"application/octet-stream": BINARY}}},
)
async def put_chunk(
    key: KeyPath,
    request: Request,
    uploads: UploadsDep,
    priority: Annotated[int, Header(alias="X-KVPool-Priority", ge=-(2**31), lt=2**31)] = 0,
) -> JSONResponse:
    result = await uploads.receive(request, key, priority)
    if result in _REFUSED:
        raise HTTPException(*_REFUSED[result])
    created = result is PutResult.CREATED
    return JSONResponse({"key": key, "stored": True, "created": created}, status_code=201 if created else 200)


@router.get(
    "/chunks/{key}",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}}}, 404: {"model": s.Error}, **ERRORS},
)
async def get_chunk(sidecar: SidecarDep, key: KeyPath) -> Response:
    data = await run_in_threadpool(sidecar.store.get, key)
    if data is None:
        raise HTTPException(404, "no such chunk")
    return Response(content=data, media_type="application/octet-stream")


@router.delete(
    "/chunks/{key}", status_code=204, responses={404: {"model": s.Error}, **ERRORS}, dependencies=WRITES
)
async def delete_chunk(sidecar: SidecarDep, key: KeyPath) -> Response:
    store = sidecar.store
    found: Any = await run_in_threadpool(store.delete, key) if store.lower is not None else store.delete(key)
    if not found:
        raise HTTPException(404, "no such chunk")
    return Response(status_code=204)
