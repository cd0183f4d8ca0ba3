"""The connector's scheduler half inside the real vllm==0.33.0 v1 Scheduler, driven on the CPU the
way vLLM's own tests/v1/kv_connector/unit/utils.py drives it (config, scheduler, requests and model
runner outputs built the same way), against a real sidecar process. No worker runs: the test puts
chunks into the sidecar under the keys the engine would use, then checks every request finishes and
every block is freed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpool_connector.keys import chunk_keys
from kvpool_sidecar.client import SidecarClient

pytestmark = pytest.mark.vllm_latest

vllm = pytest.importorskip("vllm")
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

BS = 16
CHUNK = 32
EOS = 2
init_none_hash(sha256)


def make_scheduler(
    model: Path, url: str, num_blocks: int = 200, batched: int = 64, **extra: Any
) -> Scheduler:
    model_config = ModelConfig(model=str(model), dtype="float16", seed=42)
    scheduler_config = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=batched,
        max_model_len=2048,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(
        block_size=BS, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=False
    )
    cache_config.kv_cache_layout = "LBNHC"  # connectors are built after layout resolution
    kv_transfer = KVTransferConfig(
        kv_connector="KVPoolConnector",
        kv_connector_module_path="kvpool_connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"sidecar_url": url, "chunk_size": CHUNK, **extra},
    )
    config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer,
        device_config=DeviceConfig("cpu"),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer0", "layer1"],
                FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float16),
            )
        ],
    )
    config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BS,
    )


_ids = iter(range(1, 10_000))


def make_request(tokens: list[int], max_tokens: int = 4, priority: int = 0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, EOS)
    return Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=tokens,
        sampling_params=params,
        pooling_params=None,
        priority=priority,
        block_hasher=get_request_block_hasher(BS, sha256),
    )


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 4 for i in range(n)]


def store_chunks(scheduler: Scheduler, client: SidecarClient, tokens: list[int], n: int) -> None:
    """Puts the first n chunks of `tokens` where the engine would look for them."""
    keys = chunk_keys(_namespace(scheduler), tokens)[:n]
    for key in keys:
        assert client.put(key, b"\0" * 64)


def _namespace(scheduler: Scheduler):
    from kvpool_connector.namespace import engine_namespace

    return engine_namespace(scheduler.vllm_config, scheduler.kv_cache_config, CHUNK)


def model_output(scheduler: Scheduler, so, invalid: set[int] | None = None) -> ModelRunnerOutput:
    from vllm.v1.outputs import KVConnectorOutput

    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[7] for _ in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=KVConnectorOutput(invalid_block_ids=invalid or set()) if invalid else None,
    )


def run_to_end(scheduler: Scheduler, max_steps: int = 500) -> list:
    """Steps until nothing is left; returns the scheduler outputs (their connector metadata included)."""
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        so = scheduler.schedule()
        outputs.append(so)
        scheduler.update_from_output(so, model_output(scheduler, so))
    raise AssertionError("requests did not finish")


def assert_empty(scheduler: Scheduler) -> None:
    """Every request finished and every block freed (as vLLM's assert_scheduler_empty checks)."""
    assert not scheduler.requests and not scheduler.waiting and not scheduler.running
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not scheduler.connector.scheduler.reqs  # the connector forgot every request


@pytest.fixture
def sidecar(sidecar_factory) -> Iterator[tuple[str, SidecarClient]]:
    proc = sidecar_factory("16Mi")
    client = SidecarClient(proc.info["url"], timeout=5)
    yield proc.info["url"], client
    client.close()


def _loads(outputs: list) -> list:
    return [ld for so in outputs for ld in so.kv_connector_metadata.loads]


def _saves(outputs: list) -> list:
    return [sv for so in outputs for sv in so.kv_connector_metadata.saves]


def test_full_prompt_hit_recomputes_the_last_token(tiny_model, sidecar) -> None:
    url, client = sidecar
    s = make_scheduler(tiny_model, url)
    tokens = prompt(96, 1)  # three full chunks, all stored
    store_chunks(s, client, tokens, 3)
    s.add_request(make_request(tokens))
    so = s.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 80  # 95 tokens aligned down to the block
    (load,) = so.kv_connector_metadata.loads
    assert [len(op.block_ids) for op in load.chunks] == [2, 2, 1]
    assert so.num_scheduled_tokens[load.req_id] == 16
    s.update_from_output(so, model_output(s, so))
    run_to_end(s)
    assert_empty(s)


def test_partial_hit_and_saves_of_the_rest(tiny_model, sidecar) -> None:
    url, client = sidecar
    s = make_scheduler(tiny_model, url)
    tokens = prompt(100, 2)  # chunks [0,32) [32,64) [64,96) and no tail (96..100 is under a block)
    store_chunks(s, client, tokens, 1)
    s.add_request(make_request(tokens))
    outputs = run_to_end(s)
    assert outputs[0].scheduled_new_reqs[0].num_computed_tokens == 32
    (load,) = _loads(outputs)
    assert [len(op.block_ids) for op in load.chunks] == [2]
    saved = [(op.first_block, op.chunk_blocks) for sv in _saves(outputs) for op in sv.chunks]
    assert saved == [(0, 2), (0, 2)]  # chunks 1 and 2; chunk 0 came from the sidecar
    assert_empty(s)


def test_chunked_prefill_saves_each_chunk_once(tiny_model, sidecar) -> None:
    url, client = sidecar
    s = make_scheduler(tiny_model, url, batched=48)  # prefill steps that end mid-chunk
    tokens = prompt(200, 3)
    store_chunks(s, client, tokens, 2)
    s.add_request(make_request(tokens))
    outputs = run_to_end(s)
    assert outputs[0].scheduled_new_reqs[0].num_computed_tokens == 64
    links = [op.link for sv in _saves(outputs) for op in sv.chunks]
    assert len(links) == len(set(links)) == 4  # chunks 2..5, each once, each when fully computed
    steps_with_saves = [i for i, so in enumerate(outputs) if so.kv_connector_metadata.saves]
    assert len(steps_with_saves) >= 2  # spread over the prefill steps
    assert_empty(s)


def test_preemption_and_resumption(tiny_model, sidecar) -> None:
    url, client = sidecar
    # 12 blocks of 16 tokens: two 64-token prompts decoding 60 tokens each cannot both fit
    s = make_scheduler(tiny_model, url, num_blocks=12)
    reqs = []
    for seed in (4, 5):
        tokens = prompt(64, seed)
        store_chunks(s, client, tokens, 2)
        reqs.append(make_request(tokens, max_tokens=60))
        s.add_request(reqs[-1])
    outputs = run_to_end(s)
    assert any(r.num_preemptions > 0 for r in reqs)
    # the preempted request looked up and loaded again when it resumed
    assert len(_loads(outputs)) >= 3
    assert_empty(s)


def test_aborted_requests_leave_nothing_behind(tiny_model, sidecar) -> None:
    url, client = sidecar
    s = make_scheduler(tiny_model, url)
    running, waiting = make_request(prompt(96, 6)), make_request(prompt(96, 7))
    store_chunks(s, client, running.prompt_token_ids, 3)
    s.add_request(running)
    so = s.schedule()
    assert so.kv_connector_metadata.loads
    s.add_request(waiting)  # looked up at the next schedule, aborted before it
    s.finish_requests([running.request_id, waiting.request_id], RequestStatus.FINISHED_ABORTED)
    s.update_from_output(so, model_output(s, so))
    run_to_end(s)
    assert_empty(s)


def test_second_update_state_after_alloc_with_zero_tokens_keeps_the_load(tiny_model, sidecar) -> None:
    url, client = sidecar
    s = make_scheduler(tiny_model, url)
    tokens = prompt(96, 8)
    store_chunks(s, client, tokens, 2)
    req = make_request(tokens)
    conn = s.connector
    ext, is_async = conn.get_num_new_matched_tokens(req, 0)
    assert (ext, is_async) == (64, False)
    blocks = s.kv_cache_manager.empty_kv_cache_blocks
    conn.update_state_after_alloc(req, blocks, ext)
    conn.update_state_after_alloc(req, blocks, 0)  # the second call (after an async load) loads nothing new
    assert conn.scheduler.reqs[req.request_id].load == (0, 64)
    conn.request_finished(req, [])
    assert not conn.scheduler.reqs


def test_unreachable_sidecar_is_a_miss(tiny_model, sidecar_factory) -> None:
    proc = sidecar_factory("16Mi")
    s = make_scheduler(tiny_model, proc.info["url"], timeout_ms=300)
    proc.kill()
    s.add_request(make_request(prompt(96, 9)))
    outputs = run_to_end(s)
    assert outputs[0].scheduled_new_reqs[0].num_computed_tokens == 0
    assert_empty(s)


def test_load_errors_are_recomputed(tiny_model, sidecar) -> None:
    url, client = sidecar
    s = make_scheduler(tiny_model, url)
    tokens = prompt(96, 10)
    store_chunks(s, client, tokens, 3)
    req = make_request(tokens)
    s.add_request(req)
    so = s.schedule()
    (load,) = so.kv_connector_metadata.loads
    bad = set(load.chunks[1].block_ids)  # as a worker reports a chunk it could not load
    s.update_from_output(so, model_output(s, so, invalid=bad))
    assert req.num_computed_tokens == 32  # back to the first failed block
    run_to_end(s)
    assert_empty(s)


@pytest.mark.parametrize("save_decode", [False, True])
def test_save_decode_cache_saves_generated_chunks_only_when_asked(tiny_model, sidecar, save_decode) -> None:
    url, _ = sidecar
    s = make_scheduler(tiny_model, url, save_decode_cache=save_decode)
    s.add_request(make_request(prompt(40, 11), max_tokens=40))  # 80 tokens: chunk [32, 64) is mostly decode
    saves = _saves(run_to_end(s))
    assert len([op for sv in saves for op in sv.chunks]) == (2 if save_decode else 1)
    assert_empty(s)


def test_priority_limit_and_skip_save_in_the_scheduler(tiny_model, sidecar) -> None:
    url, _ = sidecar
    s = make_scheduler(tiny_model, url, priority_limit=0)
    low = make_request(prompt(64, 12), priority=1)
    opted_out = make_request(prompt(64, 13))
    opted_out.kv_transfer_params = {"kvpool.skip_save": True}
    at_limit = make_request(prompt(64, 14), priority=0)
    for r in (low, opted_out, at_limit):
        s.add_request(r)
    saves = _saves(run_to_end(s))
    assert {sv.req_id for sv in saves} == {at_limit.request_id}
    assert_empty(s)
