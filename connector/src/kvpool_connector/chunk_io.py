"""Copies of one chunk between vLLM's paged KV buffer and flat chunk bytes, with the checksum of the
bytes that matter: what was loaded into the blocks, what was read out of them.

A chunk holds one KV cache group's layers (a hybrid model's groups are stored apart): its bytes are,
for each of those layers in order, its blocks' pages one after another. The checksum is
never computed over the shared arena alone, which a stale writer may change under us: a load hashes
the blocks it wrote (and the arena rows it skipped, which nothing uses), a save hashes its source
blocks. On CUDA the device's bytes cannot be hashed where they are, so they pass through a private
pinned buffer that is hashed instead (the only copy of them that nobody else can write).
"""

from __future__ import annotations

import torch
import xxhash

from .common import ChunkOp
from .paged import PagedLayer, host_bytes


class ChunkIO:
    def __init__(self, layers: list[PagedLayer], groups: list[list[int]] | None = None) -> None:
        """`groups`: the indices in `layers` of each KV cache group's layers (default: one group)."""
        self.layers = layers
        self.groups = groups if groups is not None else [list(range(len(layers)))]
        self.group_of = {i: g for g, members in enumerate(self.groups) for i in members}
        self._starts: dict[int, int] = {}  # per layer: its first byte in a one-block chunk of its group
        self._block_bytes: list[int] = []  # per group: one block of each of its layers
        for members in self.groups:
            start = 0
            for i in members:
                self._starts[i] = start
                start += layers[i].page_bytes
            self._block_bytes.append(start)
        self.cuda = bool(layers) and layers[0].device.type == "cuda"

    def block_bytes(self, group: int = 0) -> int:
        return self._block_bytes[group] if group < len(self._block_bytes) else 0

    @property
    def max_block_bytes(self) -> int:
        return max(self._block_bytes, default=0)

    def chunk_bytes(self, num_blocks: int, group: int = 0) -> int:
        return num_blocks * self.block_bytes(group)

    def rows(self, chunk: torch.Tensor, num_blocks: int, layer: int) -> torch.Tensor:
        """The rows [num_blocks, page_bytes] of one layer in a chunk's flat bytes."""
        page = self.layers[layer].page_bytes
        start = num_blocks * self._starts[layer]
        return chunk[start : start + num_blocks * page].view(num_blocks, page)

    def ids(self, op: ChunkOp) -> torch.Tensor:
        return torch.tensor(op.block_ids, dtype=torch.int64, device=self.layers[0].device)

    # --- CPU: straight between the arena and the blocks -------------------------------------------

    def load_cpu(self, chunk: torch.Tensor, op: ChunkOp) -> int:
        """Copies `op`'s blocks from a chunk into the paged buffer; returns the checksum of the chunk as
        loaded: the blocks as written, the rows not loaded as they are in `chunk`."""
        h = xxhash.xxh3_64()
        ids = self.ids(op)
        lo, hi = op.first_block, op.first_block + len(op.block_ids)
        for i in self.groups[op.group]:
            layer, rows = self.layers[i], self.rows(chunk, op.chunk_blocks, i)
            layer.scatter(ids, rows[lo:hi])
            h.update(host_bytes(rows[:lo]))
            for buf in layer.block_buffers(op.block_ids):
                h.update(buf)
            h.update(host_bytes(rows[hi:]))
        return h.intdigest()

    def save_cpu(self, chunk: torch.Tensor, op: ChunkOp) -> int:
        """Copies `op`'s blocks into a chunk; returns the checksum of the source blocks."""
        h = xxhash.xxh3_64()
        ids = self.ids(op)
        for i in self.groups[op.group]:
            layer = self.layers[i]
            layer.gather(ids, self.rows(chunk, op.chunk_blocks, i))
            for buf in layer.block_buffers(op.block_ids):
                h.update(buf)
        return h.intdigest()

    # --- CUDA: through a private pinned buffer, on a side stream ----------------------------------

    def bounce(self, num_blocks: int, group: int = 0) -> torch.Tensor:
        """A private pinned host buffer for one chunk (PyTorch's pinned allocator caches them)."""
        return torch.empty(self.chunk_bytes(num_blocks, group), dtype=torch.uint8, pin_memory=True)

    def load_cuda(self, bounce: torch.Tensor, op: ChunkOp, stream: torch.cuda.Stream) -> None:
        """Queues the copy of `op`'s blocks from a verified bounce buffer to the device, on `stream`."""
        ids = self.ids(op)
        lo, hi = op.first_block, op.first_block + len(op.block_ids)
        with torch.cuda.stream(stream):
            for i in self.groups[op.group]:
                layer, rows = self.layers[i], self.rows(bounce, op.chunk_blocks, i)[lo:hi]
                layer.scatter(ids, rows.to(layer.device, non_blocking=True))

    def save_layer_cuda(
        self, bounce: torch.Tensor, op: ChunkOp, layer: int, stream: torch.cuda.Stream
    ) -> None:
        """Queues one layer of `op`'s blocks to the bounce buffer, on `stream` behind the forward."""
        lay = self.layers[layer]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            staging = torch.empty((len(op.block_ids), lay.page_bytes), dtype=torch.uint8, device=lay.device)
            lay.gather(self.ids(op), staging)
            self.rows(bounce, op.chunk_blocks, layer).copy_(staging, non_blocking=True)
