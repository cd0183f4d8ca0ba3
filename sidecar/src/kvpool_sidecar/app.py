"""The FastAPI apps: the data API and the read-only status API, assembled from the routers in api/."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpool_sidecar import control
from kvpool_sidecar.api import arena, chunks, engines, status
from kvpool_sidecar.api.uploads import BodyError, Uploads
from kvpool_sidecar.body_limit import BoundedJsonBodies
from kvpool_sidecar.service import Sidecar


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


def _app(title: str, sidecar: Sidecar) -> FastAPI:
    app = FastAPI(title=title, version="0.1.0")
    app.state.sidecar = sidecar  # what api.deps.get_sidecar hands the routes
    _install_error_handlers(app)
    app.include_router(status.router)
    return app


def create_status_app(sidecar: Sidecar) -> FastAPI:
    """Only the read-only probes and stats, for the pod IP (kubelet, the operator)."""
    return _app("kvpool sidecar status", sidecar)


def create_app(sidecar: Sidecar) -> FastAPI:
    """The whole API, on loopback: chunks, the arena protocol, engine reports, and the status routes."""
    app = _app("kvpool sidecar", sidecar)
    app.add_middleware(BoundedJsonBodies)
    app.state.uploads = Uploads(sidecar.store, sidecar.settings.max_chunk_bytes)
    for router in (chunks.router, engines.router, arena.router):
        app.include_router(router)
    return app
