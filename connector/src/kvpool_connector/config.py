"""The connector's settings, read from vLLM's `kv_connector_extra_config`.

Imports nothing from torch or vLLM: the operator's tests import this module to check what it writes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool_sidecar.client import SidecarClient


@dataclass(frozen=True)
class KVPoolConfig:
    sidecar_url: str = "http://127.0.0.1:7070"
    shm_path: str | None = None
    chunk_size: int = 256
    priority_limit: int | None = None
    save_decode_cache: bool = False
    skip_last_n_tokens: int = 0
    discard_partial_chunks: bool = False
    timeout_ms: int = 1000
    pool: str | None = None
    model_fingerprint: str | None = None  # names the weights instead of reading them (see model_identity)
    # The medium of kvpool's KV cache events (kv_events.py): by default vLLM's MEDIUM_CPU, what its own
    # OffloadingConnector names its CPU tier and routers weight out of the box (llm-d: gpu 1.0, cpu
    # 0.8); a name of kvpool's own (e.g. KVPOOL) counts once the router is given a weight for it.
    kv_events_medium: str = "CPU"
    # Saves run on a thread beside the engine (saver.py); false runs them inside the step, at its end
    # (what kvpool did before; `bench steps` measures one against the other).
    async_saves: bool = True
    # Loads before the step's forward, the request computing in that same step (vLLM's synchronous
    # load), or beside the steps (asynchronous: the request waits for the step that reports its load,
    # one step more, which under load is a whole step of other requests). null: in the step on a CPU
    # engine, beside the steps on a GPU (where the forward would wait for the host). A hybrid model's
    # loads are always beside the steps: vLLM takes no failed block ids from it.
    sync_loads: bool | None = None
    # CUDA: threads that copy chunks between the arena and private pinned buffers and hash them, several
    # chunks at once. The host's CPU bounds the path: on the H100 host loads ran about 10 GB/s on 4
    # threads, 14 on 8, no more on 12 (BENCHMARKS.md, #26). Each takes a core while chunks move, and
    # stages two chunks of pinned memory ahead of a load. null: half of this worker's share of the
    # CPUs its container may use, at most 8 (cpu_share.py).
    copy_threads: int | None = None
    # CPU: saves in a process of their own, which reads the blocks out of the worker's memory
    # (save_process.py), so that they take no turns at vLLM's GIL; false: on the worker's save thread.
    save_process: bool = True
    # A lookup that needs a chunk this engine is still saving waits for that save at most this long,
    # then is a miss (computed, never wrong). A save takes milliseconds; one still running after a
    # second means a slow or hung sidecar, which a waiting request should not wait out.
    save_wait_ms: int = 1000


# key -> (accepted types, check on the value or None, what a valid value is)
_INT = (int,)
_RULES: dict[str, tuple[tuple[type, ...], Any, str]] = {
    # the sidecar serves plain HTTP on the pod's loopback (its control path is a Unix socket)
    "sidecar_url": ((str,), lambda v: v.startswith("http://"), "an http://host:port URL"),
    "shm_path": ((str, type(None)), lambda v: v is None or bool(v), "a directory path or null"),
    "chunk_size": (_INT, lambda v: v > 0, "a positive integer"),
    "priority_limit": ((int, type(None)), None, "an integer or null"),
    "save_decode_cache": ((bool,), None, "true or false"),
    "skip_last_n_tokens": (_INT, lambda v: v >= 0, "a non-negative integer"),
    "discard_partial_chunks": ((bool,), None, "true or false"),
    "timeout_ms": (_INT, lambda v: v > 0, "a positive integer"),
    "pool": ((str, type(None)), None, "a string or null"),
    "model_fingerprint": ((str, type(None)), lambda v: v is None or bool(v), "a non-empty string or null"),
    "kv_events_medium": ((str,), bool, "a non-empty string"),
    "async_saves": ((bool,), None, "true or false"),
    "sync_loads": ((bool, type(None)), None, "true, false or null"),
    "copy_threads": ((int, type(None)), lambda v: v is None or v > 0, "a positive integer or null"),
    "save_process": ((bool,), None, "true or false"),
    "save_wait_ms": (_INT, lambda v: v > 0, "a positive integer"),
}
assert set(_RULES) == {f.name for f in dataclasses.fields(KVPoolConfig)}


def _check(key: str, value: Any) -> Any:
    types, valid, what = _RULES[key]
    # bool is an int in Python; a flag written as 1 or a size written as true is a mistake
    is_bool = isinstance(value, bool)
    if not isinstance(value, types) or (is_bool and bool not in types) or (valid and not valid(value)):
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be {what}, got {value!r}")
    return value


def load_config(extra: Mapping[str, Any] | None) -> tuple[KVPoolConfig, list[str]]:
    """Builds the config from `kv_connector_extra_config`.

    Returns the config and warnings for unknown keys (other connectors' keys may share the dict);
    raises ValueError naming the key when a value has the wrong type or is out of range.
    """
    values: dict[str, Any] = {}
    warnings: list[str] = []
    for key, value in (extra or {}).items():
        if key in _RULES:
            values[key] = _check(key, value)
        else:
            warnings.append(f"kvpool: unknown kv_connector_extra_config key {key!r} ignored")
    return KVPoolConfig(**values), warnings


def sidecar_client(cfg: KVPoolConfig, control_connections: int = 8) -> SidecarClient:
    """The one way the connector reaches its pod's sidecar (scheduler, workers, the engine report).
    `control_connections`: the lookups its caller keeps in flight at once, each on a connection."""
    from kvpool_sidecar.client import SidecarClient

    return SidecarClient(
        cfg.sidecar_url,
        timeout=cfg.timeout_ms / 1000,
        shm_path=cfg.shm_path,
        control_connections=control_connections,
    )
