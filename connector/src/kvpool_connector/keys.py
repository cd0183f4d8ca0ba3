"""Chunk keys: a chained cryptographic hash over token chunks inside a namespace.

Chunk i of a token sequence has key H(key[i-1] || tokens of chunk i). The chain starts from a
digest of everything that changes the stored bytes except the tensor-parallel rank (model, dtype,
layout, geometry, chunk size, TP size); each rank's key is H(chain link || rank), so the scheduler
computes the chain once and every worker derives its own keys from it without the tokens.
One module serves the scheduler, the worker and tools.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

_DIGEST = 16  # bytes; keys are 32 lowercase hex characters


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST)
    for p in parts:
        h.update(p)
    return h.digest()


@dataclass(frozen=True)
class Namespace:
    """Everything that changes a chunk's bytes. Two engines with equal namespaces share chunks."""

    model: str
    dtype: str
    layout: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    chunk_size: int
    tp_size: int = 1

    def seed(self) -> bytes:
        fields = (
            "kvpool-v1",
            self.model,
            self.dtype,
            self.layout,
            self.num_layers,
            self.num_kv_heads,
            self.head_size,
            self.block_size,
            self.chunk_size,
            self.tp_size,
        )
        return _h("\x1f".join(map(str, fields)).encode())


def _token_bytes(tokens: Sequence[int]) -> bytes:
    a = array("I", tokens)  # token ids fit in 32 bits; fixed little-endian so every host agrees
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def chain(
    seed: bytes, tokens: Sequence[int], chunk_size: int, start: bytes | None = None, first_chunk: int = 0
) -> list[bytes]:
    """The chain links of the full and trailing chunks of `tokens`, starting at chunk `first_chunk`
    whose predecessor link is `start` (the seed for chunk 0). The last link covers a partial chunk
    when len(tokens) is not a multiple of chunk_size."""
    prev = seed if start is None else start
    links: list[bytes] = []
    for i in range(first_chunk * chunk_size, len(tokens), chunk_size):
        prev = _h(prev, _token_bytes(tokens[i : i + chunk_size]))
        links.append(prev)
    return links


def rank_key(link: bytes, tp_rank: int) -> str:
    """The sidecar key of one chunk for one tensor-parallel rank (lowercase hex, 32 chars)."""
    return _h(link, b"rank", tp_rank.to_bytes(4, "little")).hex()


def chunk_keys(namespace: Namespace, tokens: Sequence[int], tp_rank: int = 0) -> list[str]:
    """Keys of every chunk of `tokens` (the last one partial if the length is not a multiple)."""
    return [rank_key(link, tp_rank) for link in chain(namespace.seed(), tokens, namespace.chunk_size)]
