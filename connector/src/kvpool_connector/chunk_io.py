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

from kvpool_sidecar.wire import checksum, checksum_pieces

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
        # per group: its layers' one page size (a KV cache group has one spec), or None where they differ
        self._page: list[int | None] = []
        for members in self.groups:
            pages = {layers[i].page_bytes for i in members}
            self._page.append(pages.pop() if len(pages) == 1 else None)
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

    # --- CUDA: through private pinned buffers, on a side stream ------------------------------------

    def bounce(self, num_blocks: int, group: int = 0) -> torch.Tensor:
        """A private pinned host buffer for `num_blocks` blocks of a group's layers (PyTorch's pinned
        allocator caches them, and reuses one only after the copies queued on it have run)."""
        return torch.empty(self.chunk_bytes(num_blocks, group), dtype=torch.uint8, pin_memory=True)

    def device_ids(self, block_ids: list[int], stream: torch.cuda.Stream) -> torch.Tensor:
        """Block ids on the device, copied on `stream` from pinned memory: a pageable copy would wait
        for the stream (and, on the loader's thread, for the default stream)."""
        with torch.cuda.stream(stream):
            pinned = torch.tensor(block_ids, dtype=torch.int64).pin_memory()
            return pinned.to(self.layers[0].device, non_blocking=True)

    def copy_out_layer(
        self, staged: torch.Tensor, total: int, ids: torch.Tensor, layer: int, stream: torch.cuda.Stream
    ) -> None:
        """Queues one layer of a step's saves (`total` blocks `ids`, chunk after chunk) into the rows
        rows(staged, total, layer) of their pinned buffer, on `stream` behind the forward's writes: one
        gather and one DMA a layer, whatever the number of chunks."""
        lay = self.layers[layer]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            rows = torch.empty((total, lay.page_bytes), dtype=torch.uint8, device=lay.device)
            lay.gather(ids, rows)
            self.rows(staged, total, layer).copy_(rows, non_blocking=True)

    def save_staged(
        self, chunk: torch.Tensor, staged: torch.Tensor, total: int, first: int, num_blocks: int, group: int
    ) -> int:
        """Writes the chunk whose blocks are rows first.. of a step's pinned buffer into `chunk`; returns
        the checksum of those private rows. Where the group's layers have one page size (a KV cache
        group has one spec), one strided copy takes all its layers: each torch or xxhash call lets
        the other copy threads take the GIL, and on the H100 host a copy and a hash per layer made
        the path slower with every copy thread added (#26)."""
        members, page = self.groups[group], self._page[group]
        if page is not None:  # the group's layers are rows [layer, total, page] in `staged`
            rows = staged[: len(members) * total * page].view(len(members), total, page)
            mine = rows[:, first : first + num_blocks]
            chunk.view(len(members), num_blocks, page).copy_(mine)
            return checksum_pieces(host_bytes(piece) for piece in mine)
        h = xxhash.xxh3_64()
        for i in members:
            piece = self.rows(staged, total, i)[first : first + num_blocks]
            self.rows(chunk, num_blocks, i).copy_(piece)
            h.update(host_bytes(piece))
        return h.intdigest()

    def stage_load(self, chunk: torch.Tensor, bounce: torch.Tensor) -> int:
        """Copies a chunk from the arena into a private pinned buffer of its size; returns the checksum
        of the copy: the bytes the device will get, which no one else can change after the check.
        One copy and one hash, not one per layer (see save_staged)."""
        bounce.copy_(chunk)
        return checksum(host_bytes(bounce))

    def load_cuda(self, bounce: torch.Tensor, op: ChunkOp, stream: torch.cuda.Stream) -> None:
        """Queues on `stream` one DMA of a verified chunk to the device and the scatter of op's rows
        into its blocks (one kernel a layer); the caller synchronizes once the request's are queued."""
        lo, hi = op.first_block, op.first_block + len(op.block_ids)
        ids = self.device_ids(op.block_ids, stream)
        with torch.cuda.stream(stream):
            staged = bounce.to(self.layers[0].device, non_blocking=True)
            for i in self.groups[op.group]:
                self.layers[i].scatter(ids, self.rows(staged, op.chunk_blocks, i)[lo:hi])
