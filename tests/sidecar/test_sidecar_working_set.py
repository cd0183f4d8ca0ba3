"""The working-set sketch: distinct chunks within a few percent, sketches of several pods merge into
their union (what a shared tier must hold), and the window forgets what was not asked again."""

from __future__ import annotations

from sidecar_support import key

from kvpool_sidecar.miss_ratio import key_hashes
from kvpool_sidecar.working_set import REGISTERS, WorkingSet, decode, estimate, merge


def chunks(ws: WorkingSet) -> int:
    """The distinct chunks the working set reports on /stats."""
    n = ws.snapshot()["chunks"]
    assert isinstance(n, int)
    return n


def test_distinct_chunks_within_a_few_percent_whatever_the_repeats() -> None:
    ws = WorkingSet()
    for _ in range(3):  # every key asked three times: counted once
        ws.looked_up(key_hashes([key(i, "doc") for i in range(50_000)]))
    assert abs(estimate(ws.sketch()) - 50_000) < 0.05 * 50_000
    small = WorkingSet()
    small.looked_up(key_hashes([key(i, "few") for i in range(100)]))
    assert abs(chunks(small) - 100) <= 3  # linear counting where few registers are set


def test_pods_sketches_merge_into_their_union_not_their_sum() -> None:
    pods = [WorkingSet() for _ in range(4)]
    for n, ws in enumerate(pods):  # a shared system prompt of 2,000 chunks, and 500 chunks of each pod's own
        ws.looked_up(
            key_hashes([key(i, "shared") for i in range(2000)] + [key(i, f"pod{n}") for i in range(500)])
        )
    sketches = [decode(str(ws.snapshot()["sketch"])) for ws in pods]
    assert all(len(s) == REGISTERS for s in sketches)
    union = estimate(merge(sketches))
    assert abs(union - 4000) < 0.05 * 4000  # 2,000 + 4 x 500, where the sum is 10,000
    assert sum(estimate(s) for s in sketches) > 9000


def test_the_window_forgets_what_was_not_asked_again() -> None:
    now = [0.0]
    ws = WorkingSet(window=60, clock=lambda: now[0])
    ws.looked_up(key_hashes([key(i, "old") for i in range(1000)]))
    now[0] = 70  # one window on: the last window still counts
    ws.looked_up(key_hashes([key(i, "new") for i in range(200)]))
    assert abs(chunks(ws) - 1200) < 60
    now[0] = 140  # two windows on: the old keys are gone
    assert abs(chunks(ws) - 200) < 10
    now[0] = 400  # silence: nothing
    assert chunks(ws) == 0
