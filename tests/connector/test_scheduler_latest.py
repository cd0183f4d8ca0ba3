"""The connector's scheduler half inside the real vllm==0.33.0 v1 Scheduler (schedkit.py), against a
real sidecar process: every request finishes and every block is freed."""

from __future__ import annotations

import itertools
from typing import Any
from unittest import mock

import pytest

pytestmark = pytest.mark.vllm_latest

vllm = pytest.importorskip("vllm")
from schedkit import (  # noqa: E402
    CHUNK,
    add_and_see_it_asked,
    assert_empty,
    first_computed,
    keys_asked,
    loads_of,
    lookups_asked_in_schedule,
    make_request,
    make_scheduler,
    model_output,
    prompt,
    run_overlapped_to_end,
    run_to_end,
    save_like_a_worker,
    saves_of,
    sidecar_answers_sent_lookups,
    store_chunks,
    watch_schedule_for_socket_calls,
)
from vllm.v1.request import RequestStatus  # noqa: E402


def test_full_prompt_hit_recomputes_the_last_token(tiny_model, sidecar) -> None:
    url, client = sidecar
    s = make_scheduler(tiny_model, url)
    tokens = prompt(96, 1)  # three full chunks, all stored
    store_chunks(s, client, tokens, 3)
    s.add_request(make_request(tokens))
    so = s.schedule()
    (load,) = so.kv_connector_metadata.loads
    assert [len(op.block_ids) for op in load.chunks] == [2, 2, 1]  # 95 tokens aligned down to the block
    assert not so.num_scheduled_tokens  # loading: nothing is computed over blocks not yet checked
    s.update_from_output(so, model_output(s, so))
    so = s.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 80
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
    assert first_computed(outputs) == 32
    (load,) = loads_of(outputs)
    assert [len(op.block_ids) for op in load.chunks] == [2]
    saved = [(op.first_block, op.chunk_blocks) for sv in saves_of(outputs) for op in sv.chunks]
    assert saved == [(0, 2), (0, 2)]  # chunks 1 and 2; chunk 0 came from the sidecar
    assert_empty(s)


def test_chunked_prefill_saves_each_chunk_once(tiny_model, sidecar) -> None:
    url, client = sidecar
    s = make_scheduler(tiny_model, url, batched=48)  # prefill steps that end mid-chunk
    tokens = prompt(200, 3)
    store_chunks(s, client, tokens, 2)
    s.add_request(make_request(tokens))
    outputs = run_to_end(s)
    assert first_computed(outputs) == 64
    links = [op.link for sv in saves_of(outputs) for op in sv.chunks]
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
    assert len(loads_of(outputs)) >= 3
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
    assert (ext, is_async) == (64, True)  # loaded asynchronously
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
    assert first_computed(outputs) == 0
    assert_empty(s)


@pytest.mark.parametrize("in_step", [False, True])
def test_load_errors_are_recomputed(tiny_model, sidecar, in_step) -> None:
    """A failed block truncates the request back to it, and it recomputes from there. Loaded in the
    step (sync_loads, a CPU engine's default), the request computes in the step its load runs in: one
    step sooner than beside the steps, which under load is a whole step of other requests. vLLM then
    drops that step's token for it, and the next step recomputes from the failed block, loading
    nothing."""
    url, client = sidecar
    s = make_scheduler(tiny_model, url, sync_loads=in_step)
    tokens = prompt(96, 10)
    store_chunks(s, client, tokens, 3)
    req = make_request(tokens)
    s.add_request(req)
    so = s.schedule()
    (load,) = so.kv_connector_metadata.loads
    assert load.in_step == in_step
    # the load is the whole prompt but its last block (vLLM computes the last token), 80 tokens
    assert so.num_scheduled_tokens == ({req.request_id: 96 - 80} if in_step else {})
    bad = set(load.chunks[1].block_ids)  # as a worker reports a chunk it could not load
    s.update_from_output(so, model_output(s, so, invalid=bad))
    assert req.num_computed_tokens == 32 and not req.output_token_ids  # back to the first failed block
    if in_step:
        so = s.schedule()
        assert not so.kv_connector_metadata.loads and so.num_scheduled_tokens == {req.request_id: 64}
        s.update_from_output(so, model_output(s, so))
    run_to_end(s)
    assert_empty(s)


@pytest.mark.parametrize("save_decode", [False, True])
def test_save_decode_cache_saves_generated_chunks_only_when_asked(tiny_model, sidecar, save_decode) -> None:
    url, _ = sidecar
    s = make_scheduler(tiny_model, url, save_decode_cache=save_decode)
    s.add_request(make_request(prompt(40, 11), max_tokens=40))  # 80 tokens: chunk [32, 64) is mostly decode
    saves = saves_of(run_to_end(s))
    assert len([op for sv in saves for op in sv.chunks]) == (2 if save_decode else 1)
    assert_empty(s)


