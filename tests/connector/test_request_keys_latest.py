"""Chunk keys cover everything vLLM's own prefix cache keys on: cache salt, LoRA adapter, multimodal
items, prompt embeds. In the real vllm==0.33.0 Scheduler with prefix caching on and a real sidecar:
inputs that differ never share a chunk, equal inputs still hit (also from a fresh scheduler), and the
keys do not depend on the process (no PYTHONHASHSEED needed for two pods to agree)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvpool_sidecar.client import SidecarClient

pytestmark = pytest.mark.vllm_latest

vllm = pytest.importorskip("vllm")
import torch  # noqa: E402
from schedkit import (  # noqa: E402
    assert_empty,
    loads_of,
    make_request,
    make_scheduler,
    model_output,
    prompt,
    run_to_end,
    save_like_a_worker,
    saves_of,
)
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402

TOKENS = prompt(96, 21)  # three chunks of 32


def image(identifier: Any, offset: int = 40, length: int = 16) -> list[MultiModalFeatureSpec]:
    return [MultiModalFeatureSpec(None, "image", identifier, PlaceholderRange(offset=offset, length=length))]


def adapter(path: Path, seed: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["q_proj"]}))
    (path / "adapter_model.safetensors").write_bytes(bytes((seed * 31 + i) % 256 for i in range(4096)))
    return path


def first_step(scheduler, request) -> tuple[int, list]:
    """(tokens already computed when the request is first scheduled, after its asynchronous load if
    it has one; the loads planned for it)."""
    scheduler.add_request(request)
    loads = []
    for _ in range(3):  # a load step, then the first compute step
        so = scheduler.schedule()
        scheduler.update_from_output(so, model_output(scheduler, so))
        loads += [ld for ld in so.kv_connector_metadata.loads if ld.req_id == request.request_id]
        new = [r for r in so.scheduled_new_reqs if r.req_id == request.request_id]
        if new:
            return new[0].num_computed_tokens, loads
    raise AssertionError(f"{request.request_id} was never scheduled")


def saved_by(scheduler, sidecar_client: SidecarClient, **inputs: Any) -> list[str]:
    """Runs one request with `inputs` to the end and stores what it saved, as its worker would."""
    scheduler.add_request(make_request(TOKENS, **inputs))
    keys = save_like_a_worker(sidecar_client, run_to_end(scheduler))
    assert len(keys) == 3
    return keys


def finish(scheduler) -> None:
    run_to_end(scheduler)
    assert_empty(scheduler)


def test_cache_salts_never_share_and_each_tenant_still_hits_its_own(tiny_model, sidecar) -> None:
    url, client = sidecar
    s = make_scheduler(tiny_model, url, prefix_caching=True)
    saved_by(s, client, cache_salt="tenant-a")
    for other in ({"cache_salt": "tenant-b"}, {}):  # another salt, and no salt at all
        computed, loads = first_step(s, make_request(TOKENS, **other))
        assert (computed, loads) == (0, []), other  # vLLM's own cache and kvpool both give nothing
        finish(s)
    fresh = make_scheduler(tiny_model, url, prefix_caching=True)  # another engine of the pool
    computed, loads = first_step(fresh, make_request(TOKENS, cache_salt="tenant-a"))
    assert computed == 80 and len(loads) == 1  # all but the last block's worth, from the sidecar
    finish(fresh)


def test_lora_adapters_never_share_with_the_base_model_or_each_other(tiny_model, sidecar, tmp_path) -> None:
    from kvpool_connector import request_inputs

    url, client = sidecar
    s = make_scheduler(tiny_model, url, prefix_caching=True, lora=True)
    path = adapter(tmp_path / "adapter", seed=1)
    base = saved_by(s, client)
    tuned = saved_by(s, client, lora_request=LoRARequest("ad", 1, str(path)))
    assert not set(base) & set(tuned)
    computed, loads = first_step(s, make_request(TOKENS, lora_request=LoRARequest("other", 2, str(path))))
    assert (computed, loads) == (0, [])
    finish(s)
    # new adapter weights at the same name and path, in a new engine process: nothing of the old loads
    adapter(path, seed=2)
    request_inputs._adapter_fingerprint.cache_clear()
    fresh = make_scheduler(tiny_model, url, prefix_caching=True, lora=True)
    computed, loads = first_step(fresh, make_request(TOKENS, lora_request=LoRARequest("ad", 1, str(path))))
    assert (computed, loads) == (0, [])
    finish(fresh)


def test_multimodal_items_change_keys_from_their_chunk_on(tiny_model, sidecar) -> None:
    url, client = sidecar
    s = make_scheduler(tiny_model, url, prefix_caching=True, encoder_budget=1024)
    cat = saved_by(s, client, mm_features=image("cat-hash"))
    fresh = make_scheduler(tiny_model, url, prefix_caching=True, encoder_budget=1024)
    # another image behind the same placeholder tokens: only chunk 0, before the image, is shared
    computed, loads = first_step(fresh, make_request(TOKENS, mm_features=image("dog-hash")))
    assert computed == 32 and [len(op.block_ids) for ld in loads for op in ld.chunks] == [2]
    finish(fresh)
    # the same image at another offset inside the same chunk is another key too
    computed, _ = first_step(fresh, make_request(TOKENS, mm_features=image("cat-hash", offset=44)))
    assert computed == 32
    finish(fresh)
    again = make_scheduler(tiny_model, url, prefix_caching=True, encoder_budget=1024)
    computed, loads = first_step(again, make_request(TOKENS, mm_features=image("cat-hash")))
    assert computed == 80 and len(loads) == 1
    finish(again)
    assert len(cat) == 3


def test_prompt_embeds_never_share_with_other_embeds(tiny_model, sidecar) -> None:
    url, client = sidecar
    s = make_scheduler(tiny_model, url, prefix_caching=True)
    embeds = torch.randn(96, 128, generator=torch.Generator().manual_seed(1))
    saved_by_embeds = make_request(None, prompt_embeds=embeds)
    s.add_request(saved_by_embeds)
    assert len(save_like_a_worker(client, run_to_end(s))) == 3
    other = embeds.clone()
    other[50] += 1.0  # one position of chunk 1's second block differs
    fresh = make_scheduler(tiny_model, url, prefix_caching=True)
    computed, _ = first_step(fresh, make_request(None, prompt_embeds=other))
    assert computed == 48  # chunk 0, and chunk 1's first block (its block-prefix key): never the second
    finish(fresh)
    again = make_scheduler(tiny_model, url, prefix_caching=True)
    computed, loads = first_step(again, make_request(None, prompt_embeds=embeds.clone()))
    assert computed == 80 and len(loads) == 1
    finish(again)


def test_a_request_kvpool_cannot_key_is_neither_loaded_nor_saved(tiny_model, sidecar) -> None:
    url, _ = sidecar
    s = make_scheduler(tiny_model, url, prefix_caching=True, encoder_budget=1024)
    s.add_request(make_request(TOKENS, mm_features=image(1.5)))  # an identifier of an unknown kind
    counters: dict[str, int] = {}
    outputs = run_to_end(s, counters=counters)
    assert not loads_of(outputs) and not saves_of(outputs)
    assert counters["unkeyable_requests"] == 1 and counters.get("lookups", 0) == 0
    assert_empty(s)


_KEYS_SCRIPT = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from schedkit import make_request, prompt
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from kvpool_connector.keys import Namespace, chunk_keys
from kvpool_connector.request_inputs import request_extras
ns = Namespace("m", "float16", "x", 2, 2, 64, 16, 32)
mm = [MultiModalFeatureSpec(None, "image", "h", PlaceholderRange(offset=40, length=16))]
lora = LoRARequest("a", 1, "/nowhere")
req = make_request(prompt(96, 3), cache_salt="s", lora_request=lora, mm_features=mm)
emb = make_request(None, prompt_embeds=torch.arange(96 * 128, dtype=torch.float32).reshape(96, 128))
print(json.dumps([chunk_keys(ns, r.all_token_ids, extras=request_extras(r, 16)) for r in (req, emb)]))
"""


def test_keys_with_every_extra_input_agree_across_processes() -> None:
    here = str(Path(__file__).parent)
    runs = []
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", _KEYS_SCRIPT, here],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0] == runs[1]
    assert len(set(runs[0][0]) | set(runs[0][1])) == 6
