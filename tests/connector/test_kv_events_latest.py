"""kvpool's KV cache events inside the real vllm==0.33.0 Scheduler (schedkit.py): a chunk is announced
with vLLM's block hashes once the step that saved it has run, in the order vLLM runs the steps (async
scheduling plans the next step before the last one has run)."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm_latest

vllm = pytest.importorskip("vllm")
from schedkit import make_request, make_scheduler, model_output, prompt, saves_of  # noqa: E402
from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from kvpool_connector.config import KVPoolConfig  # noqa: E402


def _published(scheduler: Any) -> list[Any]:
    """Every batch of events the scheduler publishes from now on."""
    batches: list[Any] = []
    scheduler.kv_event_publisher.publish = batches.append
    return batches


def _hashes(request: Any) -> list[Any]:
    """vLLM's block hashes of a request as its events carry them (ints by default in this vLLM)."""
    return [maybe_convert_block_hash(h) for h in request.block_hashes]


def _cpu(batches: list[Any], medium: str = "CPU") -> list[Any]:
    """kvpool's (vLLM's own blocks are medium GPU)."""
    return [e for b in batches for e in b.events if e.medium == medium]


def test_chunks_are_announced_when_their_step_has_run(tiny_model, sidecar) -> None:
    url, _ = sidecar
    s = make_scheduler(tiny_model, url, prefix_caching=True, kv_events=True, async_scheduling=True)
    batches = _published(s)
    req = make_request(prompt(96, 1))  # three chunks of 32 tokens; 64 tokens a step
    s.add_request(req)
    first = s.schedule()
    second = s.schedule()  # planned before the first has run
    assert [len(sv.chunks) for sv in saves_of([first, second])] == [2, 1]
    s.update_from_output(first, model_output(s, first))
    hashes = _hashes(req)
    stored = _cpu(batches)
    assert all(isinstance(e, BlockStored) for e in stored)
    assert [e.block_hashes for e in stored] == [hashes[0:2], hashes[2:4]]  # not the second step's
    assert [e.parent_block_hash for e in stored] == [None, hashes[1]]
    assert [e.token_ids for e in stored] == [req.all_token_ids[0:32], req.all_token_ids[32:64]]
    s.update_from_output(second, model_output(s, second))
    assert [e.block_hashes for e in _cpu(batches)[2:]] == [hashes[4:6]]


def test_a_connector_reset_withdraws_what_was_announced(tiny_model, sidecar) -> None:
    url, _ = sidecar
    s = make_scheduler(tiny_model, url, prefix_caching=True, kv_events=True)
    batches = _published(s)
    req = make_request(prompt(64, 2))
    s.add_request(req)
    so = s.schedule()
    s.update_from_output(so, model_output(s, so))
    hashes = _hashes(req)
    assert [e.block_hashes for e in _cpu(batches)] == [hashes[0:2], hashes[2:4]]
    s.reset_prefix_cache(reset_connector=True)  # vLLM's part waits for the running request; kvpool's does not
    s.add_request(make_request(prompt(20, 3)))
    so = s.schedule()
    s.update_from_output(so, model_output(s, so))
    removed = [e for e in _cpu(batches) if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(hashes[0:4])


def test_the_medium_is_the_pools_to_name(tiny_model, sidecar) -> None:
    """kv_events_medium (the pool's extraConfig) names kvpool's tier for a router configured for it;
    by default it is vLLM's own name of a CPU tier."""
    assert KVPoolConfig().kv_events_medium == MEDIUM_CPU
    url, _ = sidecar
    s = make_scheduler(tiny_model, url, prefix_caching=True, kv_events=True, kv_events_medium="KVPOOL")
    batches = _published(s)
    req = make_request(prompt(64, 4))
    s.add_request(req)
    so = s.schedule()
    s.update_from_output(so, model_output(s, so))
    assert [e.block_hashes for e in _cpu(batches, "KVPOOL")] == [_hashes(req)[0:2], _hashes(req)[2:4]]
    assert _cpu(batches) == []
