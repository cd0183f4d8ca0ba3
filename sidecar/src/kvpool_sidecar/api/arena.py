"""The shared arena: where it is, and the reserve/commit/pin/release protocol over HTTP."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from kvpool_sidecar import control
from kvpool_sidecar import schemas as s
from kvpool_sidecar.api.control_ops import run
from kvpool_sidecar.api.deps import ERRORS, WRITES, SidecarDep

router = APIRouter(prefix="/v1/arena", tags=["arena"])
# What each control operation answers: the same operations the control socket serves (control.OPS),
# HTTP being the fallback for a client without the socket.
ANSWERS: dict[str, Any] = {
    "reserve": s.ReserveResponse,
    "commit": s.CommitResponse,
    "abort": dict,
    "pin": s.PinResponse,
    "verify": s.VerifyResponse,
    "release": s.ReleaseResponse,
}


@router.get("")
async def arena_info(sidecar: SidecarDep) -> s.ArenaInfo:
    return s.ArenaInfo(
        path=str(sidecar.arena.path),
        size=sidecar.arena.size,
        socket=sidecar.socket_path,
        max_chunk_bytes=sidecar.settings.max_chunk_bytes,
    )


def _operation(op: str) -> Any:
    async def operation(sidecar: SidecarDep, req: Any) -> Any:
        return await run(sidecar, op, req)

    # the body's model, read by FastAPI from the signature: each operation's own request schema
    operation.__annotations__ = {**operation.__annotations__, "req": control.OPS[op].request}
    return operation


for _op, _answer in ANSWERS.items():
    router.add_api_route(
        f"/{_op}",
        _operation(_op),
        methods=["POST"],
        name=_op,
        response_model=_answer,
        responses=ERRORS,
        dependencies=WRITES,
    )
