"""The small client of the sidecar that the connector and tools use.

Standard library and xxhash only (it runs inside vLLM). Thread-safe: connections are taken from a
small pool per client, so many threads (and many processes, each with its own client) may call at
once. Every failure is a SidecarError (client_errors.py) of one of two kinds: SidecarUnavailable
(the sidecar cannot be reached, or is slow: a miss, and perhaps a reconnect) and SidecarRefused (it
answered that the request is wrong: a bug in the caller, never retried).

Lookups and arena control messages (reserve/commit/abort/pin/verify/release) go over the Unix socket
in the arena directory when it can be reached, else over HTTP; bench/sidecar_bench.py measures both.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import os
import secrets
import select
import socket
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from kvpool_sidecar.batching import CLIENT_FRAME_ENTRIES
from kvpool_sidecar.client_arena import MappedArena
from kvpool_sidecar.client_errors import (
    SidecarError,
    SidecarUnavailable,
    error_text,
    status_error,
    unavailable,
)
from kvpool_sidecar.client_transport import (
    STALE_SOCKET,
    ConnectionPool,
    close_quietly,
    connect_unix,
    frame_round_trip,
    http_round_trip,
    read_frame,
    send_frame,
)
from kvpool_sidecar.wire import (
    ARENA_FILE,
    CONTROL_SOCKET,
    WRITE_TOKEN_FILE,
    Pinned,
    Slot,
    checksum,
    slot_from_json,
    slot_to_json,
)

__all__ = ["Pinned", "SentLookup", "SidecarClient", "Slot", "checksum", "read_answered"]

T = TypeVar("T")


class SidecarClient:
    def __init__(
        self,
        url: str = "http://127.0.0.1:7070",
        *,
        timeout: float = 1.0,
        shm_path: str | None = None,
        control: str = "auto",
        control_connections: int = 8,
    ):
        """control: how arena control messages travel: "auto" (the Unix socket when it can be reached,
        else HTTP), "socket" or "http". control_connections: the idle control-socket connections kept
        for reuse; a caller with more lookups in flight at once (send_lookup) keeps as many."""
        if control not in ("auto", "socket", "http"):
            raise ValueError(f"control must be auto, socket or http, not {control!r}")
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"sidecar url must be http://host:port, got {url!r}")
        self.url = url
        self.timeout = timeout
        self._host = parsed.hostname
        self._port = parsed.port or 80
        self._shm_path = shm_path
        self._http: ConnectionPool[http.client.HTTPConnection] = ConnectionPool(
            lambda: http.client.HTTPConnection(self._host, self._port, timeout=timeout), close_quietly
        )
        self._sock: ConnectionPool[socket.socket] | None = None
        self._sock_checked = control == "http"
        self._control_mode = control
        self._control_connections = control_connections
        self._arena = MappedArena()
        self._token: str | None = None

    # --- transport ---------------------------------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        body: bytes | bytearray | memoryview | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes]:
        """One HTTP round trip; a write carries the sidecar's write token, read again once on 401 (a
        restarted sidecar has a new one)."""
        if method == "GET" or not path.startswith("/v1/"):
            return self._send(method, path, body, headers)
        for fresh in (False, True):
            token = self._write_token(fresh)
            auth = {**(headers or {}), "Authorization": f"Bearer {token}"} if token else headers
            status, data = self._send(method, path, body, auth)
            if status != 401 or fresh:
                break
        return status, data

    def _write_token(self, fresh: bool) -> str | None:
        """The token beside the arena; None where this process may not read it (so may not write)."""
        if self._token is None or fresh:
            directory = self._shm_path or os.path.dirname(self._arena_file())
            try:
                with open(os.path.join(directory, WRITE_TOKEN_FILE), encoding="ascii") as f:
                    self._token = f.read().strip()
            except (OSError, ValueError):
                self._token = None
        return self._token

    def _send(
        self,
        method: str,
        path: str,
        body: bytes | bytearray | memoryview | None,
        headers: dict[str, str] | None,
    ) -> tuple[int, bytes]:
        try:
            return http_round_trip(self._http, method, path, body, headers)
        except (OSError, http.client.HTTPException) as e:
            raise unavailable(f"{method} {self.url}{path}: {e!r}", e) from e

    def _json(self, method: str, path: str, payload: Any = None, ok: tuple[int, ...] = (200,)) -> Any:
        body = json.dumps(payload).encode() if payload is not None else None
        headers = {"Content-Type": "application/json"} if body is not None else {}
        status, data = self._request(method, path, body, headers)
        if status not in ok:
            raise status_error(status, f"{method} {path}: HTTP {status}: {error_text(data)}")
        try:
            return json.loads(data) if data else {}
        except ValueError as e:
            raise SidecarUnavailable(f"{method} {path}: answer is not JSON") from e

    def _socket_pool(self) -> ConnectionPool[socket.socket] | None:
        """The Unix-socket pool, if the control socket exists where this process sees the arena."""
        if not self._sock_checked:
            path = self._socket_path()  # raises while the sidecar is unreachable: asked again next time
            self._sock_checked = True
            if path and os.path.exists(path):
                self._sock = ConnectionPool(
                    lambda: connect_unix(path, self.timeout), close_quietly, keep=self._control_connections
                )
            elif self._control_mode == "socket":
                raise SidecarUnavailable(f"no control socket at {path}")
        return self._sock

    def _socket_path(self) -> str | None:
        if self._shm_path is not None:
            return os.path.join(self._shm_path, CONTROL_SOCKET)
        return self._json("GET", "/v1/arena").get("socket")

    def _control(self, op: str, body: dict) -> Any:
        """One control round trip (a lookup or an arena operation): over the Unix socket when there is
        one, else HTTP."""
        pool = self._socket_pool()
        if pool is None:
            return self._json("POST", "/v1/lookup" if op == "lookup" else f"/v1/arena/{op}", body)

        try:
            answer = frame_round_trip(pool, op, body)
        except (OSError, EOFError, ValueError) as e:
            raise unavailable(f"control {op} over {self._socket_path_hint()}: {e!r}", e) from e
        return _control_body(op, answer)

    def _socket_path_hint(self) -> str:
        return os.path.join(self._shm_path, CONTROL_SOCKET) if self._shm_path else "the control socket"

    # --- public HTTP API -----------------------------------------------------------------------------

    def healthz(self) -> bool:
        try:
            status, _ = self._request("GET", "/healthz")
        except SidecarError:
            return False
        return status == 200

    def readyz(self) -> tuple[bool, str]:
        status, data = self._request("GET", "/readyz")
        try:
            reason = json.loads(data).get("reason", "")
        except ValueError:
            reason = data.decode(errors="replace")
        return status == 200, reason

    def stats(self) -> dict:
        return self._json("GET", "/stats")

    def lookup(self, keys: Sequence[str]) -> int:
        """Length of the longest prefix of `keys` that can be loaded now."""
        if not keys:
            return 0
        return int(self._control("lookup", {"keys": list(keys)})["hits"])

    def lookup_then_first_whole(
        self, keys: Sequence[str], at: int, groups: Sequence[Sequence[str]]
    ) -> tuple[int, int | None]:
        """`lookup(keys)`, and when it is `at`, `first_whole(groups)`, in one round trip. The second
        value means something only when the first is `at`."""
        return _lookup_answer(self._control("lookup", _lookup_body(keys, at, groups)))

    def send_lookup(self, keys: Sequence[str], at: int, groups: Sequence[Sequence[str]]) -> SentLookup | None:
        """Sends `lookup_then_first_whole(keys, at, groups)` and returns without its answer, which the
        sidecar writes into the socket meanwhile: SentLookup.answer() reads it. None where control goes
        over HTTP (ask with lookup_then_first_whole)."""
        pool = self._socket_pool()
        if pool is None:
            return None
        body = _lookup_body(keys, at, groups)
        try:
            sock, reused = pool.take()
        except OSError as e:
            raise unavailable(f"control lookup over {self._socket_path_hint()}: {e!r}", e) from e
        try:
            send_frame(sock, "lookup", body)
        except OSError as e:
            pool.discard(sock)
            if reused and isinstance(e, STALE_SOCKET):  # closed by the sidecar while idle: a new one
                return self.send_lookup(keys, at, groups)
            raise unavailable(f"control lookup over {self._socket_path_hint()}: {e!r}", e) from e
        again = functools.partial(self.lookup_then_first_whole, keys, at, groups)
        return SentLookup(pool, sock, reused, again, self._socket_path_hint())

    def first_whole(self, groups: Sequence[Sequence[str]]) -> int | None:
        """The index of the first of `groups` whose keys can all be loaded now, or None."""
        return self.lookup_then_first_whole([], 0, groups)[1] if groups else None

    def put(self, key: str, data: bytes | bytearray | memoryview, priority: int = 0) -> bool:
        """True when stored or already there; False when there is no room even after eviction (507)."""
        headers = {"Content-Type": "application/octet-stream", "X-KVPool-Priority": str(int(priority))}
        status, body = self._request("PUT", f"/v1/chunks/{key}", data, headers)
        if status in (200, 201):
            return True
        if status == 507:
            return False
        raise status_error(status, f"PUT chunk {key}: HTTP {status}: {error_text(body)}")

    def get(self, key: str) -> bytes | None:
        status, body = self._request("GET", f"/v1/chunks/{key}")
        if status == 200:
            return body
        if status == 404:
            return None
        raise status_error(status, f"GET chunk {key}: HTTP {status}: {error_text(body)}")

    def delete(self, key: str) -> bool:
        status, body = self._request("DELETE", f"/v1/chunks/{key}")
        if status == 204:
            return True
        if status == 404:
            return False
        raise status_error(status, f"DELETE chunk {key}: HTTP {status}: {error_text(body)}")

    def report_engine(self, engine: str, report: Mapping[str, Any]) -> None:
        """PUT /v1/engines/<engine>: whether kvpool serves this vLLM engine (schemas.EngineReport)."""
        self._json("PUT", f"/v1/engines/{engine}", dict(report), ok=(204,))

    # --- zero-copy arena path: one round trip per batch ---------------------------------------------

    def arena(self) -> memoryview:
        """A writable mapping of the whole arena (mapped once, cached; see MappedArena.view)."""
        return self._arena.view(self._arena_file)

    def arena_info(self) -> dict[str, Any]:
        """GET /v1/arena: the arena's path and size, the control socket, the largest chunk allowed."""
        return dict(self._json("GET", "/v1/arena"))

    def _arena_file(self) -> str:
        if self._shm_path is not None:
            return os.path.join(self._shm_path, ARENA_FILE)
        return str(self.arena_info()["path"])

    def reserve(
        self,
        items: Sequence[tuple[str, int]],
        priority: int = 0,
        groups: Mapping[str, str] | None = None,
        prefixes: Mapping[str, Sequence[str]] | None = None,
    ) -> list[Slot | None]:
        """Room for each (key, length): None where the key is already stored or there is no room.
        groups: key -> the chunk it is one rank's copy of (all ranks name the same group), so the
        write-behind to Redis keeps all of a chunk's copies or none. prefixes: key -> the keys of the
        chunk's block prefixes, which find it once committed (see ChunkIndex.loadable)."""
        groups, prefixes = groups or {}, prefixes or {}
        entries = [
            {
                "key": k,
                "length": int(n),
                **({"group": groups[k]} if k in groups else {}),
                **({"prefixes": list(prefixes[k])} if prefixes.get(k) else {}),
            }
            for k, n in items
        ]
        out: list[Slot | None] = []
        for part in _slices(entries):
            answer = self._control("reserve", {"items": part, "priority": int(priority)})
            epoch = int(answer["epoch"])
            out += [slot_from_json(x, epoch) if x else None for x in answer["slots"]]
        return out

    def commit(self, items: Sequence[tuple[Slot, int]]) -> list[bool]:
        """Makes written slots loadable, each with the checksum of the bytes the writer wrote, computed
        over its own source (never over the arena, which a stale writer may have written since).
        False where the sidecar refused: the reservation was no longer this writer's (it expired, or
        the sidecar restarted), so the chunk is not saved."""
        entries = [{**slot_to_json(s), "checksum": digest} for s, digest in items]
        answers = (self._control("commit", {"slots": part}) for part in _slices(entries))
        return [bool(x) for answer in answers for x in answer["committed"]]

    def abort(self, slots: Sequence[Slot]) -> None:
        for part in _slices([slot_to_json(s) for s in slots]):
            self._control("abort", {"slots": part})

    def pin(self, keys: Sequence[str], *, verify: bool = True) -> Pinned:
        """Pins the longest loadable prefix of `keys`; promotes from Redis into the arena when needed.

        verify=False skips the sidecar's check of the bytes (a hash of every pinned byte, on the
        caller's critical path): the caller then checks each slot against `slot.checksum` itself,
        for instance while it copies, and must not use the bytes of a slot that fails; it sends
        those keys to verify() so the sidecar drops them."""
        lease = secrets.token_hex(16)
        try:
            answer = self._control("pin", {"keys": list(keys), "verify": verify, "lease": lease})
        except SidecarUnavailable:
            # It may still pin (a slow promotion from Redis): give the lease back at once, not
            # after --lease-seconds of pinned chunks nobody reads.
            with contextlib.suppress(SidecarError):
                self.release(lease)
            raise
        epoch = int(answer["epoch"])
        return Pinned(answer["lease"], [slot_from_json(x, epoch) for x in answer["slots"]])

    def verify(self, keys: Sequence[str]) -> list[str]:
        """Has the sidecar check the stored bytes of `keys`; returns the keys it dropped as corrupt."""
        return [k for part in _slices(list(keys)) for k in self._control("verify", {"keys": part})["dropped"]]

    def release(self, lease: str) -> None:
        self._control("release", {"lease": lease})

    def close(self) -> None:
        self._http.close()
        if self._sock is not None:
            self._sock.close()
        self._arena.close()

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SentLookup:
    """A lookup sent on its own connection whose answer has not been read yet. Its connection goes
    back to the pool once the answer is read, or is closed by drop(); either happens once. The answer
    may be read ahead (read_answered) and kept until answer() asks for it."""

    def __init__(
        self,
        pool: ConnectionPool[socket.socket],
        sock: socket.socket,
        reused: bool,
        again: Callable[[], tuple[int, int | None]],
        where: str,
    ) -> None:
        self._pool, self._reused, self._again, self._where = pool, reused, again, where
        self._sock: socket.socket | None = sock
        self._answer: tuple[int, int | None] | SidecarError | None = None

    @property
    def read_ahead_answer(self) -> tuple[int, int | None] | None:
        """The answer read ahead and not taken yet (answer() takes it), or None."""
        return self._answer if isinstance(self._answer, tuple) else None

    @property
    def answered(self) -> bool:
        """Whether its answer has been read from the socket (or failed to be)."""
        return self._answer is not None

    def answer(self) -> tuple[int, int | None]:
        """lookup_then_first_whole's answer, read now unless read ahead. A reused connection that the
        sidecar had closed is asked again on a new one (the lookup never reached it)."""
        if self._answer is None:
            return self._read()
        answer, self._answer = self._answer, None
        if isinstance(answer, SidecarError):
            raise answer
        return answer

    def read_ahead(self) -> None:
        """Reads the answer now (it is in the socket: read_answered), keeping it or its error."""
        try:
            self._answer = self._read()
        except SidecarError as e:
            self._answer = e

    def _read(self) -> tuple[int, int | None]:
        sock, self._sock = self._sock, None
        assert sock is not None, "a sent lookup is answered once"
        try:
            answer = read_frame(sock)
        except (OSError, EOFError, ValueError) as e:
            self._pool.discard(sock)
            if self._reused and isinstance(e, STALE_SOCKET):
                return self._again()
            raise unavailable(f"control lookup over {self._where}: {e!r}", e) from e
        self._pool.give(sock)
        return _lookup_answer(_control_body("lookup", answer))

    def fileno(self) -> int:
        """Its socket's descriptor while the answer waits there, else -1."""
        return self._sock.fileno() if self._sock is not None else -1

    def drop(self) -> None:
        """Forgets the answer. A connection it was not read from is closed, not reused (the answer
        would be read next)."""
        sock, self._sock = self._sock, None
        self._answer = None
        if sock is not None:
            self._pool.discard(sock)