class _CountedSpans(set):
    """A request's saved spans, counting how often a step asks whether one is saved."""

    asked = 0

    def __contains__(self, span: object) -> bool:
        _CountedSpans.asked += 1
        return super().__contains__(span)


def test_a_decode_step_looks_at_no_chunk_of_the_prompt_again(tiny_model, sidecar) -> None:
    """Each chunk is looked at once, in the step it becomes due; a step of a running request looks at
    none it has passed (a 32k-token prompt has 128 chunks of 256 tokens, for each running request at
    each step)."""
    url, _ = sidecar
    s = make_scheduler(tiny_model, url)
    req = make_request(prompt(12 * CHUNK, 16), max_tokens=40)
    s.add_request(req)
    st = s.connector.scheduler.reqs[req.request_id]
    saved = 0
    for _ in range(6):  # its prefill, 64 tokens a step
        so = s.schedule()
        saved += sum(len(sv.chunks) for sv in so.kv_connector_metadata.saves)
        s.update_from_output(so, model_output(s, so))
    assert req.num_computed_tokens == req.num_prompt_tokens
    assert saved == 12 and len(st.saved) == 12
    st.saved = _CountedSpans(st.saved)
    for _ in range(4):  # its next steps: no chunk becomes due
        so = s.schedule()
        assert req.request_id in so.num_scheduled_tokens and not so.kv_connector_metadata.saves
        s.update_from_output(so, model_output(s, so))
    assert _CountedSpans.asked == 0
    run_to_end(s)
    assert_empty(s)


def test_a_decode_step_plans_nothing_for_requests_whose_chunks_have_all_been_due(tiny_model, sidecar) -> None:
    """A running request whose every chunk has been due (planned for saving, or never to be saved: opted
    out, over the priority limit) is not looked at by a decode step's plan. At a batch of 256 those
    looks were most of kvpool's time in a decode step (bench scheduler_batch)."""
    url, _ = sidecar
    s = make_scheduler(tiny_model, url, priority_limit=0)
    reqs = [make_request(prompt(3 * CHUNK + 8, 40 + i), max_tokens=40) for i in range(4)]
    opted_out = {"kvpool.skip_save": True}
    reqs.append(make_request(prompt(2 * CHUNK, 50), max_tokens=40, kv_transfer_params=opted_out))
    reqs.append(make_request(prompt(2 * CHUNK, 51), max_tokens=40, priority=1))
    for r in reqs:
        s.add_request(r)
    for _ in range(32):  # their prefill (64 tokens a step), in a bounded number of steps
        if all(r.num_computed_tokens >= r.num_prompt_tokens for r in reqs):
            break
        so = s.schedule()
        s.update_from_output(so, model_output(s, so))
    else:
        raise AssertionError("the prefill did not finish in 32 steps")
    planner = s.connector.scheduler
    with mock.patch.object(planner, "_save_spec", wraps=planner._save_spec) as looked_at:
        for _ in range(4):  # decode steps of all six
            so = s.schedule()
            assert len(so.num_scheduled_tokens) == len(reqs) and not so.kv_connector_metadata.saves
            s.update_from_output(so, model_output(s, so))
    assert looked_at.call_count == 0
    run_to_end(s)
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
    saves = saves_of(run_to_end(s))
    assert {sv.req_id for sv in saves} == {at_limit.request_id}
    assert_empty(s)


def test_a_request_that_must_compute_its_prompt_is_never_looked_up_nor_loaded(tiny_model, sidecar) -> None:
    """Prompt logprobs (vLLM skips its own prefix cache for them) and `kvpool.skip_load` opt a request
    out of loading: no round trip to the sidecar (a miss's whole cost) and every token computed, though
    all its chunks are stored. Its saves are planned as any request's (the sidecar takes only the
    chunks it lacks)."""
    url, client = sidecar
    s = make_scheduler(tiny_model, url)
    tokens = prompt(96, 15)
    store_chunks(s, client, tokens, 2)
    opted_out = make_request(tokens)
    opted_out.kv_transfer_params = {"kvpool.skip_load": True}
    for r in (make_request(tokens, prompt_logprobs=1), opted_out):
        s.add_request(r)
        counters: dict = {}
        outputs = run_to_end(s, counters=counters)
        assert first_computed(outputs) == 0
        assert not loads_of(outputs)
        assert counters.get("lookups", 0) == 0
        assert len([op for sv in saves_of(outputs) for op in sv.chunks]) == 3
    assert_empty(s)


