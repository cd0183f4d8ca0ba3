"""Gather and scatter of whole KV blocks between vLLM's paged buffer and flat chunk bytes.

A layer's cache is a tensor whose first dimension is the block: vLLM's logical
[blocks, kv_heads, block_size, head_size_k + head_size_v] view over the LBNHC or LBHNC physical
orders, the split [blocks, 2, block_size, kv_heads, head_size] view, or MLA's [blocks, block_size, C].
When a block's bytes form one contiguous run (every layout with the block outside the in-block
dimensions), a block is copied as raw bytes in its physical order: one row copy per block, any dtype.
Otherwise (e.g. LHBNC, heads outside blocks) blocks are copied in logical order. On the CPU a dense
layer's gather is one index_select (a memcpy a block, in one call that lets go of the GIL) and its
scatter one memcpy per run of consecutive blocks; on CUDA one indexing kernel moves all of a layer's
blocks, over 8-byte words where the rows allow (one launch, not one per block: measured, #26).
The chunk namespace names the layout, so the two formats never meet.
"""

from __future__ import annotations

import torch


def _block_is_dense(t: torch.Tensor) -> bool:
    """True when each block's elements fill one contiguous run of memory."""
    dims = sorted(((t.stride(d), t.shape[d]) for d in range(1, t.dim()) if t.shape[d] != 1), reverse=True)
    expected = 1
    for stride, size in reversed(dims):
        if stride != expected:
            return False
        expected *= size
    return True


def _runs(block_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(position, first block, count) for each run of consecutive block ids: one memcpy per run.
    (uint8 index_copy_ copies byte by byte, ten times slower than copy_ on this CPU; index_select,
    the gather, copies whole rows.)"""
    ids = block_ids.tolist()
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            pos, first, n = runs[-1]
            runs[-1] = (pos, first, n + 1)
        else:
            runs.append((i, b, 1))
    return runs


class PagedLayer:
    """One layer's paged KV cache, seen as rows of block bytes."""

    def __init__(self, cache: torch.Tensor):
        self.cache = cache
        self.num_blocks = cache.shape[0]
        self.page_bytes = cache[0].numel() * cache.element_size()
        self.dense = _block_is_dense(cache)
        if self.dense:
            self.pages = _rows(cache, torch.uint8)  # (num_blocks, page_bytes) over the same storage
            # CPU: the same pages as one array, whose rows the save's hash reads (block_buffers)
            self._page_rows = self.pages.numpy() if cache.device.type == "cpu" else None
            # the rows the gather and CUDA's scatter index: as int64 words on CUDA where they align
            # (fewer, wider elements for its kernels), else as the bytes
            self.words = self.pages
            elem = cache.element_size()
            offset, stride = cache.storage_offset() * elem, cache.stride(0) * elem
            if cache.is_cuda and self.page_bytes % 8 == offset % 8 == stride % 8 == 0:
                self.words = _rows(cache, torch.int64)

    @property
    def device(self) -> torch.device:
        return self.cache.device

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copies blocks `block_ids` into `out`, a contiguous uint8 tensor [len(block_ids), page_bytes]
        on the cache's device."""
        if self.dense:
            torch.index_select(self.words, 0, block_ids, out=out.view(self.words.dtype))
        else:
            out.copy_(self.cache.index_select(0, block_ids).view(torch.uint8).reshape(out.shape))

    def scatter(self, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        """Writes `src` (uint8 [len(block_ids), page_bytes], on the cache's device) into `block_ids`."""
        if self.dense and self.cache.is_cuda:
            self.words.index_copy_(0, block_ids, src.view(self.words.dtype))
        elif self.dense:
            for i, b, n in _runs(block_ids):
                self.pages[b : b + n].copy_(src[i : i + n])
        else:
            n = block_ids.numel()
            values = src.reshape(-1).view(self.cache.dtype).view(n, *self.cache.shape[1:])
            self.cache.index_copy_(0, block_ids, values)

    def block_buffers(self, block_ids: list[int]) -> list[memoryview]:
        """The bytes of blocks `block_ids` in the order gather() writes them, as buffers to hash
        (CPU only): the pages themselves when dense, else one copy in logical order. A page is a row
        of one buffer over the pages, made once: a tensor index per block held the GIL, beside the
        forward, four times as long."""
        if self.dense:
            assert self._page_rows is not None, "block_buffers is for CPU caches"
            return [memoryview(self._page_rows[b]) for b in block_ids]
        ids = torch.tensor(block_ids, dtype=torch.int64)
        return [host_bytes(self.cache.index_select(0, ids).contiguous().view(torch.uint8).reshape(-1))]


def _rows(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A dense layer's blocks as rows of `dtype`: (num_blocks, page_bytes / itemsize), same storage."""
    elem, size = cache.element_size(), torch.empty(0, dtype=dtype).element_size()
    return torch.empty(0, dtype=dtype, device=cache.device).set_(
        cache.untyped_storage(),
        cache.storage_offset() * elem // size,
        (cache.shape[0], cache[0].numel() * elem // size),
        (cache.stride(0) * elem // size, 1),
    )


def host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.numpy())  # type: ignore[arg-type]  # an ndarray is a buffer; numpy's stubs disagree
