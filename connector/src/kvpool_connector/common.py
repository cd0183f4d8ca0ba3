"""The plan the scheduler half hands the worker half each step (small, picklable). Plain Python: the
worker's copy path (worker, loader, saver, chunk_io) imports no vLLM, so it runs and is tested where
vLLM is not installed (a GPU machine with torch alone); vllm_types.py wraps these in vLLM's types."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ChunkOp:
    """One stored chunk of one KV cache group: its link (the worker derives its rank's key), how many
    blocks the chunk holds, and the blocks of the paged buffer to copy (a load may take only some)."""

    link: bytes
    chunk_blocks: int
    block_ids: list[int]
    first_block: int = 0  # index in the chunk of block_ids[0]
    group: int = 0  # the KV cache group whose layers and blocks these are (hybrid models have several)
    # saves: the links of the chunk's block prefixes (its first 1, 2, ... blocks), under which the
    # sidecar finds it for a prompt that shares only those blocks
    prefixes: list[bytes] = field(default_factory=list)


@dataclass
class LoadSpec:
    req_id: str
    chunks: list[ChunkOp]
    # loaded before this step's forward, in which the request computes (vLLM's synchronous load);
    # False: beside the steps, the request waiting until the worker reports it finished
    in_step: bool = False


@dataclass
class SaveSpec:
    req_id: str
    priority: int
    chunks: list[ChunkOp]


@dataclass
class StepPlan:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    idle: bool = False  # no token is computed in this step: the worker may wait for its loads
    step: int = 0  # the scheduler's step: names this step's saves
    # this step writes blocks that saves of steps <= fence may not have read yet: before it runs,
    # the worker makes sure none of them reads a block any more (saver.py); 0: none
    fence: int = 0
