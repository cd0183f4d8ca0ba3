"""The arena control channel over a Unix socket in the arena directory (faster than HTTP on loopback).

Frames are `wire.FRAME_HEADER` + JSON. A request is {"op": <name>, "body": {...}}; the answer is
{"status": <HTTP-like code>, "body": {...}}, the same bodies and codes as POST /v1/arena/<op>.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from typing import Any

from pydantic import BaseModel, ValidationError

from kvpool_sidecar import control
from kvpool_sidecar.service import Sidecar
from kvpool_sidecar.wire import FRAME_HEADER, MAX_FRAME_BYTES, encode_frame

log = logging.getLogger(__name__)


def parse(op: str, body: Any) -> BaseModel | tuple[int, Any]:
    """The validated request, or the error answer (status, body)."""
    entry = control.OPS.get(op)
    if entry is None:
        return 404, {"error": f"unknown operation {op!r}"}
    try:
        return entry[0].model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        return 422, {"error": f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"}


def execute(sidecar: Sidecar, op: str, req: BaseModel) -> tuple[int, Any]:
    try:
        result = control.run(sidecar.store, op, req, sidecar.settings.max_chunk_bytes)
    except control.TooLarge as e:
        return 413, {"error": str(e)}
    return 200, result if isinstance(result, dict) else result.model_dump()


BIG_FRAME = 64 * 1024  # bytes: a request this big is decoded, validated, run and answered off the loop


MALFORMED = encode_frame({"status": 400, "body": {"error": "malformed frame"}})


def decode(raw: bytes) -> tuple[str, Any] | None:
    """(op, body) of a request frame, or None when it is not one."""
    try:
        msg = json.loads(raw)
        return str(msg["op"]), msg.get("body", {})
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):  # RecursionError: [[[[...
        return None


def answer_big_frame(sidecar: Sidecar, raw: bytes) -> bytes:
    """The encoded answer to a big frame: each step is a long call holding the GIL, made from a worker
    thread so that the loop gets its turn between them."""
    request = decode(raw)
    if request is None:
        return MALFORMED
    op, body = request
    req = parse(op, body)
    status, answer = req if isinstance(req, tuple) else execute(sidecar, op, req)
    return encode_frame({"status": status, "body": answer})


async def _serve_client(sidecar: Sidecar, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    loop = asyncio.get_running_loop()
    try:
        while True:
            try:
                header = await reader.readexactly(FRAME_HEADER.size)
            except asyncio.IncompleteReadError:
                return
            (size,) = FRAME_HEADER.unpack(header)
            if size > MAX_FRAME_BYTES:
                writer.write(encode_frame({"status": 413, "body": {"error": "frame too large"}}))
                return
            raw = await reader.readexactly(size)
            if size > BIG_FRAME:
                writer.write(await loop.run_in_executor(None, answer_big_frame, sidecar, raw))
                await writer.drain()
                continue
            request = decode(raw)
            if request is None:
                writer.write(MALFORMED)
                await writer.drain()
                continue
            op, body = request
            req = parse(op, body)
            if isinstance(req, tuple):
                status, answer = req
            elif control.OPS[op][2](sidecar.store, req):  # hashes or waits on Redis: off the loop
                status, answer = await loop.run_in_executor(None, execute, sidecar, op, req)
            else:
                status, answer = execute(sidecar, op, req)
            writer.write(encode_frame({"status": status, "body": answer}))
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        return
    except asyncio.CancelledError:  # the sidecar is stopping while a client keeps its connection open
        return
    except Exception:
        log.exception("control socket client failed")
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def start(sidecar: Sidecar) -> asyncio.AbstractServer | None:
    """The control socket, or None (logged) where it cannot be made: clients then use HTTP control."""
    path = sidecar.socket_path
    assert path is not None
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    try:
        server = await asyncio.start_unix_server(lambda r, w: _serve_client(sidecar, r, w), path=path)
    except OSError as e:  # e.g. a path longer than AF_UNIX allows (~107 bytes)
        log.warning("no control socket at %s (%s): clients will use HTTP control", path, e)
        sidecar.socket_serving = False
        return None
    os.chmod(path, sidecar.arena.mode)  # like the arena (see arena.file_mode)
    return server
