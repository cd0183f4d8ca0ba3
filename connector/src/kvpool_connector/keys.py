"""Chunk keys: a chained cryptographic hash over token chunks inside a namespace.

Chunk i of a token sequence has key H(key[i-1] || tokens of chunk i). The chain starts from a
digest of everything that changes the stored bytes except the worker's rank (model identity, dtype,
layout, geometry, chunk size, parallel sizes); each rank's key is H(chain link || rank), so the
scheduler computes the chain once and every worker derives its own keys from it without the tokens.
What else a request's KV depends on (a LoRA adapter, multimodal inputs, a cache salt, prompt
embeds: see request_inputs.py) enters as a chunk's extra bytes, folded into the link before the
chunk's tokens under a separate hash personalization, so a request without any keeps plain keys.
One module serves the scheduler, the worker and tools.
"""

from __future__ import annotations

import hashlib
import secrets
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

_DIGEST = 16  # bytes; keys are 32 lowercase hex characters


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST)
    for p in parts:
        h.update(p)
    return h.digest()


def _fold_extra(prev: bytes, extra: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST, person=b"kvpool-extra")
    h.update(prev)
    h.update(extra)
    return h.digest()


# (chunk start, chunk end) in tokens -> the chunk's extra key bytes, or None when it has none
Extras = Callable[[int, int], bytes | None]


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
    pp_size: int = 1
    dcp_size: int = 1
    pcp_size: int = 1
    kv_cache_dtype: str = "auto"
    quantization: str = ""
    weights: str = ""  # the model's identity beyond its path: see model_identity.py
    overrides: str = ""  # the config overrides the engine applied (hf_overrides), canonical JSON
    # every TP rank holds the same KV (MLA's latent KV): one copy per pipeline stage is stored and
    # every TP rank loads it (keys of rank 0 where each rank used to have its own)
    tp_replicated: bool = False

    @property
    def ranks(self) -> int:
        """The ranks that store their own copy of each chunk: a hit means every one of them has it."""
        return self.pp_size * (1 if self.tp_replicated else self.tp_size)

    def seed(self) -> bytes:
        fields = (
            "kvpool-v2",
            self.model,
            self.dtype,
            self.layout,
            self.num_layers,
            self.num_kv_heads,
            self.head_size,
            self.block_size,
            self.chunk_size,
            self.tp_size,
            self.pp_size,
            self.dcp_size,
            self.pcp_size,
            self.kv_cache_dtype,
            self.quantization,
            self.weights,
            self.overrides,
            *(("tp-replicated",) if self.tp_replicated else ()),  # the keys of other models unchanged
        )
        return _h("\x1f".join(map(str, fields)).encode())


def new_generation(seed: bytes) -> bytes:
    """A seed no key made before can come from: after vLLM resets its caches (new weights loaded in
    place), chunks saved before must never be found again. Random, so no two resets share keys."""
    return _h(seed, b"generation", secrets.token_bytes(16))


def _token_bytes(tokens: Sequence[int]) -> bytes:
    a = array("I", tokens)  # token ids fit in 32 bits; fixed little-endian so every host agrees
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def chain(
    seed: bytes,
    tokens: Sequence[int],
    chunk_size: int,
    start: bytes | None = None,
    first_chunk: int = 0,
    extras: Extras | None = None,
) -> list[bytes]:
    """The chain links of the full and trailing chunks of `tokens`, starting at chunk `first_chunk`
    whose predecessor link is `start` (the seed for chunk 0). The last link covers a partial chunk
    when len(tokens) is not a multiple of chunk_size. `extras` gives each chunk's extra key bytes."""
    prev = seed if start is None else start
    links: list[bytes] = []
    for i in range(first_chunk * chunk_size, len(tokens), chunk_size):
        end = min(i + chunk_size, len(tokens))
        prev = chunk_link(prev, tokens[i:end], extras(i, end) if extras is not None else None)
        links.append(prev)
    return links


def chunk_link(prev: bytes, chunk_tokens: Sequence[int], extra: bytes | None = None) -> bytes:
    """The link of one (full or partial) chunk whose predecessor link is `prev`: `chain`'s step, for
    the scheduler's partial tails, which would otherwise copy every token before them to hash them."""
    if extra:
        prev = _fold_extra(prev, extra)
    return _h(prev, _token_bytes(chunk_tokens))


def tail_links(prev: bytes, tokens: Sequence[int], ends: Sequence[int]) -> list[bytes]:
    """chunk_link(prev, tokens[:end]) for each of `ends`, hashing the tokens once: the shorter tails a
    missed chunk's lookup asks for all start where it does (blocks of 16 give a 256-token chunk 15),
    and hashing each from its start cost the engine core O(chunk^2 / block) a new request."""
    h = hashlib.blake2b(digest_size=_DIGEST)
    h.update(prev)
    links: dict[int, bytes] = {}
    hashed = 0
    for end in sorted(set(ends)):
        h.update(_token_bytes(tokens[hashed:end]))
        hashed = end
        links[end] = h.copy().digest()
    return [links[end] for end in ends]


def group_link(link: bytes, group: int) -> bytes:
    """The link of one KV cache group's part of a chunk (a hybrid model stores each group apart: a
    sliding-window group's blocks leave the window while the full-attention group's stay). Group 0
    is the chunk's own link, so a one-group model's keys do not depend on grouping."""
    return link if group == 0 else _h(link, b"group", group.to_bytes(4, "little"))


def rank_key(link: bytes, rank: int) -> str:
    """The sidecar key of one chunk for one worker (lowercase hex, 32 chars). `rank` numbers the
    workers of one engine: pipeline stage * TP size + tensor-parallel rank."""
    return _h(link, b"rank", rank.to_bytes(4, "little")).hex()


def chunk_keys(
    namespace: Namespace, tokens: Sequence[int], rank: int = 0, extras: Extras | None = None
) -> list[str]:
    """Keys of every chunk of `tokens` (the last one partial if the length is not a multiple)."""
    links = chain(namespace.seed(), tokens, namespace.chunk_size, extras=extras)
    return [rank_key(link, rank) for link in links]