def test_a_lookup_is_sent_as_vllm_receives_the_request_and_read_when_schedule_asks(
    tiny_model, sidecar
) -> None:
    """The lookup's round trip overlaps what vLLM does between receiving a request and scheduling it
    (the step it is running, a pause): the sidecar has answered it before schedule() runs, and
    schedule() reads that answer instead of asking again. The hit is the same."""
    url, client = sidecar
    s = make_scheduler(tiny_model, url)
    tokens = prompt(96, 16)
    store_chunks(s, client, tokens, 2)
    on_arrival = add_and_see_it_asked(s, client, make_request(tokens))
    counters: dict = {}
    outputs = run_to_end(s, counters=counters)
    assert first_computed(outputs) == 64  # the two stored chunks, as a lookup in schedule() finds
    assert (counters["lookups"], counters["lookups_sent_on_arrival"]) == (1, 1)
    assert keys_asked(client) == on_arrival  # no second round trip
    assert_empty(s)


@pytest.mark.parametrize(
    ("batched", "overlapped", "asked_in_schedule"), [(64, False, 0), (1024, False, 2), (64, True, 1)]
)
def test_a_burst_past_the_sent_lookups_bound_is_sent_in_turn(
    tiny_model, sidecar, monkeypatch, batched: int, overlapped: bool, asked_in_schedule: int
) -> None:
    """Each lookup sent on arrival holds a connection to the sidecar until schedule() reads it, so a
    burst sends SENT_AT_MOST at once. The rest were each a round trip inside schedule(). They are now
    sent in turn, oldest first, as those before them are read: as a step ends, and behind the round
    trip of one that schedule() reached first. Where a step takes a few requests, schedule() asks none
    itself; where it takes the whole burst, one lookup in each SENT_AT_MOST + 1. With async
    scheduling the second step is scheduled before the first ends: one is asked there. Every hit is
    found."""
    from kvpool_connector import scheduler as kvpool_scheduler

    monkeypatch.setattr(kvpool_scheduler, "SENT_AT_MOST", 2)
    url, client = sidecar
    s = make_scheduler(tiny_model, url, batched=batched, async_scheduling=overlapped)
    prompts = [prompt(96, 40 + i) for i in range(6)]
    for tokens in prompts[::2]:  # half of them stored, half new
        store_chunks(s, client, tokens, 2)
    requests = [make_request(tokens) for tokens in prompts]
    for r in requests:
        s.add_request(r)
    counters: dict = {}
    outputs = run_overlapped_to_end(s, counters) if overlapped else run_to_end(s, counters=counters)
    assert [first_computed(outputs, r.request_id) for r in requests] == [64, 0] * 3
    assert (counters["lookups"], counters["lookups_sent_on_arrival"]) == (6, 2)
    assert counters.get("lookups_renewed", 0) == 0
    assert lookups_asked_in_schedule(counters) == asked_in_schedule
    assert_empty(s)


def test_a_burst_reuses_the_connections_of_its_lookups(tiny_model, sidecar, monkeypatch) -> None:
    """Each lookup sent ahead is on a connection of its own, back in the pool once its answer is read.
    The pool kept 8 and closed the rest, so each turn of a burst reopened most of its connections to
    the sidecar. It now keeps as many as the lookups sent ahead: a burst opens no more than those."""
    from kvpool_connector import scheduler as kvpool_scheduler
    from kvpool_sidecar import client as sidecar_client_module

    monkeypatch.setattr(kvpool_scheduler, "SENT_AT_MOST", 12)
    opened: list[tuple] = []
    connect = sidecar_client_module.connect_unix

    def counted(*args: Any) -> Any:
        opened.append(args)
        return connect(*args)

    monkeypatch.setattr(sidecar_client_module, "connect_unix", counted)
    url, _ = sidecar
    s = make_scheduler(tiny_model, url, batched=1024)  # ten new requests a step
    for i in range(30):
        s.add_request(make_request(prompt(96, 60 + i), max_tokens=2))
    counters: dict = {}
    run_to_end(s, counters=counters)
    assert counters["lookups"] == counters["lookups_sent_on_arrival"] + counters["lookups_sent_in_turn"] == 30
    assert len(opened) <= 12
    assert_empty(s)


