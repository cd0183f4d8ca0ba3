"""The engine runner's results file, read by the tests while the runner writes the next run's.

enginekit reads OUT after a run's done file appears, and the runner may be writing OUT for the run
after it by then: a file written in place is read empty or cut (a CI run failed on it with a
JSONDecodeError). OUT is replaced whole.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from kvpool_demo.engine_run import publish


def test_a_reader_never_sees_a_half_written_results_file(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    output = {"token_ids": list(range(128)), "logprobs": [-0.5] * 128}
    run = {"label": "r", "seconds": 1.0, "outputs": [output]}
    publish(out, [run])
    writes = 100
    written = threading.Event()

    def write() -> None:
        for n in range(2, writes + 2):
            publish(out, [run] * n)
        written.set()

    writer = threading.Thread(target=write)
    writer.start()
    reads, torn = 0, 0
    while not written.is_set():
        try:
            json.loads(out.read_text())
        except json.JSONDecodeError:
            torn += 1
        reads += 1
    writer.join()
    assert torn == 0, f"{torn} of {reads} reads saw a half-written file"
    assert len(json.loads(out.read_text())["runs"]) == writes + 1
