"""The real vllm==0.33.0 v1 Scheduler on the CPU, built and driven the way vLLM's own
tests/v1/kv_connector/unit/utils.py does (config, scheduler, requests and model runner outputs),
with kvpool's connector talking to a real sidecar. No worker runs: a test plays the worker by putting
chunks into the sidecar under the keys the engine would use."""

from __future__ import annotations

import gc
import itertools
import select
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvpool_connector.connector import KVPoolConnector
from kvpool_connector.keys import chunk_keys, rank_key
from kvpool_connector.vllm_types import KVPoolMetadata
from kvpool_sidecar.client import SidecarClient, checksum

BS = 16
CHUNK = 32
EOS = 2
init_none_hash(sha256)


def make_scheduler(
    model: Path,
    url: str,
    num_blocks: int = 200,
    batched: int = 64,
    prefix_caching: bool = False,
    lora: bool = False,
    encoder_budget: int = 0,
    async_scheduling: bool = False,
    tp_size: int = 1,
    kv_events: bool = False,
    sliding_window: int | None = None,
    max_num_seqs: int = 16,
    connector: bool = True,
    **extra: Any,
) -> Scheduler:
    """The scheduler as the engine core makes it. `encoder_budget` gives it the encoder compute and
    cache budget a vision model's config would (the tiny model has none), so requests with
    multimodal items get scheduled. With `sliding_window`, a hybrid model's KV cache (gpt-oss, Gemma
    3): a full-attention layer and a layer with that window, each a group of vLLM's hybrid manager.
    Without `connector`, vLLM alone (a bench's baseline)."""
    extra.setdefault("sync_loads", False)  # the tests walk the load through its own steps, as on a GPU
    model_config = ModelConfig(model=str(model), dtype="float16", seed=42)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=batched,
        max_model_len=2048,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(
        block_size=BS, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=prefix_caching
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
        kv_transfer_config=kv_transfer if connector else None,
        device_config=DeviceConfig("cpu"),
        lora_config=LoRAConfig(max_loras=2) if lora else None,
        # KV cache events on, published nowhere: a test reads the scheduler's publisher
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None,
    )
    shape: dict[str, Any] = {"block_size": BS, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float16}
    full = FullAttentionSpec(**shape)
    groups = [KVCacheGroupSpec(["layer0", "layer1"], full)]
    if sliding_window is not None:
        window = SlidingWindowSpec(**shape, sliding_window=sliding_window)
        groups = [KVCacheGroupSpec(["layer0"], full), KVCacheGroupSpec(["layer1"], window)]
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    config.cache_config.num_gpu_blocks = num_blocks
    config.parallel_config.tensor_parallel_size = tp_size  # the namespace and the lookup read it
    # AsyncScheduler: what the engine core uses with async scheduling (vLLM's default on GPU)
    scheduler = (AsyncScheduler if async_scheduling else Scheduler)(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BS,
    )
    if encoder_budget:
        scheduler.max_num_encoder_input_tokens = encoder_budget
        scheduler.encoder_cache_manager = EncoderCacheManager.create_manager(
            cache_size=encoder_budget, vllm_config=config
        )
    MADE.append(scheduler)
    return scheduler


# Schedulers made by the running test, shut down as it ends (conftest.py), as the engine core shuts its
# own down: their connections to the sidecar are closed then, not by the garbage collector at some
# later point, which warns about each and so makes socket calls inside another test's schedule().
MADE: list[Scheduler] = []


def shut_down_made() -> None:
    """Shuts down the schedulers made since the last call."""
    while MADE:
        MADE.pop().shutdown()


_ids = itertools.count(1)