@pytest.mark.parametrize(("seconds", "read"), [(1.5, 2), (20.0, 0)])
def test_a_lookup_sent_on_arrival_stands_through_the_next_step_however_long_the_steps(
    tiny_model, sidecar, seconds: float, read: int
) -> None:
    """On a CPU engine a prefill step takes 1-2 s, so a request that waited one out behind the token
    budget was asked again inside schedule(): its answer from arrival was older than REASK_SECONDS.
    That answer now stands through the step after the one it arrived in, however long, up to
    SENT_STANDS_SECONDS (an engine paused between steps); a request first asked later than that is
    asked again. Every one finds what is stored."""
    url, client = sidecar
    s = make_scheduler(tiny_model, url, batched=64)  # 64 tokens a step
    clock = itertools.count(1000.0, seconds)  # each look at the clock is this long after the last
    s.connector.scheduler._clock = lambda: next(clock)
    tokens = [prompt(96, 70 + i) for i in range(3)]
    store_chunks(s, client, tokens[2], 2)  # the third's first 64 tokens
    requests = [make_request(t) for t in tokens]
    for r in requests:
        s.add_request(r)
    counters: dict = {}
    outputs = run_to_end(s, counters=counters)
    first_step = [
        next(i for i, so in enumerate(outputs) if r.request_id in so.num_scheduled_tokens) for r in requests
    ]
    # the budget: the first in steps 0 and 1, the second in 1 and 2; the third is asked in step 3 and,
    # its load done, computes from step 4
    assert first_step == [0, 1, 4]
    assert [first_computed(outputs, r.request_id) for r in requests] == [0, 0, 64]
    # steps of seconds: the first two read their answers from arrival (the second after a long step),
    # the third asks again; past SENT_STANDS_SECONDS every one asks again
    assert (counters["lookups"], counters["lookups_sent_on_arrival"]) == (3, read)
    assert_empty(s)


def test_a_longer_next_round_reuses_the_saved_tail_block_by_block(tiny_model, sidecar) -> None:
    """Round 2 of a conversation is round 1's prompt and more: its chunk where round 1's partial tail
    was has another key, so the tail is found as a shorter span of that chunk and loaded. The engine
    that saved round 1 asks that chunk's tails with the lookup, in one round trip; another engine
    guesses a miss at chunk 0 and asks for them in a second."""
    url, client = sidecar
    s = make_scheduler(tiny_model, url)
    round1 = prompt(90, 5)  # chunks [0,32) [32,64) and the tail [64,80) (80..90 is under a block)
    s.add_request(make_request(round1))
    save_like_a_worker(client, run_to_end(s))
    round2 = round1 + prompt(40, 6)  # 130 tokens: [64,96) is a full chunk now, with another key
    for engine, round_trips in ((s, 1), (make_scheduler(tiny_model, url), 2)):
        engine.add_request(make_request(round2))
        counters: dict = {}
        outputs = run_to_end(engine, counters=counters)
        assert first_computed(outputs) == 80  # not 64: the tail's block came back too
        assert (counters["lookups"], 1 + counters.get("tail_lookups", 0)) == (1, round_trips)
        (load,) = loads_of(outputs)
        assert [(op.chunk_blocks, len(op.block_ids)) for op in load.chunks] == [(2, 2), (2, 2), (1, 1)]
        saved = [(op.first_block, op.chunk_blocks) for sv in saves_of(outputs) for op in sv.chunks]
        assert saved == [(0, 2), (0, 2)]  # [64,96) whole and the new tail [96,128): chunking stays
        assert_empty(engine)


def test_a_returning_user_whose_chunks_another_engine_saved_is_asked_again_before_schedule(
    tiny_model, sidecar
) -> None:
    """Round 2 of a conversation on an engine that did not serve round 1 (another pod saved it, as a
    fleet's router sends most returning users): the lookup sent on arrival guessed a miss at chunk 0
    and asked that chunk's tails. Its answer, read as a step ends while the request waits for room,
    says the prefix ends at chunk 2, where round 1's partial tail is: that chunk's tails are asked
    then, alone (the prefix is known), and schedule() reads one answer. Before, schedule() asked for
    those tails in a second round trip of its own."""
    url, client = sidecar
    other = make_scheduler(tiny_model, url)
    round1 = prompt(90, 70)  # chunks [0,32) [32,64) and the tail [64,80), saved by the other engine
    other.add_request(make_request(round1))
    save_like_a_worker(client, run_to_end(other))
    s = make_scheduler(tiny_model, url, num_blocks=16)  # room for the holder and the returning user
    s.add_request(holder := make_request(prompt(160, 71), max_tokens=20))
    returning = make_request(round1 + prompt(40, 72))

    def arrives(step: int) -> None:
        if step == 0:  # during the holder's first step: it waits for the step's token budget
            s.add_request(returning)
        answers(step)

    answers = sidecar_answers_sent_lookups(s)
    calls = watch_schedule_for_socket_calls(s)
    client = s.connector.scheduler.client
    counters: dict = {}
    with mock.patch.object(client, "send_lookup", wraps=client.send_lookup) as sent:
        outputs = run_to_end(s, counters=counters, during_step=arrives)
    # the prefix keys the returning user's lookups sent ahead asked: on arrival, its tails alone, and
    # the whole prefix again when its answer aged out while it waited for the holder's blocks
    assert [len(c.args[0]) for c in sent.call_args_list] == [4, 0, 4]
    assert first_computed(outputs, returning.request_id) == 80  # round 1's chunks and its tail's block
    assert counters.get("tail_lookups", 0) == 0
    assert counters["lookups_guessed_again"] == 1
    assert lookups_asked_in_schedule(counters) == 0
    # the first reads the holder's lookup, sent right before it: no step ran in between
    assert [(i, c) for i, c in enumerate(calls) if c and i] == [], "schedule() called the sidecar"
    assert holder.request_id not in s.connector.scheduler.reqs
    assert_empty(s)
    assert_empty(other)


