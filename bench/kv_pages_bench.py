"""What the KV cache's pages cost vLLM's CPU attention (#24): transparent huge pages, 4 KiB pages, and
4 KiB pages on the memfd kvpool moved a CPU engine's cache onto for its save process (shared_kv.py).

`bench processes` runs every server on huge pages (THP_MEM_ALLOC_ENABLE), as a node whose THP mode
is "always" does; a memfd's pages are 4 KiB wherever shmem_enabled is "never". Here vLLM's own CPU
attention kernel (cpu_attention_with_kv_cache) runs over `bench processes`' KV cache (its model's 8
layers, 48 blocks of 64 tokens, 4 KV heads of 64, float32: 48 MiB) in four copies with the same bytes:
- huge pages: anonymous memory with MADV_HUGEPAGE, and a second copy (the A/A control);
- 4 KiB pages: anonymous memory with MADV_NOHUGEPAGE;
- memfd: 4 KiB anonymous memory moved onto a memfd by shared_kv.share, as kvpool did before 29d207e.
A step is the 8 layers' attention of a decode of 8 sequences of 360 tokens (`bench processes` at
concurrency 8), or of a prefill of 2 x 352 tokens, on one thread pinned to core 0; the copies take
turns, in a fresh order each round. Per copy: the median over rounds of its step over the first
huge-page copy's, with a 95% bootstrap interval.
Run: `.venv/bin/python -m bench kv_pages` (about a minute).
"""

from __future__ import annotations

import mmap
import os
import random
import statistics
import time
from collections.abc import Callable

import torch

from bench.stats import bootstrap, load_note
from kvpool_connector.shared_kv import on_huge_pages, share
from kvpool_demo.tinymodel import BENCH

BLOCK, BLOCKS = 64, 48  # bench load's ENGINE_BLOCKS of bench workloads' BLOCK
HEAD = BENCH.hidden // BENCH.heads
HUGE = 2 << 20
ROUNDS = {"decode 8 x 360": 400, "prefill 2 x 352": 60}


def layer_cache(advice: int, fill: torch.Tensor) -> torch.Tensor:
    """A layer's KV cache (vLLM CPU's [blocks, KV heads, block, K and V]) in anonymous memory of its
    own, 2 MiB-aligned, with the given madvise advice, holding `fill`'s bytes."""
    size = fill.nbytes
    mapping = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping
    at = -whole.data_ptr() % HUGE
    mapping.madvise(advice, at, -(-size // HUGE) * HUGE)
    cache = whole[at : at + size].view(fill.dtype).view(fill.shape)
    cache.copy_(fill)
    return cache


def caches() -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    fills = [torch.randn(BLOCKS, BENCH.kv_heads, BLOCK, 2 * HEAD, generator=g) for _ in range(BENCH.layers)]
    out = {
        "huge pages": [layer_cache(mmap.MADV_HUGEPAGE, f) for f in fills],
        "huge pages again": [layer_cache(mmap.MADV_HUGEPAGE, f) for f in fills],
        "4 KiB pages": [layer_cache(mmap.MADV_NOHUGEPAGE, f) for f in fills],
        "memfd (4 KiB)": [layer_cache(mmap.MADV_NOHUGEPAGE, f) for f in fills],
    }
    for c in out["memfd (4 KiB)"]:
        region = share(c.data_ptr(), c.nbytes)
        assert region is not None, "a 4 KiB-page cache is moved"
        os.close(region.fd)
    for name, layers in out.items():
        huge = all(on_huge_pages(c.data_ptr(), c.nbytes) for c in layers)
        assert huge == name.startswith("huge"), f"{name}: huge pages {'' if huge else 'not '}given"
    return out


def attention(seq_lens: list[int], query_lens: list[int]) -> Callable[[list[torch.Tensor]], None]:
    """One step's attention over a copy's layers, as vLLM's CPU backend calls it."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(torch.float32, BLOCK, HEAD)
    per_seq = -(-max(seq_lens) // BLOCK)
    ids = random.Random(0).sample(range(BLOCKS), per_seq * len(seq_lens))  # scattered, as after a while
    table = torch.tensor(ids, dtype=torch.int32).view(len(seq_lens), per_seq)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens),
        num_heads=BENCH.heads,
        num_kv_heads=BENCH.kv_heads,
        head_dim=HEAD,
        seq_lens=lens,
        dtype=torch.float32,
        query_start_loc=starts,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
    )
    query = torch.randn(sum(query_lens), BENCH.heads, HEAD)
    out = torch.empty_like(query)

    def step(layers: list[torch.Tensor]) -> None:
        for cache in layers:
            key, value = cache.view(BLOCKS, BENCH.kv_heads, 2 * BLOCK, HEAD).chunk(2, dim=2)
            ops.cpu_attention_with_kv_cache(
                query=query,
                key_cache=key,
                value_cache=value,
                output=out,
                query_start_loc=starts,
                seq_lens=lens,
                scale=HEAD**-0.5,
                causal=True,
                alibi_slopes=None,
                sliding_window=-1,
                block_table=table,
                softcap=0.0,
                scheduler_metadata=meta,
                s_aux=None,
            )

    return step


def main() -> None:
    print(load_note())
    threads, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    torch.set_num_threads(1)  # one compute thread on one core, as the bench's engines
    os.sched_setaffinity(0, {0})
    try:
        copies = caches()
        steps = {
            "decode 8 x 360": attention([360] * 8, [1] * 8),
            "prefill 2 x 352": attention([352] * 2, [352] * 2),
        }
        print("| step | copy | ms a step (8 layers) | over huge pages: median of rounds (95% interval) |")
        print("| --- | --- | --- | --- |")
        for what, step in steps.items():
            times: dict[str, list[float]] = {name: [] for name in copies}
            names = list(copies)
            for rnd in range(ROUNDS[what]):
                random.Random(rnd).shuffle(names)
                for name in names:
                    t0 = time.perf_counter()
                    step(copies[name])
                    times[name].append(time.perf_counter() - t0)
            base = times["huge pages"]
            for name, ts in times.items():
                if name == "huge pages":
                    print(f"| {what} | {name} | {statistics.median(ts) * 1e3:.3f} | 1 |")
                    continue
                ratios = [t / b for t, b in zip(ts, base, strict=True)]
                low, high = bootstrap(ratios, statistics.median)
                print(
                    f"| {what} | {name} | {statistics.median(ts) * 1e3:.3f} | "
                    f"{statistics.median(ratios):.4f} ({low:.4f}-{high:.4f}) |"
                )
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, affinity)