def read_answered(lookups: Sequence[SentLookup]) -> None:
    """Reads ahead the answers of `lookups` that are in their sockets already, in one poll() that does
    not wait: the rest are read when asked for."""
    waiting = {fd: lk for lk in lookups if (fd := lk.fileno()) >= 0}
    if not waiting:
        return
    poll = select.poll()
    for fd in waiting:
        poll.register(fd, select.POLLIN)
    for fd, _ in poll.poll(0):
        waiting[fd].read_ahead()


def _control_body(op: str, answer: Any) -> Any:
    status = answer.get("status")
    if status != 200:
        message = f"control {op}: {status}: {answer.get('body', {}).get('error')}"
        raise status_error(status if isinstance(status, int) else 500, message)
    return answer["body"]


def _lookup_body(keys: Sequence[str], at: int, groups: Sequence[Sequence[str]]) -> dict:
    return {"keys": list(keys), "alternatives": [list(g) for g in groups], "alternatives_at": at}


def _lookup_answer(body: Any) -> tuple[int, int | None]:
    found = body.get("alternative")
    return int(body["hits"]), None if found is None else int(found)


def _slices(entries: list[T]) -> Iterator[list[T]]:
    """A batch in frames of CLIENT_FRAME_ENTRIES (batching.py)."""
    for start in range(0, len(entries), CLIENT_FRAME_ENTRIES):
        yield entries[start : start + CLIENT_FRAME_ENTRIES]
