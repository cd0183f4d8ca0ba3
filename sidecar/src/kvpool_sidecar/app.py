"""The FastAPI apps, built by factories: the data API and the read-only status API. Routes stay thin."""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any, Literal

import xxhash
from fastapi import Depends, FastAPI, Header, HTTPException, Path, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvpool_sidecar import control, metrics
from kvpool_sidecar import schemas as s
from kvpool_sidecar.body_limit import BoundedJsonBodies
from kvpool_sidecar.service import Sidecar
from kvpool_sidecar.store import PutResult
from kvpool_sidecar.wire import KEY_PATTERN, WRITE_TOKEN_FILE, Slot

log = logging.getLogger(__name__)

KeyPath = Annotated[str, Path(pattern=KEY_PATTERN, description="lowercase hex, 32..128 characters")]
# HTTP writes carry the write token (write_token.py); FastAPI's scheme puts it in the OpenAPI document
BEARER = HTTPBearer(auto_error=False, description=f"the token in <arena dir>/{WRITE_TOKEN_FILE}")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]
BINARY = {"schema": {"type": "string", "format": "binary"}}
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": s.Error},
    401: {"model": s.Error},
    413: {"model": s.Error},
    422: {"model": s.Error},
}


class BodyError(Exception):
    def __init__(self, status: int, message: str) -> None:
        self.status = status
        self.message = message


