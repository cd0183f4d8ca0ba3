"""Never a wrong byte under faults, with vllm==0.33.0's real Scheduler (prefix caching on), two real
workers as tensor-parallel ranks on one real sidecar and vLLM's own KVOutputAggregator between them.

Each case ends with what the engine computed equal to a cold run's, and with every chunk still stored
equal to a clean recompute of it (rankskit.Ranks.wrong_chunks).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

vllm = pytest.importorskip("vllm")

from rankskit import Ranks  # noqa: E402
from schedkit import CHUNK, assert_empty, make_request, make_scheduler, prompt  # noqa: E402

from kvpool_connector.keys import rank_key  # noqa: E402

pytestmark = pytest.mark.vllm_latest
TOKENS = prompt(4 * CHUNK + 10, 21)  # four full chunks and a tail
T = TypeVar("T")


def _engine(tiny_model, url: str, prompts: list[list[int]], **kw) -> Ranks:
    """An engine with empty caches and `prompts` added."""
    ranks = Ranks(make_scheduler(tiny_model, url, prefix_caching=True, tp_size=2, **kw), url)
    for tokens in prompts:
        ranks.scheduler.add_request(make_request(tokens))
    return ranks


def _cold(tiny_model, url: str, prompts: list[list[int]] = [TOKENS], **kw) -> Ranks:  # noqa: B006
    """A first engine runs the prompts cold: every rank saves its copy of every chunk."""
    ranks = _engine(tiny_model, url, prompts, **kw)
    ranks.run()
    ranks.shutdown()
    return ranks


def _slowed(call: Callable[..., T], seconds: float) -> Callable[..., T]:
    def slow(*args: Any, **kwargs: Any) -> T:
        time.sleep(seconds)
        return call(*args, **kwargs)

    return slow


def _links(outputs: list) -> list[bytes]:
    return [op.link for so in outputs for ld in so.kv_connector_metadata.loads for op in ld.chunks]


def _counters(ranks: Ranks) -> dict[str, float]:
    out: dict[str, float] = {}
    for w in ranks.workers:
        for name, value in (w.take_stats() or {}).items():
            out[name] = out.get(name, 0) + value
    return out


def _check_clean(ranks: Ranks, cold: Ranks, client) -> None:
    assert ranks.logits == cold.logits  # what the engine sampled from, step by step, as cold
    assert ranks.wrong_chunks(client) == []
    assert_empty(ranks.scheduler)


def test_a_chunk_one_rank_lacks_is_a_miss_for_all_ranks(tiny_model, sidecar) -> None:
    url, client = sidecar
    cold = _cold(tiny_model, url)
    (rank1_chunk1,) = {s.key for s in cold.saved if s.rank == 1 and s.start == CHUNK}
    assert client.delete(rank1_chunk1)
    warm = _engine(tiny_model, url, [TOKENS])
    outputs = warm.run()
    (load,) = [ld for so in outputs for ld in so.kv_connector_metadata.loads]
    assert len(load.chunks) == 1  # chunk 0 only: rank 1 has no chunk 1, so no rank loads it
    _check_clean(warm, cold, client)
    assert client.get(rank1_chunk1) is not None  # saved again by the recompute
    warm.shutdown()


@pytest.mark.parametrize("lag", [0, 1], ids=["sync-scheduling", "async-scheduling"])
def test_a_load_that_fails_on_one_rank_poisons_nothing(tiny_model, sidecar, lag) -> None:
    """Rank 1's copy of chunk 1 vanishes between the lookup and the load (evicted): rank 0 loads
    all of its chunks, rank 1 fails from chunk 1 on. Nothing is computed over rank 1's unloaded
    blocks, on either rank, and in no step scheduled before the scheduler saw the failure."""
    url, client = sidecar
    cold = _cold(tiny_model, url, async_scheduling=bool(lag))
    warm = _engine(tiny_model, url, [TOKENS], async_scheduling=bool(lag))
    evicted: list[str] = []

    def evict_rank1_chunk1(so) -> None:
        loads = so.kv_connector_metadata.loads
        if loads and not evicted:
            key = rank_key(loads[0].chunks[1].link, 1)
            assert client.delete(key)
            evicted.append(key)

    outputs = warm.run(evict_rank1_chunk1, lag=lag)
    assert evicted
    _check_clean(warm, cold, client)
    counters = _counters(warm)
    assert counters["load_failed_blocks"] >= 2  # rank 1: chunk 1 onwards
    assert counters["loaded_chunks"] >= 4  # rank 0 loaded everything it was asked
    assert len(_links(outputs)) >= 4
    assert client.get(evicted[0]) is not None  # the recompute saved it again, clean
    warm.shutdown()


def test_a_corrupt_chunk_on_one_rank_is_recomputed_everywhere(tiny_model, sidecar) -> None:
    """Rank 0's copy of chunk 2 changes in the arena behind the sidecar's back: rank 0's check of
    what it loaded fails, the sidecar drops it, and both ranks recompute from chunk 2."""
    url, client = sidecar
    cold = _cold(tiny_model, url)
    warm = _engine(tiny_model, url, [TOKENS])
    corrupted: list[str] = []

    def corrupt_rank0_chunk2(so) -> None:
        loads = so.kv_connector_metadata.loads
        if loads and not corrupted:
            key = rank_key(loads[0].chunks[2].link, 0)
            pinned = client.pin([key])
            client.arena()[pinned.slots[0].offset + 8] ^= 0xFF
            client.release(pinned.lease)
            corrupted.append(key)

    warm.run(corrupt_rank0_chunk2)
    assert _counters(warm)["corrupt_chunks"] == 1
    assert client.stats()["corrupt_dropped"] >= 1
    _check_clean(warm, cold, client)
    warm.shutdown()


def test_a_shared_prefix_loading_for_one_request_is_never_used_by_another(tiny_model, sidecar) -> None:
    """Two requests with one prefix arrive together; vLLM's prefix cache may not hand the blocks one
    is still loading to the other. With rank 1's chunk 1 gone mid-load, neither computes over it."""
    url, client = sidecar
    prompts = [TOKENS, [*TOKENS[: 3 * CHUNK + 5], 9, 9, 9]]
    cold = _cold(tiny_model, url, prompts)
    warm = _engine(tiny_model, url, prompts)
    evicted: list[str] = []

    def evict(so) -> None:
        loads = so.kv_connector_metadata.loads
        if loads and not evicted:
            for ld in loads:
                key = rank_key(ld.chunks[1].link, 1)
                if client.delete(key):
                    evicted.append(key)

    warm.run(evict)
    assert evicted
    _check_clean(warm, cold, client)
    warm.shutdown()