def test_returning_users_asked_in_one_schedule_make_one_second_round_trip_between_them(
    tiny_model, sidecar
) -> None:
    """Four returning users whose first rounds another engine saved arrive at once, and schedule() asks
    each right away, no step between: the first one's answer misses where its tails were not asked,
    and before that second round trip the others' answers, come already, are read and sent again with
    the right chunk's tails. The sidecar answers them while the first waits; before, schedule() made
    a second round trip for each of them as it reached it."""
    url, client = sidecar
    other = make_scheduler(tiny_model, url)
    firsts = [prompt(90, 80 + i) for i in range(4)]  # chunks [0,32) [32,64), tails [64,80)
    for tokens in firsts:
        other.add_request(make_request(tokens))
    save_like_a_worker(client, run_to_end(other))
    s = make_scheduler(tiny_model, url)
    returning = [make_request(tokens + prompt(40, 90 + i)) for i, tokens in enumerate(firsts)]
    for request in returning:
        s.add_request(request)
    sidecar_answers_sent_lookups(s)(0)  # every answer is in its socket when schedule() asks
    counters: dict = {}
    outputs = run_to_end(s, counters=counters)
    assert [first_computed(outputs, r.request_id) for r in returning] == [80] * 4
    assert (counters.get("tail_lookups", 0), counters.get("lookups_guessed_again", 0)) == (1, 3)
    assert_empty(s)
    assert_empty(other)


def test_a_miss_takes_one_round_trip_with_its_tails_and_a_next_round_vllm_cached_too(
    tiny_model, sidecar
) -> None:
    """A lookup asks in the same round trip for the shorter tails of the chunk where the prompt most
    likely misses: the first vLLM has not computed. Before, every miss was two round trips."""
    url, client = sidecar
    s = make_scheduler(tiny_model, url, prefix_caching=True)
    round1 = prompt(90, 60)  # nothing stored: chunks [0,32) [32,64) and the tail [64,80) are saved
    s.add_request(make_request(round1))
    counters: dict = {}
    save_like_a_worker(client, run_to_end(s, counters=counters))
    assert (counters["lookups"], counters.get("tail_lookups", 0)) == (1, 0)
    # the next round: vLLM has [0,80) cached itself; kvpool is asked from the chunk [64,96) on
    s.add_request(make_request(round1 + prompt(40, 61)))
    counters.clear()
    outputs = run_to_end(s, counters=counters)
    assert first_computed(outputs) == 80 and not loads_of(outputs)
    assert (counters["lookups"], counters.get("tail_lookups", 0)) == (1, 0)
    # a prompt sharing round 1's first block only, on an engine that has none of it: the block prefix
    # of chunk [0,32) is found in the same round trip
    s = make_scheduler(tiny_model, url)
    s.add_request(make_request(round1[:16] + prompt(60, 62)))
    counters.clear()
    outputs = run_to_end(s, counters=counters)
    assert first_computed(outputs) == 16
    assert (counters["lookups"], counters.get("tail_lookups", 0)) == (1, 0)
    assert_empty(s)


def test_a_new_users_lookup_sent_on_arrival_stands_when_vllm_has_the_shared_system_prompt(
    tiny_model, sidecar
) -> None:
    """Every user's prompt starts with the same system prompt, which vLLM's own prefix cache keeps: a new
    user's lookup, sent on arrival when vLLM had computed nothing, asked the tails of chunk 0 down to
    its first block; asked with the system prompt's blocks computed, only the longer ones count, and
    the answer stands. Before, the shorter list made it ask for the tails again, a second round trip
    inside schedule() for every new user."""
    url, client = sidecar
    s = make_scheduler(tiny_model, url, prefix_caching=True, chunk_size=64)  # 4 blocks a chunk
    system = prompt(32, 90)  # two blocks
    first = system + prompt(56, 91)  # saves [0,64) with its block prefixes, and its tail [64,80)
    s.add_request(make_request(first))
    save_like_a_worker(client, run_to_end(s))
    counters: dict = {}
    s.add_request(make_request(system + prompt(56, 92)))
    outputs = run_to_end(s, counters=counters)
    # found on arrival: [0,32), the system prompt's block prefix of the first user's chunk; vLLM has it
    assert first_computed(outputs) == 32 and not loads_of(outputs)
    assert (counters["lookups"], counters["lookups_sent_on_arrival"]) == (1, 1)
    assert counters.get("tail_lookups", 0) == 0
    assert_empty(s)