def make_request(
    tokens: list[int] | None,
    max_tokens: int = 4,
    priority: int = 0,
    prompt_logprobs: int | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
    **inputs: Any,
) -> Request:
    """A request as the engine core builds it; `kv_transfer_params` as the OpenAI server passes them
    (kvpool's opt-outs), `inputs` are Request's own (cache_salt, lora_request, mm_features,
    prompt_embeds)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    if kv_transfer_params is not None:
        params.extra_args = {"kv_transfer_params": kv_transfer_params}
    params.update_from_generation_config({}, EOS)
    return Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=tokens,
        sampling_params=params,
        pooling_params=None,
        priority=priority,
        block_hasher=get_request_block_hasher(BS, sha256),
        **inputs,
    )


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 4 for i in range(n)]


def store_chunks(scheduler: Scheduler, client: SidecarClient, tokens: list[int], n: int) -> None:
    """Puts the first n chunks of `tokens` where the engine would look for them."""
    keys = chunk_keys(namespace_of(scheduler), tokens)[:n]
    for key in keys:
        assert client.put(key, b"\0" * 64)


def namespace_of(scheduler: Scheduler):
    from kvpool_connector.namespace import engine_namespace

    return engine_namespace(scheduler.vllm_config, scheduler.kv_cache_config, CHUNK)


def model_output(
    scheduler: Scheduler, so, invalid: set[int] | None = None, saved_through: int | None = None
) -> ModelRunnerOutput:
    """What the workers report for step `so`: a token per scheduled request whose prompt is computed
    (none for a prefill chunk short of the prompt's end: vLLM's model runner discards it); every load
    the step started finished in it, with `invalid` the blocks that failed; every save it planned
    finished too (the tests store them themselves: save_like_a_worker), unless
    `saved_through` names an earlier step. Without a connector (vLLM alone), the tokens only."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvpool_connector.vllm_types import KVPoolSaveProgress

    plan = so.kv_connector_metadata
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[7] if _prompt_computed(scheduler, r) else [] for r in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=None
        if plan is None
        else KVConnectorOutput(
            finished_recving={ld.req_id for ld in plan.loads if not ld.in_step},  # in-step: never reported
            invalid_block_ids=invalid or set(),
            kv_connector_worker_meta=KVPoolSaveProgress(
                plan.step if saved_through is None else saved_through
            ),
        ),
    )


def _prompt_computed(scheduler: Scheduler, req_id: str) -> bool:
    """Whether the request's tokens are all computed once the step scheduled (schedule() counted them)."""
    request = scheduler.requests.get(req_id)
    return request is None or request.num_computed_tokens >= request.num_tokens


def run_to_end(
    scheduler: Scheduler,
    max_steps: int = 500,
    counters: dict[str, Any] | None = None,
    fail_loads: bool = False,
    before_step: Callable[[int], None] | None = None,
    during_step: Callable[[int], None] | None = None,
) -> list:
    """Steps until nothing is left; returns the scheduler outputs (their connector metadata included).
    `counters` sums the connector's counters as the engine reports them; with `fail_loads` every
    load fails (a worker that can never load what the sidecar offers); `before_step` is called with
    each step's index before its schedule(), `during_step` after it, where the forward would run."""
    outputs: list[SchedulerOutput] = []
    for step in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        if before_step is not None:
            before_step(step)
        so = scheduler.schedule()
        outputs.append(so)
        if during_step is not None:
            during_step(step)
        plan = so.kv_connector_metadata
        assert isinstance(plan, KVPoolMetadata)
        failed = {b for ld in plan.loads for op in ld.chunks for b in op.block_ids}
        output = model_output(scheduler, so, invalid=failed if fail_loads else None)
        engine_outputs = scheduler.update_from_output(so, output)
        if counters is not None:
            add_counters(counters, engine_outputs)
    raise AssertionError("requests did not finish")


def run_overlapped_to_end(scheduler: Scheduler, counters: dict[str, Any], max_steps: int = 500) -> list:
    """run_to_end in the order the engine core steps with async scheduling (vLLM's default on a GPU):
    each step is scheduled before the one before it has reported its output."""
    outputs: list[SchedulerOutput] = []

    def end(so: SchedulerOutput) -> None:
        add_counters(counters, scheduler.update_from_output(so, model_output(scheduler, so)))

    for _ in range(max_steps):
        outputs.append(scheduler.schedule())
        if len(outputs) > 1:
            end(outputs[-2])
        if not scheduler.has_unfinished_requests():
            end(outputs[-1])
            return outputs
    raise AssertionError("requests did not finish")


def add_counters(counters: dict[str, Any], engine_outputs: dict[int, Any]) -> None:
    """Adds the connector's counters of one step, as the engine reports them (KVPoolStats.to_dict())."""
    for eco in engine_outputs.values():
        stats = eco.scheduler_stats.kv_connector_stats if eco.scheduler_stats else None
        for name, value in (stats or {}).items():
            counters[name] = counters.get(name, 0) + value


def lookups_asked_in_schedule(counters: dict[str, Any]) -> int:
    """Of the lookups counted, those that were round trips inside schedule(): not sent ahead (on
    arrival, in turn behind a burst, as a renewal at a step's end, or again with another chunk's tails)."""
    ahead = ("lookups_sent_on_arrival", "lookups_sent_in_turn", "lookups_renewed", "lookups_guessed_again")
    return int(counters.get("lookups", 0) - sum(counters.get(name, 0) for name in ahead))


