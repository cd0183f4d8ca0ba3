"""kvpool's connector with a step trace, for `bench steps` (loaded by vLLM as kv_connector_module_path
"bench.step_trace", connector "TracedKVPoolConnector"; writes where KVPOOL_STEP_TRACE names).

Per worker step, one JSON line: when the step's connector work began (handle_preemptions, the first
call of a step) and ended (get_transfer_results, the last), and how long the fence and wait_for_save
took inside it. Per save the save thread ran, one line with its start and end. Times are
time.perf_counter() seconds of the engine's process.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from kvpool_connector import KVPoolConnector
from kvpool_connector.saver import SaveJob

_lock = threading.Lock()


def _emit(record: dict[str, Any]) -> None:
    path = os.environ.get("KVPOOL_STEP_TRACE")
    if path:
        with _lock, open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


class TracedKVPoolConnector(KVPoolConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._step: dict[str, Any] = {}
        if self.worker is not None:
            run = self.worker._run_save

            def traced_run(job: SaveJob) -> None:
                t0 = time.perf_counter()
                run(job)
                _emit({"save": job.step, "start": t0, "end": time.perf_counter(), "chunks": len(job.saves)})

            self.worker.saver._run = traced_run

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        t0 = time.perf_counter()
        super().handle_preemptions(kv_connector_metadata)
        self._step = {"step": getattr(kv_connector_metadata, "step", 0), "start": t0}
        self._step["fence"] = time.perf_counter() - t0

    def wait_for_save(self) -> None:
        t0 = time.perf_counter()
        super().wait_for_save()
        self._step["wait_for_save"] = time.perf_counter() - t0

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        out = super().get_transfer_results(finished_req_ids)
        if self.worker is not None and "start" in self._step:
            _emit({**self._step, "end": time.perf_counter()})
            self._step = {}
        return out
