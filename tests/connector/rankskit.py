"""The engine's worker side for the real 0.33 Scheduler tests: real KVPoolWorkers, one per tensor
parallel rank, on a real sidecar, their outputs combined by vLLM's own KVOutputAggregator.

The forward is played by a recurrence that has what matters of attention after an all-reduce: the KV
a rank computes for a token is a digest of the token and of every rank's KV of the token before it,
read from the paged caches. So KV computed over a block that was never loaded, on any rank, differs
from a clean run's; a clean recompute of every stored chunk finds any chunk that holds such KV.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field

import torch
from schedkit import BS, CHUNK
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from kvpool_connector.config import KVPoolConfig
from kvpool_connector.keys import rank_key
from kvpool_connector.vllm_types import KVPoolSaveProgress
from kvpool_connector.worker import KVPoolWorker
from kvpool_sidecar.client import SidecarClient

SAMPLED = 7  # every step samples this token


def _digest(*values: int) -> int:
    h = hashlib.blake2b(repr(values).encode(), digest_size=7)
    return int.from_bytes(h.digest(), "little")


def clean_kv(tokens: list[int], ranks: int) -> list[list[int]]:
    """[rank][position]: the KV a clean run computes for `tokens`."""
    kv = [[0] * len(tokens) for _ in range(ranks)]
    for p, tok in enumerate(tokens):
        before = [kv[r][p - 1] if p else 0 for r in range(ranks)]
        for r in range(ranks):
            kv[r][p] = _digest(r, tok, *before)
    return kv


@dataclass
class _Saved:
    key: str
    rank: int
    tokens: list[int]
    start: int  # the chunk's first token


@dataclass
class Ranks:
    """`ranks` workers on one sidecar, each with one layer of [num_blocks, BS] int64 'KV'."""

    scheduler: Scheduler
    url: str
    ranks: int = 2
    num_blocks: int = 200
    workers: list[KVPoolWorker] = field(init=False)
    caches: list[torch.Tensor] = field(init=False)
    saved: list[_Saved] = field(default_factory=list)
    logits: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # per prompt, per step

    def __post_init__(self) -> None:
        cfg = KVPoolConfig(sidecar_url=self.url, chunk_size=CHUNK)
        self.workers = [KVPoolWorker(cfg, rank=r) for r in range(self.ranks)]
        self.caches = [torch.zeros(self.num_blocks, BS, dtype=torch.int64) for _ in range(self.ranks)]
        for w, cache in zip(self.workers, self.caches, strict=True):
            w.register_kv_caches([("layer0", cache)])
        self.aggregator = KVOutputAggregator(expected_finished_count=self.ranks)

    def _blocks(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def _kv(self, r: int, blocks: list[int], p: int) -> int:
        return int(self.caches[r][blocks[p // BS], p % BS])

    def _forward(self, so) -> None:
        """Computes the KV of every token scheduled in `so`, on every rank, from the caches."""
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            blocks = self._blocks(req_id)
            end = req.num_computed_tokens  # schedule() has already counted this step's tokens
            tokens = self.tokens(req)
            for p in range(end - n, end):
                before = [self._kv(r, blocks, p - 1) if p else 0 for r in range(self.ranks)]
                for r in range(self.ranks):
                    self.caches[r][blocks[p // BS], p % BS] = _digest(r, tokens[p], *before)
            if end >= req.num_tokens:  # the step samples from every rank's KV of its last token
                last = [self._kv(r, blocks, end - 1) for r in range(self.ranks)]
                self.logits.setdefault(tuple(req.prompt_token_ids or ()), []).append(_digest(*last))

    @staticmethod
    def tokens(req) -> list[int]:
        """The request's tokens, a sampled one being SAMPLED (async scheduling has no value yet)."""
        return list(req.prompt_token_ids) + [SAMPLED] * (req.max_tokens + 1)

    def _record_saves(self, so) -> None:
        for save in so.kv_connector_metadata.saves:
            req = self.scheduler.requests[save.req_id]
            blocks = self._blocks(save.req_id)
            for op in save.chunks:
                start = blocks.index(op.block_ids[0]) * BS
                for r in range(self.ranks):
                    self.saved.append(_Saved(rank_key(op.link, r), r, self.tokens(req), start))

    def execute(self, so) -> ModelRunnerOutput:
        """One step on every rank, as the model runner does it: loads started, the forward, saves
        finished, then what finished and what failed, combined over the ranks."""
        meta = so.kv_connector_metadata
        for w in self.workers:
            w.begin_step(meta)  # handle_preemptions: before anything writes a block
            w.start_load(meta)
        self._forward(so)
        self._record_saves(so)
        outputs: list[ModelRunnerOutput | None] = []
        for w in self.workers:
            w.finish_step(meta)
            finished = w.get_finished()
            kv = KVConnectorOutput(
                finished_recving=finished or None,
                invalid_block_ids=w.take_load_errors(),
                kv_connector_worker_meta=KVPoolSaveProgress(w.saved_through()),
            )
            outputs.append(self._output(so, kv))
        out = self.aggregator.aggregate(outputs)
        assert out is not None
        return out

    def _output(self, so, kv: KVConnectorOutput) -> ModelRunnerOutput:
        req_ids = list(so.num_scheduled_tokens)
        requests = self.scheduler.requests
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            # a step that ends inside the prompt (chunked prefill) samples nothing
            sampled_token_ids=[
                [SAMPLED] if requests[r].num_computed_tokens >= requests[r].num_tokens else []
                for r in req_ids
            ],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=kv,
        )

    def run(self, before_execute=None, lag: int = 0, max_steps: int = 20_000) -> list:
        """Steps until every request finished, and their saves too (they run on the workers' save
        threads). lag=1 plays async scheduling: step N+1 is scheduled before step N's output is seen.
        before_execute(so) runs after a step is scheduled (faults)."""
        outputs: list[SchedulerOutput] = []
        pending: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests() and not pending:
                assert all(w.saver.drain(30) for w in self.workers), "saves did not finish"
                return outputs
            so = self.scheduler.schedule()
            outputs.append(so)
            if before_execute is not None:
                before_execute(so)
            pending.append((so, self.execute(so)))
            while len(pending) > lag or (pending and not self.scheduler.has_unfinished_requests()):
                self.scheduler.update_from_output(*pending.popleft())
        raise AssertionError("requests did not finish")

    def wrong_chunks(self, client: SidecarClient) -> list[str]:
        """Every chunk saved and still stored whose bytes differ from a clean recompute."""
        wrong = []
        for s in self.saved:
            data = client.get(s.key)
            if data is None:
                continue
            kv = clean_kv(s.tokens[: s.start + CHUNK], self.ranks)[s.rank][s.start : s.start + CHUNK]
            if data != torch.tensor(kv, dtype=torch.int64).numpy().tobytes():
                wrong.append(s.key)
        return wrong

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()
