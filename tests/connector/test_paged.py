"""Gather then scatter is exact for every layout, dtype and block size the connector supports."""

from __future__ import annotations

import pytest
import torch

from kvpool_connector.paged import PagedLayer

NUM_BLOCKS, HEADS, HEAD = 12, 4, 64


def _cache(layout: str, dtype: torch.dtype, bs: int) -> torch.Tensor:
    """A layer cache in vLLM's logical shape over the named physical order, random bits everywhere."""
    phys: tuple[int, ...]
    perm: tuple[int, ...]
    if layout == "LBHNC":  # CPU backend: [B, H, N, C] in memory
        phys = (NUM_BLOCKS, HEADS, bs, 2 * HEAD)
        perm = (0, 1, 2, 3)
    elif layout == "LBNHC":  # FlashAttention default: [B, N, H, C] in memory, viewed as [B, H, N, C]
        phys = (NUM_BLOCKS, bs, HEADS, 2 * HEAD)
        perm = (0, 2, 1, 3)
    elif layout == "LHBNC":  # heads outside blocks: a block is not one contiguous run
        phys = (HEADS, NUM_BLOCKS, bs, 2 * HEAD)
        perm = (1, 0, 2, 3)
    elif layout == "MLA":  # [B, N, C]
        phys = (NUM_BLOCKS, bs, 576)
        perm = (0, 1, 2)
    elif layout == "SPLIT":  # [B, 2, N, H, D]
        phys = (NUM_BLOCKS, 2, bs, HEADS, HEAD)
        perm = (0, 1, 2, 3, 4)
    n = 1
    for d in phys:
        n *= d
    raw = torch.randint(0, 256, (n * torch.finfo(dtype).bits // 8,), dtype=torch.uint8)
    return raw.view(dtype).view(phys).permute(perm)


LAYOUTS = ["LBHNC", "LBNHC", "LHBNC", "MLA", "SPLIT"]


@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_then_scatter_is_exact(layout: str, dtype: torch.dtype, bs: int) -> None:
    src = PagedLayer(_cache(layout, dtype, bs))
    assert src.dense == (layout != "LHBNC")
    ids = torch.tensor([7, 8, 9, 2, 0], dtype=torch.int64)  # a run of three, then singles
    buf = torch.empty((len(ids), src.page_bytes), dtype=torch.uint8)
    src.gather(ids, buf)

    dst_cache = torch.zeros_like(src.cache)  # zeros_like keeps the strides
    if layout != "LBHNC":
        dst_cache = _cache(layout, dtype, bs).zero_()
    dst = PagedLayer(dst_cache)
    dst.scatter(torch.tensor([1, 2, 3, 11, 5]), buf)
    for s, d in zip([7, 8, 9, 2, 0], [1, 2, 3, 11, 5], strict=True):
        # bit-exact, including NaN payloads that random bits produce
        assert torch.equal(
            dst.cache[d].contiguous().view(torch.uint8), src.cache[s].contiguous().view(torch.uint8)
        )
    untouched = [b for b in range(NUM_BLOCKS) if b not in (1, 2, 3, 11, 5)]
    assert all(not dst.cache[b].contiguous().view(torch.uint8).any() for b in untouched)


def test_kernel_blocks_grouped_into_manager_blocks() -> None:
    """A layer whose kernel blocks are half a manager block (vLLM's group_kernel_blocks view)."""
    cache = _cache("LBHNC", torch.float16, 16).unflatten(0, (NUM_BLOCKS // 2, 2))
    layer = PagedLayer(cache)
    assert layer.dense and layer.page_bytes == 2 * HEADS * 16 * 2 * HEAD * 2
    buf = torch.empty((1, layer.page_bytes), dtype=torch.uint8)
    layer.gather(torch.tensor([3]), buf)
    assert torch.equal(buf[0], cache[3].contiguous().view(torch.uint8).reshape(-1))
