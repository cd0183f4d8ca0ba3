"""Scheduler half: chunk keys, one lookup per request, and which chunks each step loads and saves."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpool_sidecar.client import SentLookup, read_answered
from kvpool_sidecar.client_errors import SidecarError, SidecarTimeout

from .breaker import BREAKER_SECONDS, Breaker
from .common import ChunkOp, LoadSpec, SaveSpec
from .config import KVPoolConfig, sidecar_client
from .counters import Counts
from .keys import Extras, Namespace, chain, chunk_link, group_link, new_generation, rank_key, tail_links
from .kv_events import KVPoolEvents
from .logs import connector_logger
from .ratelimit import RateLimitedLog
from .request_inputs import Unkeyable, request_extras
from .spans import Span, align_down, decode_spans, prompt_spans
from .vllm_types import KVPoolMetadata, KVPoolSaveProgress

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = connector_logger(__name__)
SKIP_SAVE_PARAM = "kvpool.skip_save"
SKIP_LOAD_PARAM = "kvpool.skip_load"
# vLLM's null block (its block pool hands out block 0 as it): what a request's table holds where a
# sliding window let go of its blocks. Nothing is ever loaded into it or saved from it.
NULL_BLOCK = 0
# vLLM asks again every step for a waiting request that does not fit yet; its last answer stands for
# this many steps or seconds, whichever ends first (each ask is a round trip inside schedule())
REASK_STEPS = 16
REASK_SECONDS = 1.0
# A lookup sent on arrival stands through the step after the one running at arrival, however long
# (a CPU engine's prefill takes seconds), but never past this: an engine paused between steps.
SENT_STANDS_SECONDS = 10.0
# Lookups sent ahead and not read yet, at most: each holds a connection to the sidecar until
# schedule() asks. A burst past it waits its turn (_send_in_turn).
SENT_AT_MOST = 32
# Chunks this engine saved or found stored, at most (about 5 MB): where a prompt most likely misses,
# for the lookup to ask that chunk's shorter spans in the same round trip (_plan)
STORED_LINKS_AT_MOST = 1 << 15


@dataclass
class _Asked:
    """A lookup's answer for a request at `computed` tokens, made at step `step`, time `at`."""

    computed: int
    step: int
    at: float
    answer: tuple[int, bool]
    spans: list[Span]
    renewing: bool = False  # aged out, standing one more step while its renewal is sent


@dataclass
class _Plan:
    """A lookup's question: the prompt's spans up to `limit` and their links, the keys of their prefix,
    and the hits asked for in the same round trip where the prefix found ends at the chunk `guess`
    (longest first, each needing its group of keys)."""

    spans: list[Span]
    links: list[bytes]
    keys: list[str]
    limit: int
    guess: int
    hits: list[list[Span]]
    groups: list[list[str]]


@dataclass
class _Sent:
    """A plan sent to the sidecar ahead of schedule() (when vLLM received the request, or at the end of
    a step it waited through), whose answer is read as a step ends if it has come, else when vLLM
    asks."""

    plan: _Plan
    computed: int  # the request's num_computed_tokens it was planned for
    at: float
    step: int  # schedule() calls so far when it was sent (a renewal: its own step included)
    lookup: SentLookup
    stat: str  # counted when read: sent on arrival, or renewed at a step's end
    # the keys found by the lookup this one follows (_guess_again): it asks the tails alone
    found_keys: int | None = None

    def keys_found(self, answered: int) -> int:
        """The keys found of the plan's prefix, given the keys its answer found."""
        return answered if self.found_keys is None else self.found_keys


@dataclass
class _ReqState:
    request: Request
    extras: Extras | None = None  # what besides tokens its keys cover (None: tokens only)
    unkeyable: bool = False  # an input kvpool cannot key: never loaded, never saved
    links: list[bytes] = field(default_factory=list)  # chain links of full chunks, extended lazily
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    saved: set[Span] = field(default_factory=set)  # spans known to be in the sidecar
    # how many of its spans (_save_spec's list, in order of their ends) have been due: each is in
    # `saved` (or the request saves nothing), so a step looks only past them, not at every chunk of a
    # long prompt again, and not at a request whose every chunk has been due (_saves_ahead)
    spans_due: int = 0
    prompt_spans: list[Span] | None = None  # its prompt's chunks (_prompt_spans), made once
    lookup: tuple[int, list[Span]] | None = None  # (num_computed_tokens asked, hit spans)
    load: Span | None = None  # tokens to load in the request's next scheduled step
    loading: set[int] = field(default_factory=set)  # the blocks of its load in flight
    # A load of it failed: never offered again. A failure that repeats (a header the sidecar did not
    # write, a chunk the sidecar serves but no worker can load) would otherwise make vLLM recompute
    # and ask again, forever.
    load_failed: bool = False
    asked: _Asked | None = None  # the last lookup's answer while the request waits to be scheduled
    sent: _Sent | None = None  # its lookup, sent on arrival and not read yet

    def forget_saves(self, through: int = 0) -> None:
        """The spans ending after token `through` are to be saved again when due."""
        self.saved = {s for s in self.saved if s[1] <= through}
        self.spans_due = 0


