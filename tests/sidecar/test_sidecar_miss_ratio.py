"""The miss-ratio curve (sizing from a pool's own traffic): close to an exact LRU simulation of the same
trace at every capacity it reports, in bounded memory."""

from __future__ import annotations

from sidecar_support import key

from bench.miss_ratio_bench import CHUNK, compare
from kvpool_sidecar.miss_ratio import MissRatioCurve, key_hashes


def test_the_curve_is_within_5_points_of_an_exact_lru_at_each_capacity_and_the_ceiling() -> None:
    snap, rows = compare(requests=12_000, capacity=800 * CHUNK, max_keys=1024)
    assert snap["sampling_rate"] < 0.5  # the bound on memory made it sample
    assert [name for name, _, _ in rows] == ["0.25x", "0.5x", "1x", "2x", "4x", "ceiling"]
    for name, exact, estimate in rows:
        assert abs(estimate - exact) < 0.05, (name, exact, estimate)
    exact_rates = [exact for _, exact, _ in rows]
    assert exact_rates == sorted(exact_rates) and exact_rates[0] < exact_rates[-1] - 0.2  # a real curve


def test_memory_is_bounded_whatever_the_traffic() -> None:
    curve = MissRatioCurve(capacity=2**40, max_keys=256)  # room for every chunk: only the bound holds
    for i in range(20_000):
        keys = [key(i, "unique"), key(i % 50, "hot")]
        curve.looked_up(key_hashes(keys))
        curve.committed([(k, 1 << 20) for k in keys])
    largest = curve._ghosts[-1]
    assert len(largest.entries) <= 256 and len(curve._seen) <= 4 * 256
    assert len(curve._ghost_sample._heap) <= 2 * 256 + 1 and len(curve._seen_sample._heap) <= 8 * 256 + 1
    snap = curve.snapshot()
    assert 0 < snap["sampling_rate"] < 0.1
    # the 50 hot keys come back every time; an unbounded tier hits them and nothing unique
    assert 0.35 < snap["ceiling_hit_rate"] < 0.55 and 0.35 < snap["curve"][-1]["hit_rate"] < 0.55
