"""Request and response bodies of the JSON API; the HTTP routes and the Unix socket validate with these."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvpool_sidecar.wire import KEY_PATTERN

Key = Annotated[str, Field(pattern=KEY_PATTERN, description="lowercase hex, 32..128 characters")]
MAX_BATCH = 65536  # keys per request; a 1M-token prompt in 256-token chunks is 4096
Uint64 = Annotated[int, Field(ge=0, lt=2**64)]
Priority = Annotated[int, Field(ge=-(2**31), lt=2**31)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LookupRequest(_Strict):
    keys: list[Key] = Field(max_length=MAX_BATCH)
    alternatives: list[Annotated[list[Key], Field(max_length=MAX_BATCH)]] = Field(
        default_factory=list,
        max_length=64,
        description="key groups tried, in order, when the keys found were `alternatives_at`: the answer "
        "names the first group whose keys can all be loaded now (a shorter tail chunk saved by an earlier "
        "prompt)",
    )
    alternatives_at: Annotated[int, Field(ge=0)] | None = Field(
        None,
        description="how many of `keys` found makes `alternatives` tried (the connector's guess of where "
        "its prompt misses, so that a miss takes one round trip); unset: all of them",
    )


class LookupResponse(BaseModel):
    hits: int
    alternative: int | None = None


class ReserveItem(_Strict):
    key: Key
    length: Annotated[int, Field(ge=0)]
    group: Key | None = Field(
        None,
        description="the chunk this key is one rank's copy of (every rank's copy names the same group): "
        "the write-behind to Redis keeps all of a group's copies or none",
    )
    prefixes: list[Key] = Field(
        default_factory=list,
        max_length=255,
        description="the keys of the chunk's block prefixes (1, 2, ... blocks): once committed, a lookup "
        "alternative or a pin of one of them finds this chunk, whose first blocks are that prefix's",
    )


class ReserveRequest(_Strict):
    items: list[ReserveItem] = Field(max_length=MAX_BATCH)
    priority: Priority = 0


class SlotModel(_Strict):
    key: Key
    offset: Annotated[int, Field(ge=0)]
    length: Annotated[int, Field(ge=0)]
    gen: Uint64 = Field(0, description="the reservation's generation; commit and abort echo it")


class ReserveResponse(BaseModel):
    epoch: Uint64 = Field(description="the arena's epoch (its header): the offsets are valid in it only")
    slots: list[SlotModel | None]


class ChecksummedSlot(SlotModel):
    checksum: Uint64


class CommitRequest(_Strict):
    slots: list[ChecksummedSlot] = Field(max_length=MAX_BATCH)


class CommitResponse(BaseModel):
    committed: list[bool]  # false: the reservation was no longer the writer's (expired, restarted)


class AbortRequest(_Strict):
    slots: list[SlotModel] = Field(max_length=MAX_BATCH)


class PinRequest(_Strict):
    keys: list[Key] = Field(max_length=MAX_BATCH)
    lease: Annotated[str, Field(pattern="^[0-9a-f]{32}$")] | None = Field(
        None,
        description="the caller's name for the lease: a caller whose pin timed out releases it by this "
        "name, and a pin released before it ran pins nothing",
    )
    verify: bool = Field(
        True,
        description="false: the caller checks each slot's checksum itself (while it copies, off its "
        "critical path) and sends the keys that fail to /v1/arena/verify",
    )


class PinResponse(BaseModel):
    lease: str
    epoch: Uint64 = Field(description="the arena's epoch (its header): the offsets are valid in it only")
    slots: list[ChecksummedSlot]


class VerifyRequest(_Strict):
    keys: list[Key] = Field(max_length=MAX_BATCH)


class VerifyResponse(BaseModel):
    dropped: list[str]  # the keys whose stored bytes no longer match their checksum


class ReleaseRequest(_Strict):
    lease: Annotated[str, Field(max_length=128)]


class ReleaseResponse(BaseModel):
    released: bool


ENGINE_PATTERN = "^[A-Za-z0-9._-]{1,64}$"


class EngineReport(_Strict):
    """What a vLLM engine's connector says of itself at start, for the pool's status: whether kvpool
    serves it, and whether its chunks are shared with other pods."""

    cache: Literal["on", "off"]
    reason: str = Field("", max_length=2000)  # why it is off, or why it does not share
    shared: bool = True  # False: its weights could not be fingerprinted, so its keys are its own
    model: str = Field("", max_length=1000)


class ArenaInfo(BaseModel):
    path: str
    size: int
    socket: str | None
    max_chunk_bytes: int  # a larger chunk is refused (413)


class Error(BaseModel):
    error: str