class KVPoolScheduler:
    def __init__(
        self,
        cfg: KVPoolConfig,
        namespace: Namespace,
        block_size: int,
        clock: Callable[[], float] = time.monotonic,
        windows: Sequence[Callable[[int], int] | None] = (None,),
        events: KVPoolEvents | None = None,
        sync_loads: bool = False,
    ):
        self.cfg = cfg
        self.save_wait = cfg.save_wait_ms / 1000  # seconds: read at every step with saves in flight
        self.block_size = block_size
        # per KV cache group: with n tokens computed, the tokens whose blocks vLLM has freed (a
        # sliding window, chunked local attention), or None (full attention: it keeps every block)
        self.windows = list(windows)
        self.full_groups = [g for g, w in enumerate(self.windows) if w is None]
        self.windowed_groups = [g for g, w in enumerate(self.windows) if w is not None]
        # loads in the step (config.sync_loads); vLLM takes a load's failed blocks only from one group
        self.sync_loads = sync_loads and len(self.windows) == 1
        self.seed = namespace.seed()
        # every rank that stores a copy of each chunk: a hit means all of them have it
        self.ranks = namespace.ranks
        # After a lookup times out (the sidecar hung), lookups are misses without asking for a while:
        # a lookup runs inside vLLM's schedule(), so each one that waits out its timeout stalls every
        # request. A sidecar that is simply gone fails at once (connection refused): no breaker.
        self._breaker = Breaker(clock)
        self._clock = clock
        self._steps = 0  # schedule() calls so far
        self._warn = RateLimitedLog(log)
        # a connection for each lookup sent ahead, kept for the next: a burst sends SENT_AT_MOST at a time
        self.client = sidecar_client(cfg, control_connections=SENT_AT_MOST)
        self.reqs: dict[str, _ReqState] = {}
        self.stats = Counts()
        self.events = events  # None: the engine publishes no KV cache events (nothing is tracked)
        # Saves run on the workers' save threads (saver.py). The step of the newest save reading each
        # block, for the fence when vLLM hands the block out again; the chunks of saves the workers
        # have not reported finished (link -> step, time planned; oldest first), which a lookup waits for.
        self._reading: dict[int, int] = {}
        self._unsaved: dict[bytes, tuple[int, float]] = {}
        # The requests whose lookup was sent ahead and not taken by a lookup yet, whose load was
        # allocated in this schedule(), and whose load is in flight. A step looks at these, and at
        # the requests it schedules, never at every tracked one: at a batch of 256 that walk was
        # most of kvpool's time in a decode step (bench scheduler_batch).
        self._sent: dict[str, _ReqState] = {}
        self._loads: dict[str, _ReqState] = {}
        self._loading: dict[str, _ReqState] = {}
        self._renewals: list[_ReqState] = []  # waiting requests whose lookup is sent as the step ends
        # requests that arrived while SENT_AT_MOST lookups waited unread, oldest first, never asked
        self._to_send: dict[str, _ReqState] = {}
        # links of chunks this engine saved or a lookup found, oldest first (STORED_LINKS_AT_MOST)
        self._stored: dict[bytes, None] = {}

    # --- keys ------------------------------------------------------------------------------------

    def _link(self, st: _ReqState, span: Span) -> bytes:
        """The chain link of a stored span (a full chunk, or the prompt's partial tail)."""
        cs = self.cfg.chunk_size
        index = span[0] // cs
        tokens = st.request.all_token_ids
        if span[1] - span[0] < cs:  # partial tail: linked to the last full chunk, never cached
            prev = self._link_before(st, span[0])
            extra = st.extras(*span) if st.extras is not None else None
            return chunk_link(prev, tokens[span[0] : span[1]], extra)
        if len(st.links) <= index:
            start = st.links[-1] if st.links else None
            st.links += chain(
                self.seed,
                tokens[: (index + 1) * cs],
                cs,
                start=start,
                first_chunk=len(st.links),
                extras=st.extras,
            )
        return st.links[index]

    def _link_before(self, st: _ReqState, start: int) -> bytes:
        """The link a span at the chunk start `start` chains from: the previous chunk's, or the seed."""
        cs = self.cfg.chunk_size
        return self._link(st, (start - cs, start)) if start else self.seed

    def _links(self, st: _ReqState, spans: list[Span]) -> list[bytes] | None:
        """The links of `spans`, or None (and the request marked, counted) when it cannot be keyed."""
        if not st.unkeyable:
            try:
                return [self._link(st, s) for s in spans]
            except Unkeyable as e:
                st.unkeyable = True
                self.stats.add("unkeyable_requests")
                self._warn.warning(
                    "unkeyable",
                    "kvpool: request %s is neither loaded nor saved: %s",
                    st.request.request_id,
                    e,
                )
        return None

    def track(self, request: Request) -> None:
        """Starts tracking a request when vLLM receives it (so it saves even if never looked up), and
        sends its lookup: the sidecar answers while vLLM finishes the step it is running (or while it
        is paused), and the lookup in schedule() reads the answer instead of making the round trip.
        Behind a burst, it waits its turn (_send_in_turn)."""
        st = self._state(request)
        if self._to_send or len(self._sent) >= SENT_AT_MOST:
            self._to_send[request.request_id] = st
        else:
            self._send_ahead(st, 0, "lookups_sent_on_arrival")

    def _send_in_turn(self) -> None:
        """Sends the lookups of a burst of arrivals past SENT_AT_MOST, oldest first, as the lookups
        sent before them are read: as a step ends, and after the round trip of one schedule() reached
        first (its answer first, the next ones' behind it). Each was a round trip inside schedule():
        224 of a burst of 256 (bench scheduler_batch); now the next requests' answers come while
        schedule() works."""
        while self._to_send and len(self._sent) < SENT_AT_MOST:
            st = self._to_send.pop(next(iter(self._to_send)))
            if not self._send_ahead(st, 0, "lookups_sent_in_turn"):
                return  # the rest are asked in schedule()

    def _send_ahead(self, st: _ReqState, num_computed_tokens: int, stat: str) -> bool:
        """Sends the request's lookup now, to be read when schedule() next asks for it. False where it
        could not be sent (the lookups waiting unread are at their cap, the breaker is open, the
        sidecar did not take it); True where nothing needed asking, too."""
        if st.sent is not None or len(self._sent) >= SENT_AT_MOST or self._breaker.open:
            return False
        if not self._load_allowed(st.request):
            return True
        plan = self._plan(st, st.request, num_computed_tokens)
        return self._send_plan(st, plan, num_computed_tokens, stat) if isinstance(plan, _Plan) else True

    def _send_plan(
        self, st: _ReqState, plan: _Plan, num_computed_tokens: int, stat: str, found_keys: int | None = None
    ) -> bool:
        """Sends `plan`'s lookup, or with `found_keys` (its prefix found already) its tails alone."""
        keys, at = (plan.keys, plan.guess * self._per_chunk) if found_keys is None else ((), 0)
        try:
            sent = self.client.send_lookup(keys, at, plan.groups)
        except SidecarError:  # asked again, in schedule()
            return False
        if sent is None:  # control over HTTP: nothing is sent ahead
            return False
        st.sent = _Sent(plan, num_computed_tokens, self._clock(), self._steps, sent, stat, found_keys)
        self._sent[st.request.request_id] = st
        return True

    def _read_ahead(self) -> None:
        """Reads the answers of the lookups sent ahead that have come (one poll() that does not wait),
        and sends again those that guessed the wrong chunk (_guess_again)."""
        if self._sent:
            read_answered([st.sent.lookup for st in self._sent.values() if st.sent is not None])
            self._guess_again()

    def _guess_again(self) -> None:
        """Asks again, for the tails of the chunk where the prefix found ends, each lookup read ahead
        whose answer says it ends elsewhere than the chunk whose tails it asked: another engine saved
        the chunks (a router that does not follow prefixes sends most returning users to another pod
        than their last round's), or they were evicted. Only the tails are asked: the prefix is
        known. schedule() then reads one answer; before, it asked for those tails in a second round
        trip of its own (_saved_tail)."""
        per_chunk = self._per_chunk
        for st in list(self._sent.values()):
            sent = st.sent
            answer = sent.lookup.read_ahead_answer if sent is not None else None
            if sent is None or answer is None:
                continue
            found_keys = sent.keys_found(answer[0])
            links = sent.plan.links
            hits = self._hits(found_keys, per_chunk, links)  # and what the next plan guesses from
            if hits in (sent.plan.guess, len(links)):  # its tails were asked, or nothing missed
                continue
            plan = self._plan(st, st.request, sent.computed)
            if isinstance(plan, _Plan) and plan.guess != sent.plan.guess:
                self._forget_sent(st)
                self._send_plan(st, plan, sent.computed, "lookups_guessed_again", found_keys)

    def _state(self, request: Request) -> _ReqState:
        st = self.reqs.get(request.request_id)
        if st is None:
            st = self.reqs[request.request_id] = _ReqState(request, request_extras(request, self.block_size))
        return st

    # --- lookups ---------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        st = self._state(request)
        st.lookup = None
        in_turn = self._to_send.pop(request.request_id, None) is not None
        if st.load_failed or not self._load_allowed(request):
            return 0, False
        asked = st.asked
        if asked is not None and asked.computed != num_computed_tokens:  # vLLM's own hit grew
            asked = None
        if asked is not None and (self._fresh(asked) or self._renew(st, asked)):
            self.stats.add("lookups_reused")
        else:
            # before the round trip (or when the lookup was sent ahead): the answer is at most this old
            now = st.sent.at if st.sent is not None else self._clock()
            started = time.perf_counter()  # what kvpool costs vLLM's scheduler, hit or miss
            found, load_async = self._lookup(st, request, num_computed_tokens)
            if in_turn:  # schedule() reached a burst's lookups not sent yet: the next ones go now
                self._send_in_turn()
            self.stats.add("lookup_seconds", time.perf_counter() - started)
            if found is None:  # ask again next step, once the save it waits for has finished
                return None, False
            spans: list[Span] = st.lookup[1] if st.lookup is not None else []
            asked = st.asked = _Asked(num_computed_tokens, self._steps, now, (found, load_async), spans)
        if asked.answer[0]:
            st.lookup = (num_computed_tokens, asked.spans)
        return asked.answer

    def _fresh(self, asked: _Asked) -> bool:
        return self._steps - asked.step < REASK_STEPS and self._clock() - asked.at < REASK_SECONDS

    def _renew(self, st: _ReqState, asked: _Asked) -> bool:
        """Whether a waiting request's aged-out answer stands: two steps more, while its renewal is sent
        as this step ends (update_connector_output), answered during the next step, and read as that
        one ends, for the schedule() after it. Asking again here was a round trip inside schedule() to
        a sidecar that had been idle through a long step (3-5.5 ms on a 2-core VM). A renewal that
        could not be sent, or whose answer was not in its socket as the step after it ended, is asked
        or read in schedule(), as before."""
        if asked.renewing:  # its renewal was sent ahead unless nothing is out: read it, or ask
            return st.sent is not None and not st.sent.lookup.answered and self._steps == st.sent.step
        asked.renewing = True
        self._renewals.append(st)
        return True

    def _saving(self, links: list[bytes]) -> bool:
        """Whether a save of one of `links` planned in the last `save_wait_ms` is still running: a
        lookup that needs it waits for it, a step or two (saver.py)."""
        now = self._clock()
        return any(now - at < self.save_wait for _, at in filter(None, map(self._unsaved.get, links)))

    @property
    def _per_chunk(self) -> int:
        """Keys a chunk has in a lookup: every prefix group's, every rank's."""
        return self.ranks * len(self._prefix_groups)

    def _plan(self, st: _ReqState, request: Request, num_computed_tokens: int) -> _Plan | tuple[int, bool]:
        """What to ask the sidecar, or the answer when there is nothing to ask."""
        # a full-prompt hit still recomputes the last token: vLLM needs its logits
        limit = align_down(request.num_prompt_tokens - 1, self.block_size)
        spans = [s for s in self._prompt_spans(st) if s[0] < limit]
        if limit <= num_computed_tokens or not spans or not spans[-1][1] > num_computed_tokens:
            return 0, False
        links = self._links(st, spans)
        if links is None:
            return 0, False
        # chunk by chunk, every prefix group's and rank's key: the prefix found, in whole chunks, is
        # what all of them have
        keys = [k for link in links for k in self._prefix_keys(link)]
        # A miss's shorter tails are asked in the same round trip, for the chunk the prompt most likely
        # misses at: the first one vLLM has not computed itself and this engine has not seen stored (a
        # returning user's, where their last round's partial tail is). A miss elsewhere asks for its
        # tails again. A hybrid model's hits there need their windows too.
        guess = next(i for i, s in enumerate(spans) if s[1] > num_computed_tokens)
        while guess < len(spans) - 1 and links[guess] in self._stored:
            guess += 1
        if self._windowed_hybrid:
            hits = self._windowed_candidates(spans, guess, num_computed_tokens, limit)
            groups = self._window_needs(st, hits, guess, limit)
        else:
            tails, groups = self._tail_groups(st, spans[guess], num_computed_tokens, limit)
            hits = [[*spans[:guess], tail] for tail in tails]
        return _Plan(spans, links, keys, limit, guess, hits, groups)

    def _seen_stored(self, links: Sequence[bytes]) -> None:
        """Remembers chunks as stored (saved by this engine, or found by a lookup), newest last."""
        stored = self._stored
        for link in links:
            stored.pop(link, None)
            stored[link] = None
        while len(stored) > STORED_LINKS_AT_MOST:
            del stored[next(iter(stored))]

    @property
    def _windowed_hybrid(self) -> bool:
        """A hybrid model with windowed groups: a hit needs its windows too (_windowed_hit)."""
        return bool(self.full_groups and self.windowed_groups)

    def _ask(self, plan: _Plan, sent: _Sent | None) -> tuple[int, int | None, bool]:
        """lookup_then_first_whole for `plan`, and whether its tails were asked: the answer to the
        lookup sent on arrival where it asked the same keys, else a round trip now. That answer stands
        for REASK_SECONDS, and through the step running at arrival and the one after it however long
        they take (up to SENT_STANDS_SECONDS): it is what vLLM would have been told at arrival, and a
        CPU engine's prefill steps of 1-2 s made every request that waited one out ask again inside
        schedule(). (A chunk evicted since is a failed load, recomputed; one this engine is saving
        defers the lookup, in _look.)
        The lookup sent on arrival asked the hits past the chunk it guessed for what vLLM had computed
        then. Where vLLM's own hit has grown since (a shared system prompt's blocks, cached by vLLM)
        those asked now are the first of them, longest first, and the longest found stands if it is
        one of them; where it moved the guessed chunk, only the prefix found stands (a chunk's keys do
        not depend on how much vLLM computed)."""
        if sent is not None:
            age = self._clock() - sent.at
            fresh = age < REASK_SECONDS or (self._steps <= sent.step + 1 and age < SENT_STANDS_SECONDS)
            if sent.plan.keys == plan.keys and fresh:
                self.stats.add(sent.stat)
                found_keys, found = sent.lookup.answer()
                found_keys = sent.keys_found(found_keys)
                n = len(plan.groups)
                asked = sent.plan.guess == plan.guess and sent.plan.groups[:n] == plan.groups
                return found_keys, found if found is not None and found < n else None, asked
            sent.lookup.drop()
        at = plan.guess * self._per_chunk
        found_keys, found = self.client.lookup_then_first_whole(plan.keys, at, plan.groups)
        return found_keys, found, True

    def _lookup(self, st: _ReqState, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        sent = self._take_sent(st)
        try:
            return self._look(st, request, num_computed_tokens, sent)
        finally:
            if sent is not None:  # unless its answer was read: nothing asked, or a stale answer
                sent.lookup.drop()

    def _look(
        self, st: _ReqState, request: Request, num_computed_tokens: int, sent: _Sent | None
    ) -> tuple[int | None, bool]:
        # the plan sent ahead is this one where vLLM has computed as much as when it was sent
        plan = (
            sent.plan
            if sent is not None and sent.computed == num_computed_tokens
            else self._plan(st, request, num_computed_tokens)
        )
        if not isinstance(plan, _Plan):
            return plan
        spans, links, limit = plan.spans, plan.links, plan.limit
        ahead = [link for s, link in zip(spans, links, strict=True) if s[1] > num_computed_tokens]
        if self._unsaved and self._saving(ahead):
            self.stats.add("lookups_deferred")
            return None, False
        if self._breaker.open:
            self.stats.add("lookups_skipped")
            return 0, False
        per_chunk = self._per_chunk
        self.stats.add("lookups")
        try:
            found_keys, found, tails_asked = self._ask(plan, sent)
            hits = self._hits(found_keys, per_chunk, links)
            hit_spans = spans[:hits]
            tail: Span | None = None
            if found_keys == plan.guess * per_chunk and tails_asked:  # the hits past it were asked with it
                if found is not None:
                    hit_spans = list(plan.hits[found])
                elif self._windowed_hybrid:  # the prefix alone lacks its windows
                    hit_spans = []
            elif self._windowed_hybrid:  # a hit elsewhere: its windows, in a second round trip
                hit_spans = self._windowed_hit(st, spans, hits, num_computed_tokens, limit)
            elif hits < len(spans):
                tail = self._saved_tail(st, spans[hits], num_computed_tokens, limit)
            if tail:
                hit_spans.append(tail)
        except SidecarTimeout as e:
            self.stats.add("lookup_errors")
            self._breaker.trip()
            self._warn.warning("lookup", "kvpool lookup timed out: misses for %.0f s: %s", BREAKER_SECONDS, e)
            return 0, False
        except SidecarError as e:  # an unreachable sidecar is a miss
            self.stats.add("lookup_errors")
            self._warn.warning("lookup", "kvpool lookup failed, treating as a miss: %s", e)
            return 0, False
        end = min(hit_spans[-1][1], limit) if hit_spans else 0
        if end <= num_computed_tokens:
            return 0, False
        st.lookup = (num_computed_tokens, hit_spans)
        # Asynchronously, the request computes nothing until every rank has loaded and checked its
        # chunks and vLLM has taken back the blocks that failed; in the step, vLLM drops the step's
        # output of every request over a failed block and recomputes from it (loader.py).
        return end - num_computed_tokens, not self.sync_loads

    def _hits(self, found_keys: int, per_chunk: int, links: list[bytes]) -> int:
        """Whole chunks found, from the keys found (each chunk is `per_chunk` keys)."""
        hits = max(0, min(found_keys // per_chunk, len(links)))
        self._seen_stored(links[:hits])
        if hits < len(links):
            self._stored.pop(links[hits], None)
            if self.events is not None:  # an announced chunk may be gone
                self.events.gone(links[hits], self._prefix_groups)
        return hits

    def _keys(self, link: bytes, group: int) -> list[str]:
        """Every rank's key of one group's part of a chunk."""
        part = group_link(link, group)
        return [rank_key(part, r) for r in range(self.ranks)]

    @property
    def _prefix_groups(self) -> list[int]:
        """The groups a hit needs from the prompt's start: the full-attention ones (a model whose
        every layer is windowed is held to the same rule: a hit is a stored prefix, as before HMA)."""
        return self.full_groups or self.windowed_groups

    def _prefix_keys(self, link: bytes) -> list[str]:
        return [k for g in self._prefix_groups for k in self._keys(link, g)]

    def _tails(self, missed: Span, num_computed_tokens: int, limit: int) -> list[Span]:
        """Shorter spans at the start of the first missed chunk, longest first, that would load
        something: an earlier prompt may have saved one as its partial tail (block-granular reuse:
        the next round of a conversation is longer than the last, so its chunk there has another key),
        or as a block prefix of a chunk. A partial span itself comes first: it may be such a block
        prefix (this prompt is the start of a longer one), which only first_whole finds."""
        bs = self.block_size
        first_end = missed[1] if missed[1] - missed[0] < self.cfg.chunk_size else missed[1] - bs
        ends = range(first_end, missed[0], -bs)
        return [(missed[0], e) for e in ends if min(e, limit) > num_computed_tokens]

    def _tail_groups(
        self, st: _ReqState, missed: Span, num_computed_tokens: int, limit: int
    ) -> tuple[list[Span], list[list[str]]]:
        """`_tails` and the keys each needs (none where the request cannot be keyed)."""
        tails = self._tails(missed, num_computed_tokens, limit)
        links = self._tail_links(st, missed[0], tails) if tails else None
        return tails, [self._prefix_keys(link) for link in links or []]

    def _tail_links(self, st: _ReqState, start: int, tails: list[Span]) -> list[bytes] | None:
        """The links of `tails`, spans from the chunk start `start`: in one pass over their tokens
        where nothing but the tokens enters the keys (a request with extra inputs has them per span)."""
        if st.extras is not None:
            return self._links(st, tails)
        tokens = st.request.all_token_ids[start : max(end for _, end in tails)]
        return tail_links(self._link_before(st, start), tokens, [end - start for _, end in tails])

    def _saved_tail(self, st: _ReqState, missed: Span, num_computed_tokens: int, limit: int) -> Span | None:
        """The longest of `_tails` that is stored. One lookup."""
        tails, groups = self._tail_groups(st, missed, num_computed_tokens, limit)
        if not groups:
            return None
        found = self._ask_tails(groups)
        return None if found is None else tails[found]

    def _ask_tails(self, groups: list[list[str]]) -> int | None:
        """A lookup's second round trip, inside schedule(): the first of `groups` stored whole. First,
        the lookups sent ahead whose answers have come are read, and those that guessed the wrong chunk
        too go again (_guess_again): the sidecar answers them while this one waits, where each was a
        round trip of its own as vLLM reached it (a burst of returning users whose chunks another pod
        saved: one second round trip, not one each)."""
        self._read_ahead()
        self.stats.add("tail_lookups")
        return self.client.first_whole(groups)

    def _windowed_hit(
        self, st: _ReqState, spans: list[Span], hits: int, num_computed_tokens: int, limit: int
    ) -> list[Span]:
        """The longest hit whose windowed groups have their window: a sliding-window layer needs only
        the blocks inside its window before the hit's end (vLLM gives the null block for the rest),
        so a hit is every full-attention group's chunks up to its end (the first `hits` spans, or a
        partial tail after them) and each windowed group's chunks that reach into that window. One
        lookup over every candidate end, longest first (vLLM's own hybrid lookup does the same)."""
        candidates = self._windowed_candidates(spans, hits, num_computed_tokens, limit)
        needs = self._window_needs(st, candidates, hits, limit)
        if not needs:
            return []
        found = self._ask_tails(needs)
        return [] if found is None else candidates[found]

    def _windowed_candidates(
        self, spans: list[Span], hits: int, num_computed_tokens: int, limit: int
    ) -> list[list[Span]]:
        """The hits a hybrid model may have where the prefix found is `hits` chunks, longest first: that
        prefix and a tail of the chunk after it, then shorter prefixes, down to what vLLM computed. The
        lookup asks them in its own round trip for the chunk it guesses (_plan), as a dense model's
        asks its tails."""
        tails = self._tails(spans[hits], num_computed_tokens, limit) if hits < len(spans) else []
        candidates = [[*spans[:hits], tail] for tail in tails]
        return candidates + [
            spans[:k] for k in range(hits, 0, -1) if min(spans[k - 1][1], limit) > num_computed_tokens
        ]

    def _window_needs(
        self, st: _ReqState, candidates: list[list[Span]], hits: int, limit: int
    ) -> list[list[str]]:
        """Each candidate hit's keys past the prefix of `hits` chunks a lookup found: its partial tail's
        in the prefix groups, and each windowed group's where its chunks reach into that group's window
        before the hit's end. Nothing where the request cannot be keyed."""
        needs: list[list[str]] = []
        for c in candidates:
            links = self._links(st, c)
            if links is None:
                return []
            end = min(c[-1][1], limit)
            keys = self._prefix_keys(links[-1]) if len(c) > hits else []
            for g, window in enumerate(self.windows):
                if window is not None:
                    skipped = align_down(window(end), self.block_size)
                    keys += [
                        k
                        for s, link in zip(c, links, strict=True)
                        if s[1] > skipped
                        for k in self._keys(link, g)
                    ]
            needs.append(keys)
        return needs

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        st = self._state(request)
        st.asked = None  # scheduled: its next wait asks anew
        self._forget_sent(st)  # a renewal sent while it waited
        if num_external_tokens == 0:  # nothing to load (also the second call after an async load)
            return
        # An asynchronous load's request is not scheduled while it loads, so its blocks come from
        # here, not from the step's scheduled requests.
        st.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        if st.lookup is None:  # vLLM offers only what we matched; never load without a lookup
            self._warn.warning(
                "no-lookup",
                "kvpool: %d external tokens for %s without a lookup",
                num_external_tokens,
                request.request_id,
            )
            return
        start, hit_spans = st.lookup
        st.load = (start, start + num_external_tokens)
        self._loads[request.request_id] = st
        st.saved.update(hit_spans)  # already stored: never saved again
        if self.events is not None and (links := self._links(st, hit_spans)) is not None:
            for span, link in zip(hit_spans, links, strict=True):  # found: kvpool holds them
                self.events.hold(request, span, link, self._prefix_groups)
        self.stats.add("hit_tokens", num_external_tokens)

    # --- per-step metadata -----------------------------------------------------------------------

    def build_connector_meta(self, so: SchedulerOutput) -> KVPoolMetadata:
        self._steps += 1
        meta = KVPoolMetadata(idle=so.total_num_scheduled_tokens == 0, step=self._steps)
        for req_id, waiting in self._loads.items():  # loads allocated in this schedule()
            spec = self._load_spec(waiting)
            meta.loads.append(spec)
            waiting.loading = {b for op in spec.chunks for b in op.block_ids}
            waiting.load = None
            if waiting.loading:
                self._loading[req_id] = waiting
        self._loads.clear()
        if self._reading:
            reused = [self._reading.pop(b) for b in self._handed_out(so, meta.loads) if b in self._reading]
            meta.fence = max(reused, default=0)
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            if (st := self.reqs.get(new.req_id)) is not None:
                st.block_ids = [list(ids) for ids in new.block_ids]
                computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if (st := self.reqs.get(req_id)) is None:
                continue
            new_ids = cached.new_block_ids[i]
            # after preemption, or with none kept yet: the full lists
            if req_id in cached.resumed_req_ids or not st.block_ids:
                st.block_ids = [list(ids) for ids in new_ids] if new_ids else []
            elif new_ids:
                for old, ids in zip(st.block_ids, new_ids, strict=True):
                    old += ids
            if self._saves_ahead(st):
                computed[req_id] = cached.num_computed_tokens[i]
        for req_id, num_computed in computed.items():
            st = self.reqs[req_id]
            end = num_computed + so.num_scheduled_tokens.get(req_id, 0)
            if (save := self._save_spec(st, end, num_computed)) is not None:
                meta.saves.append(save)
        for save in meta.saves:
            for op in save.chunks:
                self._reading.update(dict.fromkeys(op.block_ids, self._steps))
        if self.events is not None:
            self.events.planned()
        return meta

    def _handed_out(self, so: SchedulerOutput, loads: list[LoadSpec]) -> set[int]:
        """The blocks vLLM handed out for this step, which it may write: new requests' blocks past
        their prefix-cache hit, running and resumed requests' new blocks, the blocks loads fill."""
        bs = self.block_size
        out = {b for spec in loads for op in spec.chunks for b in op.block_ids}
        for new in so.scheduled_new_reqs:
            for ids in new.block_ids:
                out.update(ids[new.num_computed_tokens // bs :])
        for new_ids in so.scheduled_cached_reqs.new_block_ids:
            for ids in new_ids or ():
                out.update(ids)
        return out

    def _ops(self, st: _ReqState, spans: list[Span], clip: Span) -> list[ChunkOp]:
        bs = self.block_size
        ops = []
        for s in spans:
            lo, hi = max(s[0], clip[0]), min(s[1], clip[1])
            if hi <= lo:
                continue
            for g, group_ids in enumerate(st.block_ids):
                # a load may start mid-chunk (behind vLLM's own prefix hit) or stop before the chunk's
                # end, and skips the blocks out of a sliding window (the null block: never read)
                ids = group_ids[lo // bs : hi // bs]
                live = len(ids) - next((i for i, b in enumerate(reversed(ids)) if b == NULL_BLOCK), len(ids))
                if live < len(ids):
                    ops.append(
                        ChunkOp(
                            group_link(self._link(st, s), g),
                            (s[1] - s[0]) // bs,
                            ids[live:],
                            first_block=(lo - s[0]) // bs + live,
                            group=g,
                        )
                    )
        return ops

    def _load_spec(self, st: _ReqState) -> LoadSpec:
        assert st.lookup is not None and st.load is not None
        return LoadSpec(st.request.request_id, self._ops(st, st.lookup[1], st.load), self.sync_loads)

    def _load_allowed(self, request: Request) -> bool:
        # vLLM's own flag: a request that must compute every prompt token (prompt logprobs), which
        # vLLM gives no cached token even after a lookup: asking would only cost the round trip
        if getattr(request, "skip_reading_prefix_cache", False):
            return False
        params = request.kv_transfer_params or {}
        return not params.get(SKIP_LOAD_PARAM, False)

    def _save_allowed(self, request: Request) -> bool:
        limit = self.cfg.priority_limit
        if limit is not None and request.priority > limit:
            return False
        params = request.kv_transfer_params or {}
        return not params.get(SKIP_SAVE_PARAM, False)

    def _in_window(self, st: _ReqState, span: Span, computed_before: int, group: int) -> bool:
        """Whether every block of `span` still holds its tokens' KV in this step: none of them freed by a
        sliding window when vLLM scheduled it (then possibly handed to another request, which writes it
        in this very step) and none the null block (out of the window of a prefix hit)."""
        bs = self.block_size
        first, end = span[0] // bs, span[1] // bs
        blocks = st.block_ids[group][first:end] if group < len(st.block_ids) else []
        window = self.windows[group]
        return (
            (window is None or first >= window(computed_before) // bs)
            and len(blocks) == end - first
            and NULL_BLOCK not in blocks
        )

    def _prompt_spans(self, st: _ReqState) -> list[Span]:
        """The request's prompt chunks, made once: the lookups and every step's save plan use them."""
        if st.prompt_spans is None:
            st.prompt_spans = prompt_spans(st.request.num_prompt_tokens, self.cfg, self.block_size)
        return st.prompt_spans

    def _saves_ahead(self, st: _ReqState) -> bool:
        """Whether a chunk of the request can still come due to be saved: one of its prompt's, or (with
        save_decode_cache) of what it generates. A decode step plans nothing for the others."""
        return self.cfg.save_decode_cache or st.prompt_spans is None or st.spans_due < len(st.prompt_spans)

    def _save_spec(self, st: _ReqState, computed_end: int, computed_before: int) -> SaveSpec | None:
        """Chunks whose tokens all have KV in the paged buffer once this step has run."""
        request = st.request
        spans = self._prompt_spans(st)
        if not self._save_allowed(request):
            st.spans_due = len(spans)  # it saves nothing
            return None
        if self.cfg.save_decode_cache:
            spans = spans + decode_spans(request.num_tokens, request.num_prompt_tokens, self.cfg)
        due = st.spans_due
        while due < len(spans) and spans[due][1] <= computed_end:
            due += 1
        todo = [s for s in spans[st.spans_due : due] if s not in st.saved]
        st.saved.update(todo)  # saved now, or never: a block out of the window never comes back
        st.spans_due = due
        if not todo or (links := self._links(st, todo)) is None:
            return None
        bs = self.block_size
        ops = []
        now = self._clock()
        self._seen_stored(links)
        for s, link in zip(todo, links, strict=True):
            self._unsaved.pop(link, None)  # to the end: the dict stays in planning order
            self._unsaved[link] = (self._steps, now)
            groups = [g for g in range(len(self.windows)) if self._in_window(st, s, computed_before, g)]
            # its block prefixes' links, for a later prompt that shares only part of it: hashed in one
            # pass over its tokens (each from the chunk's start was 7.5 times the tokens in a chunk)
            heads = [(s[0], end) for end in range(s[0] + bs, s[1], bs)]
            prefixes = (self._tail_links(st, s[0], heads) if heads and groups else None) or []
            ops += [
                ChunkOp(
                    group_link(link, g),
                    (s[1] - s[0]) // bs,
                    st.block_ids[g][s[0] // bs : s[1] // bs],
                    prefixes=[group_link(p, g) for p in prefixes],
                    group=g,
                )
                for g in groups
            ]
            if self.events is not None:
                self.events.hold(request, s, link, groups)
        return SaveSpec(request.request_id, request.priority, ops) if ops else None

    # --- worker results, request end -------------------------------------------------------------

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._talk_between_steps()
        if self._unsaved:
            progress = getattr(output, "kv_connector_worker_meta", None)
            through = progress.saved_through if isinstance(progress, KVPoolSaveProgress) else 0
            now = self._clock()
            # in planning order, so the finished and the expired are a prefix: no walk over the rest
            while self._unsaved:
                link, (step, at) = next(iter(self._unsaved.items()))
                if step > through and now - at < self.save_wait:
                    break
                del self._unsaved[link]
        bad = set(getattr(output, "invalid_block_ids", None) or ())
        # a hybrid model's failed loads come as whole requests (block ids are per group there): vLLM
        # recomputes them from the start, and their chunks are saved again
        failed = set(getattr(output, "failed_recving", None) or ())
        # a load's failed blocks come in the step that reports it finished (loader.py), or in the
        # step it ran in
        ended = getattr(output, "finished_recving", None) or ()
        if self.sync_loads:
            ended = list(self._loading)
        for req_id in ended:
            self._loading.pop(req_id, None)
            if (st := self.reqs.get(req_id)) is not None:
                if st.loading & bad or req_id in failed:
                    st.load_failed = True
                    self.stats.add("failed_load_requests")
                if req_id in failed:
                    st.forget_saves()
                st.loading = set()
        if not bad:
            return
        # the step that failed to load also skipped that request's saves; forget them so the
        # recomputed chunks are saved again
        for st in self.reqs.values():
            first_bad = next(
                (i for i, b in enumerate(st.block_ids[0] if st.block_ids else []) if b in bad), None
            )
            if first_bad is not None:
                st.forget_saves(first_bad * self.block_size)

    def _talk_between_steps(self) -> None:
        """Reads the lookups' answers that came during the step, and sends the renewals schedule() chose
        (_renew), so that schedule() makes no system call of kvpool's when it can be helped. vLLM runs
        this before it hands the step's outputs to its output thread; in schedule(), right after, any
        system call let that thread take the GIL, and each took 1.5-2 ms at concurrency 8
        (bench/results/c8-step-trace-2026-12-04.txt) where the same call took 0.01-0.06 ms here."""
        self._read_ahead()
        for st in self._renewals:  # those still waiting (update_state_after_alloc clears `asked`)
            if st.asked is not None and st.asked.renewing and self.reqs.get(st.request.request_id) is st:
                self._send_ahead(st, st.asked.computed, "lookups_renewed")
        self._renewals.clear()
        self._send_in_turn()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        st = self.reqs.pop(request.request_id, None)
        if st is not None:
            self._forget_sent(st)
            self._to_send.pop(request.request_id, None)
            self._loads.pop(request.request_id, None)
            self._loading.pop(request.request_id, None)
        # its blocks may be freed now: a save still reading one is fenced when vLLM hands it out again
        return False, None

    def reset_cache(self) -> bool:
        """vLLM reset its caches (reset_prefix_cache(reset_connector=True): an RL weight sync, new
        weights loaded in place): what this engine saved may be KV of the old weights. A new
        generation in the seed makes every chunk saved before unreachable at once, on every key; the
        sidecar's LRU ages them out. Pods that did not reset keep their own keys."""
        self.seed = new_generation(self.seed)
        self._stored.clear()
        if self.events is not None:
            self.events.reset()
        for st in self.reqs.values():
            st.links.clear()
            st.forget_saves()
            st.lookup = None
            self._forget_sent(st)  # it asked for the old generation's keys
        log.info("kvpool: cache reset: chunks saved before are never loaded by this engine again")
        return True

    def take_stats(self) -> dict[str, float] | None:
        return self.stats.take()

    def take_events(self) -> list[KVCacheEvent]:
        return self.events.take() if self.events is not None else []

    def _take_sent(self, st: _ReqState) -> _Sent | None:
        """The request's lookup sent on arrival, now the caller's to read or drop."""
        sent, st.sent = st.sent, None
        self._sent.pop(st.request.request_id, None)
        return sent

    def _forget_sent(self, st: _ReqState) -> None:
        sent = self._take_sent(st)
        if sent is not None:
            sent.lookup.drop()

    def shutdown(self) -> None:
        for st in self.reqs.values():
            self._forget_sent(st)
        self.client.close()
