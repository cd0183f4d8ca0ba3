"""The worker tests' support (CPU and CUDA): paged caches, chunk ops, and loads run as vLLM runs them."""

from __future__ import annotations

import mmap

import torch
from kvtest import wait_until

from kvpool_connector.common import ChunkOp, StepPlan
from kvpool_connector.keys import chain
from kvpool_connector.worker import KVPoolWorker

BLOCKS, HEADS, BS, HEAD = 16, 2, 32, 64
Layers = list[tuple[str, torch.Tensor]]
HUGE_PAGE = 2 << 20


def in_anonymous_memory(t: torch.Tensor, huge: bool) -> torch.Tensor:
    """A copy of `t` in private anonymous memory of its own, 2 MiB-aligned, with transparent huge
    pages asked for (as torch puts vLLM's cache under THP_MEM_ALLOC_ENABLE, or any memory where the
    node's THP mode is "always") or refused. The node's THP mode must be "madvise" or "always"."""
    size = -(-t.nbytes // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping
    at = -whole.data_ptr() % HUGE_PAGE
    mapping.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE, at, size)
    return whole[at : at + t.nbytes].view(t.dtype).view(t.shape).copy_(t)


def make_layers(seed: int | None, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Layers:
    """Three layers of random KV (zeros when seed is None)."""
    g = torch.Generator().manual_seed(seed or 0)
    out = []
    for i in range(3):
        t = torch.randn(BLOCKS, HEADS, BS, 2 * HEAD, generator=g, dtype=dtype)
        out.append((f"layer{i}", (t if seed is not None else torch.zeros_like(t)).to(device)))
    return out


def chunk_ops(blocks: list[list[int]]) -> list[ChunkOp]:
    """One two-block chunk per entry, chained as the scheduler chains them."""
    links = chain(b"seed" * 4, list(range(64 * len(blocks))), 64)
    return [ChunkOp(link, 2, ids) for link, ids in zip(links, blocks, strict=True)]


def save(worker: KVPoolWorker, meta: StepPlan, timeout: float = 30) -> None:
    """Ends a step as vLLM does (its saves go to the save thread), then waits for them to finish."""
    worker.finish_step(meta)
    assert worker.saver.drain(timeout), "the step's saves did not finish"


def run_loads(worker: KVPoolWorker, meta: StepPlan, timeout: float = 30) -> set[int]:
    """Runs the step's loads as vLLM does (asynchronously): start them, then collect get_finished()
    step after step until every request is reported; returns the blocks that failed."""
    worker.start_load(meta)
    want, done, failed = {spec.req_id for spec in meta.loads}, set(), set()

    def finished() -> bool:
        done.update(worker.get_finished())
        failed.update(worker.take_load_errors())  # asked in the same step, as vLLM does
        return done >= want

    wait_until(finished, timeout, f"the loads of {sorted(want)} to finish")
    return failed
