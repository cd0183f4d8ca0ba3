"""KVPoolConnector: vLLM's entry point, a thin facade over the scheduler half and the worker half."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from .config import load_config
from .engine_report import engine_name, report_engine
from .kv_events import KVPoolEvents, events_enabled, hash_block_size
from .logs import connector_logger
from .metrics import KVPoolPromMetrics, KVPoolStats, build_stats
from .model_identity import PRIVATE_WEIGHTS
from .namespace import engine_namespace, out_of_window, stored_groups, tp_replicated
from .scheduler import KVPoolScheduler
from .vllm_types import KVPoolMetadata, KVPoolSaveProgress
from .worker import KVPoolWorker

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = connector_logger(__name__)


def _worker_rank(tp_size: int, replicated: bool) -> tuple[int, bool]:
    """This worker's keys' rank (pipeline stage * TP size + TP rank; the stage alone where every TP
    rank holds the same KV) and whether it saves (where they hold the same, TP rank 0 only)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        stage, tp_rank = get_pp_group().rank_in_group, get_tensor_model_parallel_rank()
    except (AssertionError, ImportError):  # no parallel groups (single process tests)
        stage, tp_rank = 0, 0
    if replicated:
        return stage, tp_rank == 0
    return stage * tp_size + tp_rank, True


def check_failure_policy(kv_transfer_config: Any) -> None:
    """kvpool is a best-effort cache: a chunk evicted between lookup and load, or one that fails its
    checksum, must be recomputed. vLLM's default policy fails the user's request instead."""
    policy = getattr(kv_transfer_config, "kv_load_failure_policy", "recompute")
    if policy != "recompute":
        raise ValueError(
            f"KVPoolConnector needs kv_load_failure_policy='recompute' in --kv-transfer-config (it is "
            f"{policy!r}): with {policy!r} every cache race (a chunk evicted between lookup and load) "
            "fails a user request instead of recomputing it. The kvpool operator injects 'recompute'."
        )


