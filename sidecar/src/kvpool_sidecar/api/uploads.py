"""Chunk bodies streamed over HTTP into reserved arena slots, bounded in size, time and room held."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import xxhash
from starlette.requests import ClientDisconnect, Request

from kvpool_sidecar.store import PutResult, Store
from kvpool_sidecar.wire import Slot


class BodyError(Exception):
    """A body refused while (or instead of) being read: the status and message the client gets."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        self.message = message


class Uploads:
    """The bodies streaming in now. Each holds its reservation until it ends (at most --lease-seconds):
    together they may hold half the arena, so slow writers never hoard the room the connector's saves
    need. One upload alone may hold any size the arena takes."""

    def __init__(self, store: Store, max_chunk: int) -> None:
        self.store = store
        self.max_chunk = max_chunk
        self.drain_limit = 4 * max_chunk  # oversized bodies up to this are read and discarded, larger cut off
        self.cap = store.arena.capacity // 2
        self._slots: dict[int, Slot] = {}

    def held(self) -> int:
        """The room uploads hold now (a reservation that expired holds none, though its body goes on)."""
        return sum(slot.length for slot in self._slots.values() if self.store.holds(slot))

    async def receive(self, request: Request, key: str, priority: int) -> PutResult:
        """Streams the body into a reserved arena slot; oversize is refused before memory is committed."""
        store, max_chunk = self.store, self.max_chunk
        declared = request.headers.get("content-length")
        if declared is None:
            data = bytearray()
            async for piece in _stream(request):
                data += piece
                if len(data) > max_chunk:
                    del data  # nothing kept; read on (bounded) so the client can read the answer
                    await _drain(request, self.drain_limit - max_chunk)
                    raise BodyError(413, f"body larger than the largest chunk allowed ({max_chunk} bytes)")
            return store.put(key, data, priority)
        try:
            length = int(declared)
            if length < 0:
                raise ValueError
        except ValueError:
            raise BodyError(400, f"bad Content-Length: {declared!r}") from None
        if length > max_chunk:
            if length <= self.drain_limit:  # read and discard, so a client that sends first sees the answer
                await _drain(request, length)
            raise BodyError(
                413, f"body of {length} bytes is larger than the largest chunk allowed ({max_chunk})"
            )
        if (held := self.held()) and held + length > self.cap:
            await _drain(request, length)
            raise BodyError(
                503, f"uploads in flight hold {held} bytes, at most {self.cap} together: retry later"
            )
        result, slot = store.reserve_one(key, length, priority)
        if slot is None:
            async for _ in _stream(request):  # drain, so the connection stays usable
                pass
            return result
        self._slots[id(slot)] = slot
        try:
            expired, checksum = await self._fill(request, slot, length)
        except BaseException:
            store.abort([slot])
            raise
        finally:
            del self._slots[id(slot)]
        return PutResult.EXPIRED if expired else store.commit_one(slot, checksum)

    async def _fill(self, request: Request, slot: Slot, length: int) -> tuple[bool, int]:
        """Writes the body into the slot: (whether its reservation expired on the way, its checksum)."""
        store = self.store
        view = store.arena.view
        pos = slot.offset
        end = slot.offset + slot.length
        digest = xxhash.xxh3_64()  # over the body as received, never over the arena
        expired = False
        # Renewals keep a reservation alive while its body streams in, but never past this: a
        # client trickling bytes would otherwise hold its share of the arena for as long as it likes.
        deadline = time.monotonic() + store.lease_seconds
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
        return expired, digest.intdigest()


async def _drain(request: Request, limit: int) -> None:
    seen = 0
    async for piece in _stream(request):
        seen += len(piece)
        if seen > limit:
            return


async def _stream(request: Request) -> AsyncIterator[bytes]:
    try:
        async for piece in request.stream():
            if piece:
                yield piece
    except ClientDisconnect:
        raise BodyError(400, "client disconnected before the body was complete") from None
