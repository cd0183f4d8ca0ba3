"""What the routes are handed: the Sidecar of the app serving the request, and the write check."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, HTTPException, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kvpool_sidecar import schemas as s
from kvpool_sidecar.api.uploads import Uploads
from kvpool_sidecar.service import Sidecar
from kvpool_sidecar.wire import KEY_PATTERN, WRITE_TOKEN_FILE

KeyPath = Annotated[str, Path(pattern=KEY_PATTERN, description="lowercase hex, 32..128 characters")]
# HTTP writes carry the write token (write_token.py); FastAPI's scheme puts it in the OpenAPI document
BEARER = HTTPBearer(auto_error=False, description=f"the token in <arena dir>/{WRITE_TOKEN_FILE}")
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": s.Error},
    401: {"model": s.Error},
    413: {"model": s.Error},
    422: {"model": s.Error},
}


# async, though they never await: FastAPI runs a plain def dependency in a thread, a hop per request
# that also lets a client's half-close be seen before a refusal is answered
async def get_sidecar(request: Request) -> Sidecar:
    return request.app.state.sidecar


async def get_uploads(request: Request) -> Uploads:
    return request.app.state.uploads


SidecarDep = Annotated[Sidecar, Depends(get_sidecar)]
UploadsDep = Annotated[Uploads, Depends(get_uploads)]


async def authorized(
    sidecar: SidecarDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]
) -> None:
    """Every route that changes what is stored or held needs the token."""
    if not sidecar.token.admits(credentials.credentials if credentials else None):
        raise HTTPException(
            401,
            f"writes need the token in {sidecar.token.path} (Authorization: Bearer <token>)",
            headers={"WWW-Authenticate": "Bearer"},
        )


WRITES = [Depends(authorized)]
