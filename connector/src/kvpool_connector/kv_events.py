"""vLLM KV cache events for kvpool's tier, so routers (llm-d's precise prefix-cache scorer, vLLM's
router) count what this engine's sidecar holds, not only vLLM's own GPU blocks.

Only the scheduler half knows vLLM's block hashes, so the events come from there (take_events): a
chunk is announced (BlockStored, per saved KV cache group, with vLLM's hashes of its blocks) once the
step that saved it has run, or once a lookup found it; each is announced once until withdrawn. The
sidecar evicts without telling the connector, so a router's view is corrected lazily: BlockRemoved when
a lookup misses an announced chunk, for everything on a cache reset, and for the oldest announcement
when more than MAX_ANNOUNCED are held (the router then knows less than kvpool holds, never more).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from .keys import group_link
from .spans import Span

if TYPE_CHECKING:
    from vllm.v1.request import Request

MAX_ANNOUNCED = 8192  # chunk parts announced and remembered: about 1 KiB each with 16 blocks a chunk
MAX_STEPS = 64  # steps planned, not yet run (a pipeline keeps a few in flight)


@dataclass(frozen=True)
class Held:
    """One chunk part (`link`: a KV cache group's part) that kvpool holds, as the router sees it."""

    link: bytes
    group: int
    hashes: tuple[Any, ...]  # vLLM's block hashes (ExternalBlockHash) of its blocks


def events_enabled(vllm_config: Any) -> bool:
    """Whether this engine publishes KV cache events: nothing is tracked otherwise."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and cfg.enable_kv_cache_events)


def hash_block_size(vllm_config: Any, kv_cache_config: Any, block_size: int) -> int:
    """Tokens per vLLM block hash (Request.block_hashes): finer than the KV block in some hybrid
    models; the KV block size where this vLLM does not say."""
    try:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        return int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])
    except (ImportError, AttributeError, TypeError, ValueError):
        return block_size


class KVPoolEvents:
    def __init__(self, block_size: int, hash_block_size: int, medium: str):
        """medium: what the events name kvpool's tier (the connector's kv_events_medium)."""
        self.block_size = block_size
        self.medium = medium
        # each KV block's hash is the last of its hash blocks' (each chains over its whole prefix)
        self.scale = max(1, block_size // hash_block_size) if block_size % hash_block_size == 0 else 0
        self._next: list[tuple[Held, BlockStored]] = []  # found or saved by the step being planned
        self._planned: deque[list[tuple[Held, BlockStored]]] = deque(maxlen=MAX_STEPS)
        self._announced: OrderedDict[bytes, Held] = OrderedDict()
        self._removed: list[KVCacheEvent] = []

    def hold(self, request: Request, span: Span, link: bytes, groups: list[int]) -> None:
        """`span` of `request` (chain link `link`) is in kvpool once this step has run, in `groups`."""
        if not groups or (stored := self._stored(request, span)) is None:
            return
        hashes = tuple(stored.block_hashes)
        for g in groups:
            self._next.append((Held(group_link(link, g), g, hashes), _with_group(stored, g)))

    def planned(self) -> None:
        """The step being planned is complete (build_connector_meta): its chunks wait for it to run."""
        self._planned.append(self._next)
        self._next = []

    def gone(self, link: bytes, groups: list[int]) -> None:
        """A lookup missed the chunk of chain link `link` in `groups`: withdraw what was announced."""
        for g in groups:
            if (held := self._announced.pop(group_link(link, g), None)) is not None:
                self._removed.append(self._withdrawn(held))

    def reset(self) -> None:
        """Nothing saved before is found again (a new key generation): withdraw everything."""
        self._removed += [self._withdrawn(h) for h in self._announced.values()]
        self._announced.clear()
        self._next.clear()
        for step in self._planned:  # steps in flight keep their places: take() pairs them in order
            step.clear()

    def take(self) -> list[KVCacheEvent]:
        """A step has run (vLLM calls take_events once per step's output, in the order planned)."""
        events, self._removed = self._removed, []
        for held, stored in self._planned.popleft() if self._planned else ():
            if held.link in self._announced:  # announced once: consumers may count announcements
                self._announced.move_to_end(held.link)
                continue
            self._announced[held.link] = held
            events.append(stored)
            if len(self._announced) > MAX_ANNOUNCED:
                events.append(self._withdrawn(self._announced.popitem(last=False)[1]))
        return events

    def _withdrawn(self, held: Held) -> BlockRemoved:
        return BlockRemoved(block_hashes=list(held.hashes), medium=self.medium, group_idx=held.group)

    def _stored(self, request: Request, span: Span) -> BlockStored | None:
        """The event for `span`'s blocks, or None where vLLM has no hashes for them (prefix caching
        off, or a block size its hashes do not divide)."""
        bs, scale = self.block_size, self.scale
        hashes = request.block_hashes
        first, end = span[0] // bs, span[1] // bs
        if not scale or len(hashes) < end * scale or end <= first:
            return None
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        ours = [maybe_convert_block_hash(hashes[(i + 1) * scale - 1]) for i in range(first, end)]
        parent = maybe_convert_block_hash(hashes[first * scale - 1]) if first else None
        lora = request.lora_request
        return BlockStored(
            block_hashes=ours,
            parent_block_hash=parent,
            token_ids=list(request.all_token_ids[span[0] : span[1]]),
            block_size=bs,
            lora_id=lora.adapter_id if lora else None,
            medium=self.medium,
            lora_name=lora.name if lora else None,
            extra_keys=_extra_keys(request, span, bs),
        )


def _with_group(stored: BlockStored, group: int) -> BlockStored:
    return msgspec.structs.replace(stored, group_idx=group)


def _extra_keys(request: Request, span: Span, bs: int) -> list[Any] | None:
    """What besides tokens vLLM's hash of each block covers (LoRA, multimodal items, salt), in the
    form vLLM's own events publish; None for a request with tokens only (the common case)."""
    if not (
        request.lora_request
        or request.mm_features
        or request.cache_salt
        or getattr(request, "prompt_embeds", None) is not None
    ):
        return None
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    keys, mm = [], 0
    for start in range(span[0], span[1], bs):
        k, mm = generate_block_hash_extra_keys(request, start, start + bs, mm)
        keys.append(k)
    return to_event_extra_keys(keys)
