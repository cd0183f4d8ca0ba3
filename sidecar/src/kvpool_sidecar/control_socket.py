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
from kvpool_sidecar.batching import OFF_LOOP_FRAME_BYTES
from kvpool_sidecar.service import Sidecar
from kvpool_sidecar.wire import FRAME_HEADER, MAX_FRAME_BYTES, encode_frame

log = logging.getLogger(__name__)


def parse(op: str, body: Any) -> BaseModel | tuple[int, Any]:
    """The validated request, or the error answer (status, body)."""
    entry = control.OPS.get(op)
    if entry is None:
        return 404, {"error": f"unknown operation {op!r}"}
    try:
        return entry.request.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        return 422, {"error": f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"}


MALFORMED = encode_frame({"status": 400, "body": {"error": "malformed frame"}})


def prepare(raw: bytes) -> tuple[str, BaseModel] | bytes:
    """(op, validated request) of a request frame, or the encoded error answer."""
    try:
        msg = json.loads(raw)
        op, body = str(msg["op"]), msg.get("body", {})
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):  # RecursionError: [[[[...
        return MALFORMED
    req = parse(op, body)
    return encode_frame({"status": req[0], "body": req[1]}) if isinstance(req, tuple) else (op, req)


def respond(sidecar: Sidecar, op: str, req: BaseModel) -> bytes:
    """The encoded answer to a validated request."""
    try:
        result = control.run(sidecar.store, op, req, sidecar.settings.max_chunk_bytes)
    except control.TooLarge as e:
        return encode_frame({"status": 413, "body": {"error": str(e)}})
    return encode_frame({"status": 200, "body": result if isinstance(result, dict) else result.model_dump()})


def answer_big_frame(sidecar: Sidecar, raw: bytes) -> bytes:
    """The encoded answer to a big frame: each step is a long call holding the GIL, made from a worker
    thread so that the loop gets its turn between them."""
    prepared = prepare(raw)
    return prepared if isinstance(prepared, bytes) else respond(sidecar, *prepared)


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
            if size > OFF_LOOP_FRAME_BYTES:
                answer = await loop.run_in_executor(None, answer_big_frame, sidecar, raw)
            else:
                prepared = prepare(raw)
                if isinstance(prepared, bytes):
                    answer = prepared
                elif control.OPS[prepared[0]].off_loop(sidecar.store, prepared[1]):  # hashes or asks Redis
                    answer = await loop.run_in_executor(None, respond, sidecar, *prepared)
                else:
                    answer = respond(sidecar, *prepared)
            writer.write(answer)
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


def remove(sidecar: Sidecar) -> None:
    """Deletes the socket file at exit (asyncio leaves it on Python < 3.13): a restart makes a new one."""
    if sidecar.socket_path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sidecar.socket_path)
