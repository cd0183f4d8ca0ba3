"""The client's connection pools and its round trips over them: HTTP, and Unix-socket control frames."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from kvpool_sidecar.client_errors import SidecarUnavailable
from kvpool_sidecar.wire import FRAME_HEADER, MAX_FRAME_BYTES, encode_frame

C = TypeVar("C")
A = TypeVar("A")  # what a round trip's first half hands its second
R = TypeVar("R")

# What a reused connection that the server closed while it sat idle fails with, before any answer
STALE_HTTP = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)
STALE_SOCKET = (BrokenPipeError, ConnectionResetError, EOFError)


class ConnectionPool(Generic[C]):
    """Idle connections for reuse; a connection is used by one thread at a time."""

    def __init__(self, connect: Callable[[], C], close: Callable[[C], None], keep: int = 8) -> None:
        self._connect = connect
        self._close = close
        self._keep = keep
        self._idle: list[C] = []
        self._lock = threading.Lock()

    def take(self) -> tuple[C, bool]:
        """(an idle connection or a new one, whether it was idle); the caller gives it back or closes it."""
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        return (conn, True) if conn is not None else (self._connect(), False)

    def give(self, conn: C) -> None:
        """Keeps a connection that answered in full for reuse (or closes it when enough are idle)."""
        with self._lock:
            if len(self._idle) < self._keep:
                self._idle.append(conn)
                return
        self._close(conn)

    def discard(self, conn: C) -> None:
        """Closes a connection whose state is unknown (it raised, or its answer was left unread)."""
        self._close(conn)

    @contextmanager
    def connection(self) -> Iterator[tuple[C, bool]]:
        """Yields (connection, reused). A connection that raised is closed, not returned."""
        conn, reused = self.take()
        try:
            yield conn, reused
        except BaseException:
            self.discard(conn)
            raise
        self.give(conn)

    def round_trip(
        self, ask: Callable[[C], A], finish: Callable[[C, A], R], stale: tuple[type[BaseException], ...]
    ) -> R:
        """The one retry policy: `ask` (send, and wait for the answer's start) then `finish`, on an idle
        connection or a new one. A reused connection the server closed while idle fails in `ask` with
        one of `stale`: the round trip is tried once more on a new connection. Nothing else is retried:
        a request that reached the server may have run."""
        for attempt in (0, 1):
            try:
                with self.connection() as (conn, reused):
                    try:
                        started = ask(conn)
                    except stale:
                        if reused and attempt == 0:
                            raise _Retry from None
                        raise
                    return finish(conn, started)
            except _Retry:
                continue
        raise AssertionError("a new connection's try is never retried")

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            self._close(conn)


class _Retry(Exception):
    pass


def close_quietly(conn: Any) -> None:
    with contextlib.suppress(OSError):
        conn.close()


def http_round_trip(
    pool: ConnectionPool[http.client.HTTPConnection],
    method: str,
    path: str,
    body: bytes | bytearray | memoryview | None,
    headers: dict[str, str] | None,
) -> tuple[int, bytes]:
    """(status, body) of one HTTP request; raises OSError or HTTPException."""

    def ask(conn: http.client.HTTPConnection) -> tuple[http.client.HTTPResponse, bytes]:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp, resp.read()

    def finish(
        conn: http.client.HTTPConnection, got: tuple[http.client.HTTPResponse, bytes]
    ) -> tuple[int, bytes]:
        resp, data = got
        if resp.will_close:
            conn.close()
        return resp.status, data

    return pool.round_trip(ask, finish, STALE_HTTP)


def connect_unix(path: str, timeout: float) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
    except OSError:
        s.close()
        raise
    return s


def frame_round_trip(pool: ConnectionPool[socket.socket], op: str, body: dict) -> Any:
    """The answer frame to one control frame; raises OSError, EOFError or ValueError."""

    def ask(sock: socket.socket) -> bytes:
        send_frame(sock, op, body)
        return _recv_exactly(sock, FRAME_HEADER.size)

    return pool.round_trip(ask, read_frame_body, STALE_SOCKET)


def send_frame(sock: socket.socket, op: str, body: dict) -> None:
    sock.sendall(encode_frame({"op": op, "body": body}))


def read_frame(sock: socket.socket) -> Any:
    """The next answer frame on `sock`; raises OSError, EOFError or ValueError."""
    return read_frame_body(sock, _recv_exactly(sock, FRAME_HEADER.size))


def read_frame_body(sock: socket.socket, header: bytes) -> Any:
    (size,) = FRAME_HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise SidecarUnavailable("control frame too large")
    return json.loads(_recv_exactly(sock, size))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("control socket closed")
        got += k
    return bytes(buf)
