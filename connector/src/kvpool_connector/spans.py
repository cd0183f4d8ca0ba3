"""Which token ranges of a request are stored as chunks. The scheduler uses the same function for
lookups and for saves, so a lookup asks for exactly the chunks a save would have written."""

from __future__ import annotations

from .config import KVPoolConfig

Span = tuple[int, int]  # [start, end) in tokens; start is a multiple of chunk_size, end of block_size


def align_down(n: int, multiple: int) -> int:
    return n - n % multiple


def prompt_spans(num_prompt_tokens: int, cfg: KVPoolConfig, block_size: int) -> list[Span]:
    """Full chunks of the savable prompt, then its block-aligned tail unless partial chunks are discarded."""
    end = max(0, num_prompt_tokens - cfg.skip_last_n_tokens)
    cs = cfg.chunk_size
    spans = [(s, s + cs) for s in range(0, align_down(end, cs), cs)]
    tail_start = align_down(end, cs)
    tail_end = align_down(end, block_size)
    if tail_end > tail_start and not cfg.discard_partial_chunks:
        spans.append((tail_start, tail_end))
    return spans


def decode_spans(num_tokens: int, num_prompt_tokens: int, cfg: KVPoolConfig) -> list[Span]:
    """Full chunks that lie beyond the prompt's full chunks (saved only with save_decode_cache)."""
    cs = cfg.chunk_size
    first = align_down(max(0, num_prompt_tokens - cfg.skip_last_n_tokens), cs)
    end = align_down(max(0, num_tokens - cfg.skip_last_n_tokens), cs)
    return [(s, s + cs) for s in range(first, end, cs)]
