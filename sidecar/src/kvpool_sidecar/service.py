"""The sidecar's parts wired together: arena, store, optional Redis tier; readiness and stats."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool_sidecar import metrics
from kvpool_sidecar.arena import Arena
from kvpool_sidecar.engine_reports import EngineReports
from kvpool_sidecar.journal import JOURNAL_FILE, Journal, budget_bytes
from kvpool_sidecar.settings import Settings
from kvpool_sidecar.store import Store
from kvpool_sidecar.wire import CONTROL_SOCKET
from kvpool_sidecar.write_token import WriteToken

if TYPE_CHECKING:
    from kvpool_sidecar.redis_tier import RedisTier

log = logging.getLogger(__name__)


@dataclass
class Sidecar:
    settings: Settings
    arena: Arena
    store: Store
    token: WriteToken  # what HTTP writes must carry
    engines: EngineReports  # what the pod's vLLM engines said of themselves at start
    redis: RedisTier | None = None  # imported only when configured
    redis_refused: str | None = None  # why a configured Redis tier is off

    @classmethod
    def build(cls, settings: Settings) -> Sidecar:
        arena = Arena(settings.arena_dir, settings.capacity, settings.shared_group)
        journal = Journal(settings.arena_dir / JOURNAL_FILE, budget_bytes(settings.capacity))
        store = Store(
            arena, lease_seconds=settings.lease_seconds, max_chunks=settings.max_chunks, journal=journal
        )
        token = WriteToken(settings.arena_dir, arena.mode)
        sidecar = cls(settings, arena, store, token, EngineReports(settings.arena_dir, arena.mode))
        if (
            (settings.redis_urls or settings.redis_urls_file)
            and settings.pool_key_required
            and not settings.pool_key
            and not settings.pool_key_file  # a file's key may come later: the tier waits for it
        ):
            sidecar.redis_refused = (
                "redis tier off: --pool-key-required and no KVPOOL_POOL_KEY (is the pool's key Secret there?)"
            )
            log.error("%s", sidecar.redis_refused)
        elif settings.redis_urls or settings.redis_urls_file:
            from kvpool_sidecar.redis_tier import RedisTier

            tier = RedisTier.from_settings(settings, store)
            store.lower = tier
            sidecar.redis = tier
        return sidecar

    socket_serving: bool = True  # False when the control socket could not be made (clients use HTTP)

    @property
    def socket_path(self) -> str | None:
        return str(self.settings.arena_dir / CONTROL_SOCKET) if self.socket_serving else None

    def start(self) -> None:
        if self.redis is not None:
            self.redis.start()

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()
        self.token.remove()  # a restarted sidecar writes a new one; clients read it again on 401
        journal = self.store.index.journal
        if journal is not None:
            journal.close()
        if not self.settings.keep_arena:  # a host's tmpfs holds its pages until the file goes
            self.engines.remove()
            self.arena.remove()
            if journal is not None:
                journal.remove()

    def ready(self, cpu_only: bool = False) -> tuple[bool, str]:
        if not cpu_only and self.redis_refused:
            return False, self.redis_refused
        if self.redis is not None and not cpu_only:
            ok, reason = self.redis.health()
            if not ok:
                return False, reason
        return True, "ok"

    def stats(self) -> dict:
        """/stats: the fields declared in metrics.py (which /metrics renders), and the tiers."""
        snap = self.store.snapshot()
        asked = snap["hits"] + snap["misses"]
        top = metrics.fields(metrics.STATS, {**snap, "hit_rate": snap["hits"] / asked if asked else 0.0})
        tiers: dict[str, dict] = {"cpu": {k: top[k] for k in metrics.CPU_TIER_KEYS}}
        if self.redis is not None:
            tiers["redis"] = self.redis.stats()
        elif self.redis_refused:
            tiers["redis"] = {"ready": False, "reason": self.redis_refused}
        return {
            **top,
            "arena_fault": self.store.arena_fault,
            "tiers": tiers,
            "engines": self.engines.reports,
            "miss_ratio": metrics.fields(metrics.MISS_RATIO_STATS, self.store.curve.snapshot(), ("curve",)),
            "working_set": metrics.fields(
                metrics.WORKING_SET_STATS, self.store.working_set.snapshot(), ("sketch",)
            ),
        }