def watch_schedule_for_socket_calls(scheduler: Scheduler) -> list[list[str]]:
    """From now on, the socket and poll calls each schedule() makes (one list a call, in order),
    seen by a profile hook: every system call kvpool makes to its sidecar goes through one."""
    calls: list[list[str]] = []
    schedule = scheduler.schedule
    gc.collect()  # garbage of earlier work is finalized now, not during a schedule() watched

    def watched(*args: Any, **kwargs: Any) -> SchedulerOutput:
        seen: list[str] = []

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "c_call" and (
                isinstance(getattr(arg, "__self__", None), socket.socket)
                or getattr(arg, "__module__", None) == "select"
                or type(getattr(arg, "__self__", None)).__name__ == "poll"
            ):
                seen.append(arg.__qualname__)

        sys.setprofile(profile)
        try:
            return schedule(*args, **kwargs)
        finally:
            sys.setprofile(None)
            calls.append(seen)

    scheduler.schedule = watched  # type: ignore[method-assign]
    return calls


def sidecar_answers_sent_lookups(scheduler: Scheduler) -> Callable[[int], None]:
    """A `during_step` whose forward lasts until the sidecar has answered every lookup sent ahead so far
    (as a real one of milliseconds to seconds does): each answer is in its socket when the step ends."""
    kv = scheduler.connector.scheduler  # type: ignore[union-attr]

    def forward(step: int) -> None:
        for st in list(kv.reqs.values()):
            if st.sent is not None and st.sent.lookup.fileno() >= 0:
                assert select.select([st.sent.lookup], [], [], 5)[0], "the sidecar did not answer a lookup"

    return forward


def keys_asked(client: SidecarClient) -> int:
    """Keys the sidecar has been asked for."""
    stats = client.stats()
    return int(stats["hits"]) + int(stats["misses"])


def add_and_see_it_asked(scheduler: Scheduler, client: SidecarClient, request: Request) -> int:
    """Adds `request` and waits until its lookup, sent as vLLM receives it, reaches the sidecar (which
    answers on its own time: nothing in the scheduler waits for it). The keys asked by then."""
    before = keys_asked(client)
    scheduler.add_request(request)
    deadline = time.monotonic() + 5
    while keys_asked(client) == before:
        assert time.monotonic() < deadline, "no lookup reached the sidecar when vLLM received the request"
        time.sleep(0.01)
    return keys_asked(client)


def first_computed(outputs: list, req_id: str | None = None) -> int:
    """How many tokens a request (the first one by default) had computed when it was first scheduled:
    after its asynchronous load, if it had one."""
    for so in outputs:
        for new in so.scheduled_new_reqs:
            if req_id is None or new.req_id == req_id:
                return new.num_computed_tokens
    raise AssertionError(f"request {req_id} was never scheduled")


def assert_empty(scheduler: Scheduler) -> None:
    """Every request finished and every block freed (as vLLM's assert_scheduler_empty checks)."""
    assert not scheduler.requests and not scheduler.waiting and not scheduler.running
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    connector = scheduler.connector
    assert isinstance(connector, KVPoolConnector)
    planner = connector.scheduler
    assert planner is not None and not planner.reqs  # it forgot every request
    assert not (planner._sent or planner._to_send or planner._loads or planner._loading)  # what it kept


def loads_of(outputs: list) -> list:
    return [ld for so in outputs for ld in so.kv_connector_metadata.loads]


def saves_of(outputs: list) -> list:
    return [sv for so in outputs for sv in so.kv_connector_metadata.saves]


def save_like_a_worker(client: SidecarClient, outputs: list) -> list[str]:
    """Stores every chunk the steps asked to save, under rank 0's key and with its block prefixes'
    keys, as the worker would (reserve, write into the arena, commit with the checksum)."""
    keys = []
    data = b"\1" * 64
    for op in [op for sv in saves_of(outputs) for op in sv.chunks]:
        key = rank_key(op.link, 0)
        (slot,) = client.reserve([(key, len(data))], prefixes={key: [rank_key(p, 0) for p in op.prefixes]})
        assert slot is not None, f"chunk {key} saved twice or no room"
        client.arena()[slot.offset : slot.offset + len(data)] = data
        assert client.commit([(slot, checksum(data))]) == [True]
        keys.append(key)
    return keys
