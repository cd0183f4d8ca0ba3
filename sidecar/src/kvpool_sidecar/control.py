"""The arena control operations, one function each, shared by the HTTP routes and the Unix socket."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from pydantic import BaseModel

from kvpool_sidecar import schemas as s
from kvpool_sidecar.batching import OFF_LOOP_ENTRIES
from kvpool_sidecar.store import Store
from kvpool_sidecar.wire import Slot


class TooLarge(ValueError):
    """A chunk longer than --max-chunk-bytes (HTTP 413)."""


def lookup(store: Store, req: s.LookupRequest) -> s.LookupResponse:
    hits = store.lookup(req.keys)
    at = len(req.keys) if req.alternatives_at is None else req.alternatives_at
    if hits != at or not req.alternatives:
        return s.LookupResponse(hits=hits)
    return s.LookupResponse(hits=hits, alternative=store.first_whole(req.alternatives))


def reserve(store: Store, req: s.ReserveRequest, max_chunk_bytes: int) -> s.ReserveResponse:
    for item in req.items:
        if item.length > max_chunk_bytes:
            raise TooLarge(
                f"chunk {item.key} is {item.length} bytes; the largest allowed is {max_chunk_bytes}"
            )
    groups = {i.key: i.group for i in req.items if i.group}
    prefixes = {i.key: i.prefixes for i in req.items if i.prefixes}
    slots = store.reserve([(i.key, i.length) for i in req.items], req.priority, groups, prefixes)
    return s.ReserveResponse(epoch=store.arena.epoch, slots=[_slot_model(x) if x else None for x in slots])


def commit(store: Store, req: s.CommitRequest) -> s.CommitResponse:
    done = store.commit([(Slot(x.key, x.offset, x.length, gen=x.gen), x.checksum) for x in req.slots])
    return s.CommitResponse(committed=done)


def abort(store: Store, req: s.AbortRequest) -> dict:
    store.abort([Slot(x.key, x.offset, x.length, gen=x.gen) for x in req.slots])
    return {}


def pin(store: Store, req: s.PinRequest) -> s.PinResponse:
    lease, slots = store.pin(req.keys, verify=req.verify, lease_id=req.lease)
    return s.PinResponse(
        lease=lease,
        epoch=store.arena.epoch,
        slots=[_pinned_model(x) for x in slots],
    )


def verify(store: Store, req: s.VerifyRequest) -> s.VerifyResponse:
    return s.VerifyResponse(dropped=store.verify(req.keys))


def release(store: Store, req: s.ReleaseRequest) -> s.ReleaseResponse:
    return s.ReleaseResponse(released=store.release(req.lease))


def _pinned_model(slot: Slot) -> s.ChecksummedSlot:
    assert slot.checksum is not None  # a pinned chunk always has the checksum it was saved with
    return s.ChecksummedSlot(
        key=slot.key, offset=slot.offset, length=slot.length, gen=0, checksum=slot.checksum
    )


def _slot_model(slot: Slot) -> s.SlotModel:
    return s.SlotModel(key=slot.key, offset=slot.offset, length=slot.length, gen=slot.gen)


def run(store: Store, op: str, req: BaseModel, max_chunk_bytes: int) -> Any:
    """Runs one validated operation; raises TooLarge for an oversized reservation."""
    handler = OPS[op].handler
    return handler(store, req, max_chunk_bytes) if handler is reserve else handler(store, req)


def _never(store: Store, req: Any) -> bool:
    return False


def _always(store: Store, req: Any) -> bool:
    return True


def _asks_redis(store: Store, req: s.LookupRequest) -> bool:
    keys = [*req.keys, *(k for group in req.alternatives for k in group)]
    return len(keys) > OFF_LOOP_ENTRIES or store.needs_lower(keys)


def _big(store: Store, req: Any) -> bool:
    return len(getattr(req, "items", None) or getattr(req, "slots", None) or ()) > OFF_LOOP_ENTRIES


class Op(NamedTuple):
    request: type[BaseModel]
    handler: Callable[..., Any]
    # whether a request runs off the event loop: it hashes, waits on Redis, or is a big batch
    off_loop: Callable[[Store, Any], bool]


OPS: dict[str, Op] = {
    "lookup": Op(s.LookupRequest, lookup, _asks_redis),
    "reserve": Op(s.ReserveRequest, reserve, _big),
    "commit": Op(s.CommitRequest, commit, _big),
    "abort": Op(s.AbortRequest, abort, _big),
    "pin": Op(s.PinRequest, pin, _always),
    "verify": Op(s.VerifyRequest, verify, _always),
    "release": Op(s.ReleaseRequest, release, _never),
}
