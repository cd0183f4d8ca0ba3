"""Chunk-key figures: the cost of kvpool's keys for one request, as a ratio to vLLM's own prefix-cache
block hashing of the same request (sha256, vLLM's default), timed alternately in the same run.

A 2,000-token prompt (vLLM blocks of 16 tokens, kvpool chunks of 256): tokens only; with a cache salt
and a LoRA adapter; with an image behind 576 placeholder tokens; with prompt embeds (2,000 x 1,024
float32). Each repetition builds a fresh vLLM Request, hashes it as vLLM's engine does when the
request arrives, then computes kvpool's keys of the same request (as the connector's scheduler half
does next): so the kvpool column is what kvpool adds.
Run: `.venv/bin/python -m bench keys`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bench.stats import Spread

TOKENS = 2000
BLOCK = 16
CHUNK = 256
REPEAT = 41


def _request(**inputs: Any) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=1)
    tokens = None if "prompt_embeds" in inputs else [(i * 7919) % 30000 + 4 for i in range(TOKENS)]
    return Request("r", tokens, params, None, **inputs)


def _cases() -> dict[str, Callable[[], dict[str, Any]]]:
    import torch
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    embeds = torch.randn(TOKENS, 1024, generator=torch.Generator().manual_seed(0))
    image = MultiModalFeatureSpec(None, "image", "a" * 64, PlaceholderRange(offset=100, length=576))
    return {
        "tokens only": dict,
        "cache salt + LoRA": lambda: {"cache_salt": "tenant", "lora_request": LoRARequest("ad", 1, "/none")},
        "one image (576 placeholders)": lambda: {"mm_features": [image]},
        "prompt embeds": lambda: {"prompt_embeds": embeds},
    }


def main() -> None:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    from kvpool_connector.keys import Namespace, chain
    from kvpool_connector.request_inputs import request_extras

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    seed = Namespace("m", "float16", "x", 32, 8, 128, BLOCK, CHUNK).seed()
    print(
        f"keys of one {TOKENS}-token request (chunks of {CHUNK}), ÷ vLLM's own block hashes (sha256, {BLOCK})"
    )
    print("| case | kvpool keys | vLLM block hashes | ÷ vLLM |\n| --- | --- | --- | --- |")
    for name, inputs in _cases().items():
        ours, theirs, ratios = [], [], []
        for i in range(REPEAT + 1):
            req = _request(**inputs())
            t = time.perf_counter()
            hasher(req)
            base = time.perf_counter() - t
            t = time.perf_counter()  # on the request vLLM just hashed, as in the engine
            chain(seed, req.all_token_ids, CHUNK, extras=request_extras(req, BLOCK))
            mine = time.perf_counter() - t
            if i:
                ours.append(mine * 1e3)
                theirs.append(base * 1e3)
                ratios.append(mine / base)
        o, b, r = Spread.of(ours), Spread.of(theirs), Spread.of(ratios)
        print(
            f"| {name} | {o.median:.3f} ms [{o.low:.3f}-{o.high:.3f}] | {b.median:.3f} ms "
            f"[{b.low:.3f}-{b.high:.3f}] | **{r.median:.3f}** [{r.low:.3f}-{r.high:.3f}] |"
        )
