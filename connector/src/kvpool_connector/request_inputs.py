"""What a request's KV depends on besides its token ids, as each chunk's extra key bytes.

vLLM's prefix cache keys a block on more than its tokens: the LoRA adapter, the multimodal items
behind placeholder tokens (and where they start), the cache salt (first block only, the chain
carries it on), and prompt embeds. kvpool asks vLLM's own `generate_block_hash_extra_keys` for a
chunk's extra keys (block by block for prompt embeds), so its keys differ exactly when vLLM's
would, in 0.32 and 0.33 alike, and encodes them canonically (never with pickle or `hash()`), so
two pods of a pool agree with no per-process setting. A LoRA adapter's weights are fingerprinted
as well as named, like the model's.

A request whose extra keys hold a value this module cannot encode is unkeyable: the scheduler then
neither loads nor saves it (counted), since a guess could hand it another request's KV.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .keys import Extras
from .model_identity import weights_fingerprint

if TYPE_CHECKING:
    from vllm.v1.request import Request


class Unkeyable(Exception):
    """The request's KV depends on an input kvpool cannot encode into a key."""


def _encode(value: Any, out: bytearray) -> None:
    # typed and length-prefixed, so no two different values share an encoding
    if value is None:
        out += b"n"
    elif isinstance(value, bool):
        out += b"T" if value else b"F"
    elif isinstance(value, int):
        text = str(value).encode()
        out += b"i" + len(text).to_bytes(2, "little") + text
    elif isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        out += b"s" + len(data).to_bytes(8, "little") + data
    elif isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        out += b"b" + len(data).to_bytes(8, "little") + data
    elif isinstance(value, tuple | list):
        out += b"t" + len(value).to_bytes(4, "little")
        for item in value:
            _encode(item, out)
    else:
        raise Unkeyable(f"a key input of type {type(value).__name__} cannot be encoded")


def encode_extra(value: Any) -> bytes:
    out = bytearray()
    _encode(value, out)
    return bytes(out)


@functools.lru_cache(maxsize=64)
def _adapter_fingerprint(path: str) -> str:
    # cached per process like vLLM's own loaded adapters: a replaced adapter needs a new engine anyway
    return weights_fingerprint(Path(path)) if Path(path).is_dir() else ""


def has_extra_inputs(request: Request) -> bool:
    """Whether anything besides the tokens enters this request's keys (the common case is no)."""
    return bool(
        getattr(request, "lora_request", None)
        or getattr(request, "mm_features", None)
        or getattr(request, "cache_salt", None)
        or getattr(request, "prompt_embeds", None) is not None
    )


def request_extras(request: Request, block_size: int) -> Extras | None:
    """The request's per-chunk extra key bytes, or None when it has no inputs besides its tokens.
    The function raises Unkeyable for an input it cannot encode.

    A request with prompt embeds is asked block by block, as vLLM's own block hasher asks: vLLM
    caches each block's embeds digest on the request, so embeddings it hashed for the prefix cache
    are not hashed again here (measured: 1.4 instead of 7.6 ms for 2,000 tokens). Other requests are
    asked once per chunk, which costs a tenth of asking per block (bench/keys_bench.py)."""
    if not has_extra_inputs(request):
        return None
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    lora = getattr(request, "lora_request", None)
    adapter = _adapter_fingerprint(str(lora.lora_path)) if lora is not None and lora.lora_path else ""
    per_block = getattr(request, "prompt_embeds", None) is not None

    def extras(start: int, end: int) -> bytes | None:
        step = block_size if per_block else end - start
        keys = tuple(
            generate_block_hash_extra_keys(request, b, min(b + step, end), 0)[0]
            for b in range(start, end, step)
        )
        if not any(keys):
            return None
        return encode_extra((keys, adapter) if adapter else keys)

    return extras