def test_a_hybrid_models_miss_is_answered_on_arrival_with_its_windows_and_its_next_round_loads(
    tiny_model, sidecar
) -> None:
    """A hybrid model (a full-attention group and a 32-token sliding window): its lookup is sent on
    arrival too, asking the tails of the chunk it most likely misses at with the windows each needs,
    so a miss makes no round trip inside schedule(). Before, every one of its lookups was made in
    schedule(), and a miss was two round trips there. Its next round asks the chunk where round 1's
    tail was, with the windows, in the same round trip; on another engine, in a second one."""
    url, client = sidecar
    s = make_scheduler(tiny_model, url, sliding_window=32)
    round1 = prompt(90, 80)
    on_arrival = add_and_see_it_asked(s, client, make_request(round1))
    counters: dict = {}
    outputs = run_to_end(s, counters=counters)
    assert first_computed(outputs) == 0
    assert (counters["lookups"], counters["lookups_sent_on_arrival"]) == (1, 1)
    assert counters.get("tail_lookups", 0) == 0
    assert keys_asked(client) == on_arrival  # nothing asked inside schedule()
    save_like_a_worker(client, outputs)
    # the next round: [0,64) and round 1's tail [64,80) in the full-attention group, and the window
    # before 80 ([32,80)) in the windowed one
    for engine, tail_lookups in ((s, 0), (make_scheduler(tiny_model, url, sliding_window=32), 1)):
        engine.add_request(make_request(round1 + prompt(40, 81)))
        counters.clear()
        outputs = run_to_end(engine, counters=counters)
        assert first_computed(outputs) == 80
        assert (counters["lookups"], counters["lookups_sent_on_arrival"]) == (1, 1)
        assert counters.get("tail_lookups", 0) == tail_lookups
        assert_empty(engine)


def test_a_tail_is_not_reused_when_the_next_prompt_differs_inside_it(tiny_model, sidecar) -> None:
    url, client = sidecar
    s = make_scheduler(tiny_model, url)
    round1 = prompt(90, 5)
    s.add_request(make_request(round1))
    save_like_a_worker(client, run_to_end(s))
    other = round1[:70] + [t + 1 for t in round1[70:80]] + prompt(50, 6)  # differs inside [64,80)
    s.add_request(make_request(other))
    assert first_computed(run_to_end(s)) == 64
    assert_empty(s)


def test_a_prompt_sharing_only_the_first_blocks_of_a_chunk_loads_them_from_that_chunk(
    tiny_model, sidecar
) -> None:
    """Two prompts on one 80-token prefix, which ends inside a chunk: the second loads the prefix's
    block in that chunk from the first prompt's chunk, found by the key of its block prefix."""
    url, client = sidecar
    s = make_scheduler(tiny_model, url)
    shared = prompt(80, 7)
    s.add_request(make_request(shared + prompt(40, 8)))  # chunk [64,96) holds 16 shared tokens, 16 own
    save_like_a_worker(client, run_to_end(s))
    s.add_request(make_request(shared + prompt(50, 9)))
    outputs = run_to_end(s)
    assert first_computed(outputs) == 80  # not 64: the shared block of chunk [64,96) came back too
    (load,) = loads_of(outputs)
    # the last op names one block of the prefix; the worker finds the chunk holds two (see worker.py)
    assert [(op.chunk_blocks, len(op.block_ids)) for op in load.chunks] == [(2, 2), (2, 2), (1, 1)]
    assert_empty(s)


def test_a_prompt_that_ends_where_a_block_prefix_of_a_stored_chunk_ends_loads_it_all(
    tiny_model, sidecar
) -> None:
    """A prompt that is the start of a longer one, ending inside the longer one's chunk: its own tail
    span is that chunk's block prefix (review, item 14: it loaded one block less)."""
    url, client = sidecar
    s = make_scheduler(tiny_model, url)
    longer = prompt(100, 10)  # chunks [0,32) [32,64) [64,96), each saved with its block prefixes
    s.add_request(make_request(longer))
    save_like_a_worker(client, run_to_end(s))
    s.add_request(make_request(longer[:90]))  # its tail span [64,80) is [64,96)'s first block
    outputs = run_to_end(s)
    assert first_computed(outputs) == 80  # not 64
    assert_empty(s)