def test_a_hung_sidecar_holds_one_lookup_then_the_breaker_answers(tiny_model, sidecar_factory) -> None:
    """Lookups run inside vLLM's schedule(): with the sidecar hung, one lookup waits out its timeout
    and the next ones are misses at once, until the breaker closes; then lookups hit again."""
    import signal

    from schedkit import run_to_end, store_chunks

    from kvpool_connector.breaker import BREAKER_SECONDS, Breaker
    from kvpool_sidecar.client import SidecarClient

    proc = sidecar_factory("16Mi")
    s = make_scheduler(tiny_model, proc.info["url"], timeout_ms=300)
    now = [0.0]
    s.connector.scheduler._breaker = Breaker(lambda: now[0])
    proc.popen.send_signal(signal.SIGSTOP)
    try:
        for i in range(3):
            s.add_request(make_request(prompt(96, 30 + i)))
        counters: dict = {}
        outputs = run_to_end(s, counters=counters)  # three lookups: one waits, two do not
        assert (counters.get("lookup_errors"), counters.get("lookups_skipped")) == (1, 2)
        assert not [ld for so in outputs for ld in so.kv_connector_metadata.loads]
    finally:
        proc.popen.send_signal(signal.SIGCONT)
    tokens = prompt(96, 40)
    with SidecarClient(proc.info["url"], timeout=5) as client:
        store_chunks(s, client, tokens, 2)
    now[0] += BREAKER_SECONDS
    s.add_request(make_request(tokens))
    so = s.schedule()
    assert [len(ld.chunks) for ld in so.kv_connector_metadata.loads] == [2]  # asked again, and a hit


def test_blocks_vllm_hands_out_again_are_never_saved_with_their_new_kv(tiny_model, sidecar) -> None:
    """Saves read vLLM's blocks on the save thread, after their step. With 16 blocks only one of these
    prompts fits at a time and each ends in the step that computes (and saves) its last chunk, so vLLM
    hands those blocks to the next prompt in the very next step, while their saves may still be
    queued: the fence makes that step wait for them, and every chunk stored is its clean recompute."""
    url, client = sidecar
    scheduler = make_scheduler(tiny_model, url, num_blocks=16, prefix_caching=True, tp_size=2)
    ranks = Ranks(scheduler, url, num_blocks=16)
    for w in ranks.workers:  # a slow sidecar: each reservation takes 20 ms (the fault, not a wait)
        w.client.reserve = _slowed(w.client.reserve, 0.02)
    seeds = range(31, 37)
    for seed in seeds:
        scheduler.add_request(make_request(prompt(4 * CHUNK + 10, seed), max_tokens=1))
    outputs = ranks.run()
    assert any(so.kv_connector_metadata.fence for so in outputs)  # blocks were handed out again
    assert len({s.key for s in ranks.saved if client.get(s.key) is not None}) == len(seeds) * 4 * 2
    assert ranks.wrong_chunks(client) == []
    assert_empty(scheduler)
    ranks.shutdown()
