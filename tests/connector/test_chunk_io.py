"""The host halves of the CUDA path, run on CPU tensors (the GPU tests run them with the device): a
chunk written out of a step's pinned buffer, and a chunk staged into a private buffer for its DMA,
carry the bytes and the checksum the CPU path gives."""

from __future__ import annotations

import pytest
import torch
from workerkit import chunk_ops, make_layers

from kvpool_connector.chunk_io import ChunkIO
from kvpool_connector.paged import PagedLayer
from kvpool_sidecar.wire import checksum


def _io(mixed_pages: bool) -> ChunkIO:
    caches = [t for _, t in make_layers(1)]
    if mixed_pages:  # a group whose layers differ in page size: copied layer by layer
        caches[1] = torch.randn(caches[1].shape[0], 2, 32, 64)
    return ChunkIO([PagedLayer(t) for t in caches])


@pytest.mark.parametrize("mixed_pages", [False, True])
def test_a_chunk_written_out_of_the_step_buffer_is_what_save_cpu_writes(mixed_pages: bool) -> None:
    io = _io(mixed_pages)
    ops = chunk_ops([[3, 7], [1, 12], [5, 6]])
    blocks = [b for op in ops for b in op.block_ids]
    total = len(blocks)
    staged = torch.empty(io.chunk_bytes(total), dtype=torch.uint8)  # as copy_out_layer fills it
    for i, layer in enumerate(io.layers):
        layer.gather(torch.tensor(blocks), io.rows(staged, total, i))
    first = 0
    for op in ops:
        want = torch.empty(io.chunk_bytes(op.chunk_blocks), dtype=torch.uint8)
        digest = io.save_cpu(want, op)
        got = torch.zeros_like(want)
        assert io.save_staged(got, staged, total, first, op.chunk_blocks, op.group) == digest
        assert torch.equal(got, want)
        first += op.chunk_blocks


def test_a_staged_chunk_is_the_arena_chunk_and_its_checksum() -> None:
    chunk = torch.randint(0, 256, (3 * 4096 + 7,), dtype=torch.uint8)
    bounce = torch.zeros_like(chunk)
    assert _io(False).stage_load(chunk, bounce) == checksum(chunk.numpy())
    assert torch.equal(bounce, chunk)
