"""The arena control operations, one function each, shared by the HTTP routes and the Unix socket."""

from __future__ import annotations

from kvpool_sidecar import schemas as s
from kvpool_sidecar.store import Store
from kvpool_sidecar.wire import Slot


class TooLarge(ValueError):
    """A chunk longer than --max-chunk-bytes (HTTP 413)."""


def reserve(store: Store, req: s.ReserveRequest, max_chunk_bytes: int) -> s.ReserveResponse:
    for item in req.items:
        if item.length > max_chunk_bytes:
            raise TooLarge(
                f"chunk {item.key} is {item.length} bytes; the largest allowed is {max_chunk_bytes}"
            )
    slots = store.reserve([(i.key, i.length) for i in req.items], req.priority)
    return s.ReserveResponse(slots=[_slot_model(x) if x else None for x in slots])


def commit(store: Store, req: s.CommitRequest) -> s.CommitResponse:
    done = store.commit([(Slot(x.key, x.offset, x.length), x.checksum) for x in req.slots])
    return s.CommitResponse(committed=done)


def abort(store: Store, req: s.AbortRequest) -> dict:
    store.abort([Slot(x.key, x.offset, x.length) for x in req.slots])
    return {}


def pin(store: Store, req: s.PinRequest) -> s.PinResponse:
    lease, slots = store.pin(req.keys)
    return s.PinResponse(lease=lease, slots=[_slot_model(x) for x in slots])


def release(store: Store, req: s.ReleaseRequest) -> s.ReleaseResponse:
    return s.ReleaseResponse(released=store.release(req.lease))


def _slot_model(slot: Slot) -> s.SlotModel:
    return s.SlotModel(key=slot.key, offset=slot.offset, length=slot.length)


# op name -> (request model, handler, runs off the event loop: may hash or wait on Redis)
OPS = {
    "reserve": (s.ReserveRequest, reserve, False),
    "commit": (s.CommitRequest, commit, False),
    "abort": (s.AbortRequest, abort, False),
    "pin": (s.PinRequest, pin, True),
    "release": (s.ReleaseRequest, release, False),
}
