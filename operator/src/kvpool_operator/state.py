"""The operator's state: what kopf hands every handler as `memo`, typed so that mypy checks each use.

kopf gives each pool a shallow copy of it, so the parts made at startup (which need the event loop)
are shared by every handler.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from kvpool_operator.kube import Kube
from kvpool_operator.leading import Peering
from kvpool_operator.pool_index import PoolIndex
from kvpool_operator.scaling import MemorySource
from kvpool_operator.settings import OperatorSettings
from kvpool_operator.skip_events import SkipEvents


@dataclass
class OperatorState:
    settings: OperatorSettings
    memory_source: MemorySource  # a shard's memory use, for scaling the shared tier
    peering: Peering  # who leads: the refresh loop acts only there
    # made by the startup handler
    kube: Kube = field(init=False)
    skip_events: SkipEvents = field(init=False)  # the webhook's PodNotInjected events, counted
    # the webhook's pools, followed by every replica whether it leads or not (kopf's watches pause)
    pool_index: PoolIndex = field(init=False)
    index_task: asyncio.Task[None] = field(init=False)
    refresh_task: asyncio.Task[None] = field(init=False)
    probes: list[web.AppRunner] = field(init=False)