class KVPoolConnector(KVConnectorBase_V1, SupportsHMA):
    """Declares SupportsHMA so vLLM keeps its hybrid KV cache manager on (a hybrid model's sliding-
    window layers then hold only their window: up to twice the KV capacity); each KV cache group's
    part of a chunk is stored under its own key (scheduler.py)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ):
        if kv_cache_config is None:
            raise ValueError("KVPoolConnector needs vLLM to pass kv_cache_config (vLLM 0.11 or newer)")
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_failure_policy(self._kv_transfer_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.cfg, warnings = load_config(extra)
        for w in warnings:
            log.warning(w)
        self.scheduler: KVPoolScheduler | None = None
        self.worker: KVPoolWorker | None = None
        self._num_blocks = kv_cache_config.num_blocks
        self._layer_work = False  # whether this step's attention layers call in (has_connector_metadata)
        # a model kvpool cannot cache is served without it: an optional cache never stops an engine
        self.off: str | None = None
        try:
            groups = stored_groups(kv_cache_config, self.cfg.chunk_size)
        except ValueError as e:
            self.off, groups = str(e), []
            if role == KVConnectorRole.SCHEDULER:  # once per engine
                log.error("%s kvpool is off for this engine: vLLM serves it without a cache.", e)
        self._groups = [list(g.layer_names) for g in groups]
        model = str(vllm_config.model_config.model)
        if self.off is not None:
            if role != KVConnectorRole.SCHEDULER:
                self.worker = KVPoolWorker(self.cfg, 0, saves=False)  # only ever sees empty steps
            else:
                report: dict[str, Any] = {"cache": "off", "reason": self.off, "model": model}
                report_engine(self.cfg, engine_name(vllm_config), report)
        elif role == KVConnectorRole.SCHEDULER:
            namespace = engine_namespace(
                vllm_config, kv_cache_config, self.cfg.chunk_size, self.cfg.model_fingerprint
            )
            windows = [out_of_window(g.kv_cache_spec) for g in groups]
            bs = namespace.block_size
            events = (
                KVPoolEvents(bs, hash_block_size(vllm_config, kv_cache_config, bs), self.cfg.kv_events_medium)
                if events_enabled(vllm_config)
                else None
            )
            sync = self.cfg.sync_loads
            if sync is None:  # on a GPU an in-step load would keep the forward waiting on the host
                sync = vllm_config.device_config.device_type == "cpu"
            self.scheduler = KVPoolScheduler(
                self.cfg, namespace, bs, windows=windows, events=events, sync_loads=sync
            )
            shared = not namespace.weights.startswith(PRIVATE_WEIGHTS)
            why = "" if shared else "its weights cannot be read to fingerprint them: set model_fingerprint"
            report = {"cache": "on", "shared": shared, "reason": why, "model": model}
            report_engine(self.cfg, engine_name(vllm_config), report)
        else:
            rank, saves = _worker_rank(
                vllm_config.parallel_config.tensor_parallel_size, tp_replicated(groups)
            )
            self.worker = KVPoolWorker(self.cfg, rank, saves=saves)
            self._chunk_blocks = self.cfg.chunk_size // groups[0].kv_cache_spec.block_size

    @property
    def _worker(self) -> KVPoolWorker:
        assert self.worker is not None, "a worker-side call on the scheduler's connector"
        return self.worker

    @property
    def _scheduler(self) -> KVPoolScheduler:
        assert self.scheduler is not None, "a scheduler-side call on a worker's connector"
        return self.scheduler

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    # --- worker side -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.v1.kv_cache_interface import group_kernel_blocks

        if self.off is not None:
            return

        names = [n for layers in self._groups for n in layers]
        caches = [(n, group_kernel_blocks(kv_caches[n], self._num_blocks)) for n in names]
        starts = [sum(len(layers) for layers in self._groups[:g]) for g in range(len(self._groups))]
        groups = [
            list(range(start, start + len(layers)))
            for start, layers in zip(starts, self._groups, strict=True)
        ]
        self._worker.register_kv_caches(caches, chunk_blocks=self._chunk_blocks, groups=groups)

    def _meta(self) -> KVPoolMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolMetadata)
        return meta

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._layer_work = (
            self.worker is not None
            and self.worker.copies_layers
            and isinstance(connector_metadata, KVPoolMetadata)
            and bool(connector_metadata.saves)
        )

    def has_connector_metadata(self) -> bool:
        """What vLLM asks before each attention layer, calling wait_for_layer_load and save_kv_layer
        around it only on True: so True only where this step's layers have work for kvpool (CUDA
        copying out the step's saves as each layer is written). A load has landed before the forward
        (start_load_kv), so no layer waits for one; elsewhere that is 2 calls a layer of every step spared.
        kvpool's own hooks check the metadata itself."""
        return self._layer_work and self._connector_metadata is not None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.start_load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # an in-step load has landed before the forward starts (start_load_kv waits for it)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._connector_metadata
        idle = isinstance(meta, KVPoolMetadata) and meta.idle
        return None, (self._worker.get_finished(wait=idle) or None)

    @property
    def _hybrid(self) -> bool:
        return len(self._groups) > 1

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """A hybrid model's failed loads go to vLLM as failed requests (its block ids are per group,
        so vLLM takes none from a connector there); one group's as failed blocks (a finer recompute:
        get_block_ids_with_load_errors)."""
        _, finished = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed_requests()
        return KVConnectorTransferResults(
            finished_recving=set(finished or ()), failed_recving=failed if self._hybrid else set()
        )

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._worker.save_layer(layer_name, self._meta())  # called only where _layer_work

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the step touches a block: the earlier steps' saves may start, and those still reading
        blocks it reuses finish (saver.py)."""
        if self.worker is not None and isinstance(kv_connector_metadata, KVPoolMetadata):
            self.worker.begin_step(kv_connector_metadata)

    def wait_for_save(self) -> None:
        if isinstance(meta := self._connector_metadata, KVPoolMetadata):
            self._worker.finish_step(meta)

    def build_connector_worker_meta(self) -> KVPoolSaveProgress | None:
        return KVPoolSaveProgress(self.worker.saved_through()) if self.worker is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self.worker.take_load_errors() if self.worker else set()
        return set() if self._hybrid else errors

    def get_kv_connector_stats(self) -> KVPoolStats | None:
        half = self.worker or self.scheduler
        counts = half.take_stats() if half else None
        return build_stats(counts) if counts else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPoolStats:
        return build_stats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVPoolPromMetrics:
        """kvpool's counters on vLLM's own /metrics (vllm:kvpool_*_total)."""
        return KVPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for half in (self.worker, self.scheduler):
            if half is not None:
                half.shutdown()

    # --- scheduler side --------------------------------------------------------------------------

    # Off (a model kvpool cannot cache), the scheduler side matches nothing and plans nothing, so the
    # worker side only ever sees empty steps.

    def reset_cache(self) -> bool:
        return self.off is not None or self._scheduler.reset_cache()

    def on_new_request(self, request: Request) -> None:
        if self.off is None:
            self._scheduler.track(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.off is not None:
            return 0, False
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self.off is None:
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.off is not None:
            return KVPoolMetadata()
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.off is None:
            self._scheduler.update_connector_output(connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """kvpool's tier as vLLM KV cache events, for routers (kv_events.py); only with --kv-events-config."""
        return self.scheduler.take_events() if self.scheduler is not None else ()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return (False, None) if self.off is not None else self._scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])