def _install_error_handlers(app: FastAPI) -> None:
    """Every error is a JSON body {"error": message} with the right status code."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = f"{where}: {first.get('msg', 'invalid request')}"
        detail = [{k: e.get(k) for k in ("loc", "msg", "type")} for e in exc.errors()[:20]]
        return JSONResponse({"error": message, "detail": detail}, status_code=422)

    @app.exception_handler(BodyError)
    async def body_error(_: Request, exc: BodyError) -> JSONResponse:
        return JSONResponse({"error": exc.message}, status_code=exc.status)

    @app.exception_handler(control.TooLarge)
    async def too_large(_: Request, exc: control.TooLarge) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=413)


def _add_status_routes(app: FastAPI, sidecar: Sidecar) -> None:
    @app.get("/healthz", tags=["status"])
    async def healthz() -> dict:
        # 200 while the process serves: a changed arena header is repaired in place (re-initialised),
        # not by a restart, and said here so a person sees it
        return {"status": "ok", "arena_fault": sidecar.store.arena_fault}

    @app.get("/readyz", tags=["status"], responses={503: {"model": s.Error}})
    async def readyz(tier: Literal["all", "cpu"] = "all") -> JSONResponse:
        # tier=cpu: ready as soon as the CPU tier serves, whatever Redis does (a Redis outage is a miss,
        # not an error).
        ok, reason = sidecar.ready(cpu_only=tier == "cpu")
        if ok:
            return JSONResponse({"ready": True, "reason": reason})
        return JSONResponse(
            {"ready": False, "reason": reason, "error": f"not ready: {reason}"}, status_code=503
        )

    @app.get("/stats", tags=["status"])
    async def stats() -> dict:
        return sidecar.stats()

    @app.get("/metrics", tags=["status"], response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        ok, _ = sidecar.ready()
        return PlainTextResponse(metrics.render(sidecar.stats(), ok), media_type="text/plain; version=0.0.4")


def create_status_app(sidecar: Sidecar) -> FastAPI:
    """Only the read-only probes and stats, for the pod IP (kubelet, the operator)."""
    app = FastAPI(title="kvpool sidecar status", version="0.1.0")
    _install_error_handlers(app)
    _add_status_routes(app, sidecar)
    return app


def create_app(sidecar: Sidecar) -> FastAPI:
    app = FastAPI(title="kvpool sidecar", version="0.1.0")
    app.add_middleware(BoundedJsonBodies)
    _install_error_handlers(app)
    _add_status_routes(app, sidecar)
    store = sidecar.store
    max_chunk = sidecar.settings.max_chunk_bytes

    async def authorized(credentials: Credentials) -> None:
        if not sidecar.token.admits(credentials.credentials if credentials else None):
            raise HTTPException(
                401,
                f"writes need the token in {sidecar.token.path} (Authorization: Bearer <token>)",
                headers={"WWW-Authenticate": "Bearer"},
            )

    writes = [Depends(authorized)]  # every route that changes what is stored or held
    drain_limit = 4 * max_chunk  # oversized bodies up to this are read and discarded, larger ones cut off
    # Bodies streaming in over HTTP hold their reservations until they end (at most --lease-seconds):
    # together they may hold half the arena, so slow writers never hoard the room the connector's
    # saves need. One upload alone may hold any size the arena takes.
    uploads_cap = store.arena.capacity // 2
    uploads: dict[int, Slot] = {}  # the reservations of bodies streaming in now

    def uploading() -> int:
        """The room uploads hold now (a reservation that expired holds none, though its body goes on)."""
        return sum(slot.length for slot in uploads.values() if store.holds(slot))

    async def run(op: str, req: BaseModel) -> Any:
        """One control operation; those that hash or ask Redis run off the event loop."""
        if control.OPS[op].off_loop(store, req):
            return await run_in_threadpool(control.run, store, op, req, max_chunk)
        return control.run(store, op, req, max_chunk)

    @app.post("/v1/lookup", tags=["chunks"], responses=ERRORS)
    async def lookup(req: s.LookupRequest) -> s.LookupResponse:
        return await run("lookup", req)

    @app.put(
        "/v1/chunks/{key}",
        tags=["chunks"],
        status_code=201,
        dependencies=writes,
        responses={200: {"description": "already stored"}, 507: {"model": s.Error}, **ERRORS},
        openapi_extra={"requestBody": {"required": True, "content": {"application/octet-stream": BINARY}}},
    )
    async def put_chunk(
        key: KeyPath,
        request: Request,
        priority: Annotated[int, Header(alias="X-KVPool-Priority", ge=-(2**31), lt=2**31)] = 0,
    ) -> JSONResponse:
        result = await _receive_chunk(request, key, priority)
        if result is PutResult.FULL:
            raise HTTPException(507, "no room for this chunk even after eviction")
        if result is PutResult.BUSY:
            raise HTTPException(409, "another client is writing this chunk right now")
        if result is PutResult.EXPIRED:
            raise HTTPException(409, "the chunk's reservation expired while its body was sent: not stored")
        created = result is PutResult.CREATED
        return JSONResponse(
            {"key": key, "stored": True, "created": created}, status_code=201 if created else 200
        )

    async def _receive_chunk(request: Request, key: str, priority: int) -> PutResult:
        """Streams the body into a reserved arena slot; oversize is refused before memory is committed."""
        declared = request.headers.get("content-length")
        if declared is None:
            data = bytearray()
            async for piece in _stream(request):
                data += piece
                if len(data) > max_chunk:
                    del data  # nothing kept; read on (bounded) so the client can read the answer
                    await _drain(request, drain_limit - max_chunk)
                    raise BodyError(413, f"body larger than the largest chunk allowed ({max_chunk} bytes)")
            return store.put(key, data, priority)
        try:
            length = int(declared)
            if length < 0:
                raise ValueError
        except ValueError:
            raise BodyError(400, f"bad Content-Length: {declared!r}") from None
        if length > max_chunk:
            if length <= drain_limit:  # read and discard, so a client that sends first sees the answer
                await _drain(request, length)
            raise BodyError(
                413, f"body of {length} bytes is larger than the largest chunk allowed ({max_chunk})"
            )
        if (held := uploading()) and held + length > uploads_cap:
            await _drain(request, length)
            raise BodyError(
                503, f"uploads in flight hold {held} bytes, at most {uploads_cap} together: retry later"
            )
        result, slot = store.reserve_one(key, length, priority)
        if slot is None:
            async for _ in _stream(request):  # drain, so the connection stays usable
                pass
            return result
        uploads[id(slot)] = slot
        view = store.arena.view
        pos = slot.offset
        end = slot.offset + slot.length
        digest = xxhash.xxh3_64()  # over the body as received, never over the arena
        expired = False
        # Renewals keep a reservation alive while its body streams in, but never past this: a
        # client trickling bytes would otherwise hold its share of the arena for as long as it likes.
        deadline = time.monotonic() + store.lease_seconds
        try:
            async for piece in _stream(request):
                if pos + len(piece) > end:
                    raise BodyError(400, "body longer than its Content-Length")
                if time.monotonic() > deadline:
                    raise BodyError(408, f"body not received within {store.lease_seconds:g} s: not stored")
                # A slow body may outlive its reservation; the extent may be another chunk's by
                # then: not one more byte goes there (the rest is read, so the answer can be).
                expired = expired or not store.renew(slot)
                if not expired:
                    view[pos : pos + len(piece)] = piece
                    digest.update(piece)
                pos += len(piece)
            if pos != end:
                raise BodyError(400, f"body of {pos - slot.offset} bytes, Content-Length said {length}")
        except BaseException:
            store.abort([slot])
            raise
        finally:
            del uploads[id(slot)]
        return PutResult.EXPIRED if expired else store.commit_one(slot, digest.intdigest())

    async def _drain(request: Request, limit: int) -> None:
        seen = 0
        async for piece in _stream(request):
            seen += len(piece)
            if seen > limit:
                return

    async def _stream(request: Request):
        try:
            async for piece in request.stream():
                if piece:
                    yield piece
        except ClientDisconnect:
            raise BodyError(400, "client disconnected before the body was complete") from None

    @app.get(
        "/v1/chunks/{key}",
        tags=["chunks"],
        response_class=Response,
        responses={200: {"content": {"application/octet-stream": {}}}, 404: {"model": s.Error}, **ERRORS},
    )
    async def get_chunk(key: KeyPath) -> Response:
        data = await run_in_threadpool(store.get, key)
        if data is None:
            raise HTTPException(404, "no such chunk")
        return Response(content=data, media_type="application/octet-stream")

    @app.delete(
        "/v1/chunks/{key}",
        tags=["chunks"],
        status_code=204,
        responses={404: {"model": s.Error}, **ERRORS},
        dependencies=writes,
    )
    async def delete_chunk(key: KeyPath) -> Response:
        found = await run_in_threadpool(store.delete, key) if store.lower is not None else store.delete(key)
        if not found:
            raise HTTPException(404, "no such chunk")
        return Response(status_code=204)

    @app.put(
        "/v1/engines/{engine}",
        tags=["engines"],
        status_code=204,
        responses=ERRORS,
        dependencies=writes,
    )
    async def engine_report(
        engine: Annotated[str, Path(pattern=s.ENGINE_PATTERN)], report: s.EngineReport
    ) -> Response:
        sidecar.engines.put(engine, report.model_dump())
        return Response(status_code=204)

    @app.get("/v1/arena", tags=["arena"])
    async def arena_info() -> s.ArenaInfo:
        return s.ArenaInfo(
            path=str(sidecar.arena.path),
            size=sidecar.arena.size,
            socket=sidecar.socket_path,
            max_chunk_bytes=max_chunk,
        )

    @app.post("/v1/arena/reserve", tags=["arena"], responses=ERRORS, dependencies=writes)
    async def reserve(req: s.ReserveRequest) -> s.ReserveResponse:
        return await run("reserve", req)

    @app.post("/v1/arena/commit", tags=["arena"], responses=ERRORS, dependencies=writes)
    async def commit(req: s.CommitRequest) -> s.CommitResponse:
        return await run("commit", req)

    @app.post("/v1/arena/abort", tags=["arena"], responses=ERRORS, dependencies=writes)
    async def abort(req: s.AbortRequest) -> dict:
        return await run("abort", req)

    @app.post("/v1/arena/pin", tags=["arena"], responses=ERRORS, dependencies=writes)
    async def pin(req: s.PinRequest) -> s.PinResponse:
        return await run("pin", req)

    @app.post("/v1/arena/verify", tags=["arena"], responses=ERRORS, dependencies=writes)
    async def verify(req: s.VerifyRequest) -> s.VerifyResponse:
        return await run("verify", req)

    @app.post("/v1/arena/release", tags=["arena"], responses=ERRORS, dependencies=writes)
    async def release(req: s.ReleaseRequest) -> s.ReleaseResponse:
        return await run("release", req)

    return app