def test_a_load_that_fails_every_time_is_tried_once(tiny_model, sidecar) -> None:
    """A worker that can never load what the sidecar offers (a header it did not write, a chunk no
    worker can read): vLLM recomputes, and kvpool never offers that request a hit again."""
    url, client = sidecar
    s = make_scheduler(tiny_model, url)
    tokens = prompt(96, 21)
    store_chunks(s, client, tokens, 3)
    s.add_request(make_request(tokens))
    outputs = run_to_end(s, fail_loads=True)  # before: "requests did not finish", loading forever
    assert len(loads_of(outputs)) == 1
    assert_empty(s)


def test_a_request_waiting_for_room_is_not_looked_up_every_step(tiny_model, sidecar) -> None:
    """vLLM asks for the head waiting request every step while it does not fit; each ask was a round
    trip to the sidecar inside schedule()."""
    url, _ = sidecar
    s = make_scheduler(tiny_model, url, num_blocks=12)  # room for one of these requests at a time
    first, second = make_request(prompt(120, 22), max_tokens=40), make_request(prompt(120, 23))
    s.add_request(first)
    s.add_request(second)
    counters: dict = {}
    outputs = run_to_end(s, counters=counters)
    waited = next(i for i, so in enumerate(outputs) if second.request_id in so.num_scheduled_tokens)
    assert waited > 20  # it waited many steps
    assert counters["lookups"] <= 2 + waited // 16  # asked anew every 16 steps at most, not every step
    assert counters["lookups_reused"] >= waited - 2 - waited // 16
    assert_empty(s)


@pytest.mark.parametrize("sent_at_most", [32, 0])
def test_a_waiting_requests_aged_out_answer_is_renewed_at_the_steps_end_not_inside_schedule(
    tiny_model, sidecar, monkeypatch, sent_at_most: int
) -> None:
    """A request waiting for room reuses its answer for 16 steps or 1 s; then it asked again inside
    schedule(), a round trip to a sidecar that had idled through the step (3-5.5 ms a wave at
    concurrency 8, bench opt_out). Its lookup is now sent at the end of the step its answer aged out
    in and read in the next schedule(): past the first, no lookup waits there, and chunks stored while
    it waits are found. Where nothing can be sent ahead, the aged-out answer stands one step, not
    more: the request is asked in schedule() as before and still finds them."""
    from kvpool_connector import scheduler as kvpool_scheduler

    monkeypatch.setattr(kvpool_scheduler, "SENT_AT_MOST", sent_at_most)
    url, client = sidecar
    s = make_scheduler(tiny_model, url, num_blocks=12)  # room for one of these requests at a time
    waiting_tokens = prompt(120, 24)
    first, second = make_request(prompt(120, 25), max_tokens=40), make_request(waiting_tokens)
    s.add_request(first)
    s.add_request(second)

    def store_while_it_waits(step: int) -> None:
        if step == 5:
            store_chunks(s, client, waiting_tokens, 2)

    counters: dict = {}
    outputs = run_to_end(s, counters=counters, before_step=store_while_it_waits)
    waited = next(i for i, so in enumerate(outputs) if second.request_id in so.num_scheduled_tokens)
    assert waited > 20  # it waited more than one answer's 16 steps
    assert first_computed(outputs, second.request_id) == 64  # the chunks stored at step 5
    if sent_at_most:
        # none asked inside schedule(): a renewal whose answer came before the step ended and found the
        # chunks stored meanwhile is asked again ahead for the tails past them (lookups_guessed_again)
        assert lookups_asked_in_schedule(counters) == 0
        assert counters["lookups_renewed"] >= 1
    else:
        assert counters["lookups"] == lookups_asked_in_schedule(counters)  # nothing sent ahead
        assert counters["lookups"] <= 2 + waited // 16
    assert_empty(s)


