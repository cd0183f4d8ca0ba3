"""One step's chunk saves against the sidecar: reserve their slots, copy the chunks in, commit them with
the checksums of their source bytes. The same on the worker's save thread and in the save process
(save_process.py); only the copy differs. Plain Python with the sidecar's client: no torch, no vLLM.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpool_sidecar.client import SidecarClient, Slot
from kvpool_sidecar.client_errors import SidecarError, SidecarRefused, SidecarTimeout

from .common import ChunkOp
from .counters import Counts
from .keys import rank_key
from .ratelimit import RateLimitedLog


@dataclass
class ChunkSave:
    op: ChunkOp
    key: str
    priority: int
    staged: Any = None  # CUDA: the step's pinned copy holding this chunk's blocks (worker._Staged)
    first: int = 0  # the chunk's first row in it


@dataclass
class SaveOutcome:
    """What, beyond its counts, a step's saves tell the worker about the sidecar."""

    timed_out: str | None = None  # a call waited out its timeout: the next steps do not wait (breaker)
    refused: str | None = None  # the sidecar refuses this worker's chunks as such: saving is off


# Copies reserved chunks into their slots; returns (slot, checksum of the source bytes) for each.
WriteAll = Callable[[list[tuple[ChunkSave, Slot]]], list[tuple[Slot, int]]]


class ChunkSaves:
    def __init__(
        self,
        client: SidecarClient,
        rank: int,
        chunk_bytes: Callable[[ChunkOp], int],
        stats: Counts,
        warn: RateLimitedLog,
    ) -> None:
        self.client = client
        self.rank = rank
        self.chunk_bytes = chunk_bytes
        self.stats = stats
        self.warn = warn

    def _reserve(self, saves: list[ChunkSave]) -> list[tuple[ChunkSave, Slot]]:
        """Slots for the chunks the sidecar takes, by priority (higher ones may evict lower ones)."""
        reserved = []
        for priority in dict.fromkeys(s.priority for s in saves):
            group = [s for s in saves if s.priority == priority]
            slots = self.client.reserve(
                [(s.key, self.chunk_bytes(s.op)) for s in group],
                priority=priority,
                groups={s.key: s.op.link.hex() for s in group},  # every rank's copy: one group
                prefixes={s.key: [rank_key(link, self.rank) for link in s.op.prefixes] for s in group},
            )
            for s, slot in zip(group, slots, strict=True):
                if slot is None:
                    self.stats.add("save_skipped_chunks")  # stored already, or no room
                else:
                    reserved.append((s, slot))
        return reserved

    def save(
        self,
        saves: list[ChunkSave],
        write_all: WriteAll,
        start_copy: Callable[[], bool],
        end_copy: Callable[[], None],
    ) -> SaveOutcome:
        """Saves one step's chunks. start_copy is called before any block is read (False: fenced off,
        read nothing), end_copy once none is read any more."""
        outcome = SaveOutcome()
        reserved: list[tuple[ChunkSave, Slot]] = []
        written: list[tuple[Slot, int]] = []
        try:
            reserved = self._reserve(saves)
            if reserved and not start_copy():  # fenced off (counted by the fence)
                with contextlib.suppress(SidecarError):
                    self.client.abort([slot for _, slot in reserved])
                return outcome
            try:
                written = write_all(reserved)
            finally:
                end_copy()
            committed = self.client.commit(written)
        except SidecarRefused as e:
            outcome.refused = str(e)
            committed = []
        except SidecarTimeout as e:
            outcome.timed_out = str(e)
            self.stats.add("sidecar_errors")
            committed = []
        except SidecarError as e:
            self.stats.add("sidecar_errors")
            self.warn.warning("save", "kvpool: saving %d chunks failed: %s", len(saves), e)
            committed = []
        if len(committed) < len(reserved) and outcome.timed_out is None:
            with contextlib.suppress(SidecarError):  # the reservations expire by themselves too
                self.client.abort([slot for _, slot in reserved])
        done = [slot for (slot, _), ok in zip(written, committed, strict=False) if ok]
        refused = sum(1 for ok in committed if not ok)
        if refused:
            self.stats.add("save_refused_chunks", refused)
            self.warn.warning(
                "refused", "kvpool: the sidecar refused %d commits (reservations expired)", refused
            )
        self.stats.add("saved_chunks", len(done))
        self.stats.add("saved_bytes", sum(slot.length for slot in done))
        return outcome