def test_schedule_makes_no_socket_call_for_answers_that_came_during_the_step(tiny_model, sidecar) -> None:
    """A lookup's answer that came while a step ran is read as the step ends, and a waiting request's
    renewal is sent then too: schedule() makes no system call of kvpool's for them. In schedule(),
    right after vLLM hands a step's outputs to its output thread, each call let that thread take the
    GIL and took 1.5-2 ms at concurrency 8 where it took 0.01-0.06 ms between steps. Here: a request
    that arrives during a step and is asked in the next one, and a request that waits for room through
    three renewals and finds the chunks stored while it waited."""
    url, client = sidecar
    s = make_scheduler(tiny_model, url, num_blocks=16)  # room for the holder and the short one only
    # each of the other two prompts ends where its stored chunks do: a hit asks for no tail
    first, waiting_tokens, arriving_tokens = prompt(160, 26), prompt(80, 27), prompt(48, 28)
    store_chunks(s, client, arriving_tokens, 1)
    s.add_request(holder := make_request(first, max_tokens=60))
    arriving, waiting = make_request(arriving_tokens, max_tokens=1), make_request(waiting_tokens)

    def arrivals(step: int) -> None:
        if step == 0:  # as vLLM receives a request during the step: its lookup is sent
            s.add_request(arriving)
        if step == 2:
            s.add_request(waiting)
        if step == 5:
            store_chunks(s, client, waiting_tokens, 2)
        answers(step)

    answers = sidecar_answers_sent_lookups(s)
    calls = watch_schedule_for_socket_calls(s)
    counters: dict = {}
    outputs = run_to_end(s, counters=counters, during_step=arrivals)
    waited = next(i for i, so in enumerate(outputs) if waiting.request_id in so.num_scheduled_tokens)
    # asked two steps after it arrived, once the holder's prefill leaves it some of the step's budget
    assert [ld.req_id for ld in loads_of(outputs[:3])] == [arriving.request_id]
    assert waited > 3 * 16  # it waited through three renewals
    assert first_computed(outputs, arriving.request_id) == 32
    assert first_computed(outputs, waiting.request_id) == 64  # the chunks stored at step 5
    assert counters["lookups_renewed"] >= 3
    assert counters["lookups"] == counters["lookups_sent_on_arrival"] + counters["lookups_renewed"]
    # the first reads the lookup of the request that arrived right before it: no step ran in between
    assert [(i, c) for i, c in enumerate(calls) if c and i] == [], "schedule() called the sidecar"
    assert holder.request_id not in s.connector.scheduler.reqs
    assert_empty(s)


def test_a_prompt_sent_again_while_its_chunks_are_being_saved_waits_for_them(tiny_model, sidecar) -> None:
    """Saves finish on the workers' save threads after their step: a prompt sent again before the
    workers report them finished is not looked up (it would miss and compute everything) but waits,
    then loads what the first run saved."""
    url, client = sidecar
    s = make_scheduler(tiny_model, url)
    tokens = prompt(64, 40)  # two chunks, computed in one step
    s.add_request(make_request(tokens, max_tokens=1))
    outputs = []
    while s.has_unfinished_requests():  # the workers report no save finished
        outputs.append(so := s.schedule())
        s.update_from_output(so, model_output(s, so, saved_through=0))
    again = make_request(tokens, max_tokens=1)
    s.add_request(again)
    so = s.schedule()
    assert again.status == RequestStatus.WAITING and not so.scheduled_new_reqs
    assert (s.connector.scheduler.take_stats() or {}).get("lookups_deferred") == 1
    s.update_from_output(so, model_output(s, so, saved_through=0))
    save_like_a_worker(client, outputs)  # the save threads finish and say so
    so = s.schedule()
    s.update_from_output(so, model_output(s, so))
    later = run_to_end(s)
    assert first_computed([so, *later]) == 48  # loaded, not computed (63 tokens, aligned to the block)
    assert_empty(s)


def test_a_save_not_reported_finished_within_save_wait_ms_is_waited_for_no_more(tiny_model, sidecar) -> None:
    """The wait for this engine's own save is bounded by `save_wait_ms`: a save the workers never report
    finished (a hung sidecar) keeps a returning prompt waiting that long, then its lookup goes (a miss,
    here: nothing was stored) and the request computes everything."""
    url, _ = sidecar
    s = make_scheduler(tiny_model, url, save_wait_ms=3000)
    now = [1000.0]
    s.connector.scheduler._clock = lambda: now[0]
    tokens = prompt(64, 41)
    s.add_request(make_request(tokens, max_tokens=1))
    while s.has_unfinished_requests():  # the workers report no save finished
        so = s.schedule()
        s.update_from_output(so, model_output(s, so, saved_through=0))
    again = make_request(tokens, max_tokens=1)
    s.add_request(again)
    waited = []
    for seconds in (0.0, 1.5, 2.9, 3.1):  # past the 1 s default, inside the 3 s set
        now[0] = 1000.0 + seconds
        so = s.schedule()
        waited.append(not so.scheduled_new_reqs)
        s.update_from_output(so, model_output(s, so, saved_through=0))
    assert waited == [True, True, True, False]
    later = run_to_end(s)
    assert first_computed([so, *later]) == 0
    assert_empty(s)
