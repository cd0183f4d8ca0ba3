"""An online miss-ratio curve: the hit rate the CPU tier would have at other capacities, and its ceiling.

Ghost LRU caches (keys and sizes, no bytes) at 0.25x, 0.5x, 1x, 2x and 4x the capacity follow the
store's lookups (a hit moves a key to the front; a miss enters at the mean chunk size, as the engine
saves it next) and commits (a key enters, the least recently used leave).
They follow a sample of the keys, fixed-size SHARDS (Waldspurger et al., FAST'15): a key is followed
when its hash is under a threshold, the ghosts' capacities are scaled by the sampling rate, and when
the largest ghost holds more than `max_keys` keys the threshold drops to the largest hash it holds,
so memory stays bounded whatever the traffic. The sampling hash is xxh3 of the key. The ceiling
(what an unbounded tier would hit: a key committed before) samples the same way in its own bounded set.
"""

from __future__ import annotations

import heapq
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import xxhash

SCALES = (0.25, 0.5, 1.0, 2.0, 4.0)
_FULL = 1 << 64  # the threshold while every key is followed


# At most one key in 8 followed, from the start: the curve's work stays off most lookups' keys (an
# 8-key lookup pays one hash per key and, on average, one ghost update), and past a few thousand
# keys the bound below takes the rate lower still.
MAX_RATE_SHIFT = 3


def key_hashes(keys: Iterable[str]) -> list[int]:
    """The 64-bit hash of each key, computed once per lookup for the curve and the working set (keys
    are hex of any shape a client chose, not always hashes)."""
    return [xxhash.xxh3_64_intdigest(key.encode()) for key in keys]


class _Sample:
    """The hashes under `threshold`, kept to at most `max_keys` live ones: over that, the largest goes
    and the threshold drops to it. A max-heap of hashes; entries whose key has left (an LRU eviction)
    are skipped when popped and cleared when they outnumber the live ones."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self.threshold = _FULL >> MAX_RATE_SHIFT
        self._heap: list[int] = []  # -hash of every key followed since the last compaction

    @property
    def rate(self) -> float:
        return self.threshold / _FULL

    def follows(self, h: int) -> bool:
        return h < self.threshold

    def added(self, h: int, live: Callable[[int], bool], count: int) -> list[int]:
        """Records a hash now followed, `count` live ones in all; returns the hashes no longer followed."""
        heapq.heappush(self._heap, -h)
        dropped: list[int] = []
        while count > self.max_keys:
            gone = -heapq.heappop(self._heap)
            self.threshold = gone
            if live(gone):
                dropped.append(gone)
                count -= 1
        if len(self._heap) > 2 * self.max_keys:
            self._heap = [x for x in self._heap if live(-x)]
            heapq.heapify(self._heap)
        return dropped


class _Ghost:
    """An LRU of hash -> size over the sampled keys: `capacity` bytes of the sampled stream."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.capacity = 0.0
        self.entries: OrderedDict[int, float] = OrderedDict()
        self.used = 0.0
        self.hits = 0

    def touch(self, h: int) -> bool:
        if h in self.entries:
            self.entries.move_to_end(h)
            return True
        return False

    def insert(self, h: int, size: float) -> None:
        self.entries[h] = size
        self.used += size
        self.shrink()

    def shrink(self) -> None:
        while self.used > self.capacity and self.entries:
            self.used -= self.entries.popitem(last=False)[1]

    def drop(self, h: int) -> None:
        self.used -= self.entries.pop(h, 0)


class MissRatioCurve:
    """Thread-safe: the store calls `looked_up` and `committed` outside its own lock."""

    def __init__(self, capacity: int, max_keys: int = 4096) -> None:
        self.capacity = capacity
        self._ghosts = [_Ghost(scale) for scale in SCALES]
        self._largest = self._ghosts[-1].entries  # holds every key a smaller ghost holds
        self._ghost_sample = _Sample(max_keys)
        self._seen: set[int] = set()  # every sampled key committed since start: the ceiling
        self._seen_sample = _Sample(4 * max_keys)
        self._accesses = 0  # sampled keys looked up (the ghosts' sample)
        self._seen_accesses = 0  # and the ceiling's
        # SHARDS-adj (the paper's correction): how many keys each sample should have seen, at the rate
        # it had; a hot key sampled or not moves the sampled count far from it, and the difference is
        # counted as hits (hot keys hit at every size)
        self._expected = 0.0
        self._seen_expected = 0.0
        self._seen_hits = 0
        self._mean_size = 0.0  # of the chunks committed: what a chunk a ghost missed will take
        self._sizes_seen = 0
        self._lock = threading.Lock()
        self._resize()

    def _resize(self) -> None:
        for ghost in self._ghosts:
            ghost.capacity = ghost.scale * self.capacity * self._ghost_sample.rate
            ghost.shrink()

    def looked_up(self, hashes: Iterable[int]) -> None:
        """A lookup (its keys' key_hashes): each ghost counts the keys it holds as hits, and takes the
        others as the store would after the miss (the engine computes and saves them), at the mean
        size saved so far."""
        hashes = list(hashes)
        ghosts, seen = self._ghost_sample.threshold, self._seen_sample.threshold
        followed = [h for h in hashes if h < ghosts or h < seen]
        with self._lock:
            self._expected += len(hashes) * self._ghost_sample.rate
            self._seen_expected += len(hashes) * self._seen_sample.rate
            for h in followed:
                if self._ghost_sample.follows(h):
                    self._accesses += 1
                    self._follow(h, self._mean_size, lookup=True)
                if self._seen_sample.follows(h):
                    self._seen_accesses += 1
                    self._seen_hits += h in self._seen

    def committed(self, chunks: Iterable[tuple[str, int]]) -> None:
        with self._lock:
            for key, size in chunks:
                (h,) = key_hashes((key,))
                self._sizes_seen += 1
                self._mean_size += (size - self._mean_size) / self._sizes_seen
                if self._ghost_sample.follows(h):
                    self._follow(h, size, lookup=False)
                if self._seen_sample.follows(h) and h not in self._seen:
                    self._seen.add(h)
                    self._seen.difference_update(
                        self._seen_sample.added(h, self._seen.__contains__, len(self._seen))
                    )

    def _follow(self, h: int, size: float, lookup: bool) -> None:
        new = h not in self._largest
        for ghost in self._ghosts:
            if ghost.touch(h):
                ghost.hits += lookup
            else:
                ghost.insert(h, size)
        if new and (dropped := self._ghost_sample.added(h, self._largest.__contains__, len(self._largest))):
            for gone in dropped:
                for ghost in self._ghosts:
                    ghost.drop(gone)
            self._resize()

    def snapshot(self) -> dict[str, Any]:
        """For /stats: each capacity's estimated hit rate, the ceiling, and how much was sampled."""
        with self._lock:

            def adjusted(hits: int, sampled: int, expected: float) -> float:
                if expected < 1:
                    return 0.0
                return min(1.0, max(0.0, (hits + expected - sampled) / expected))

            return {
                "curve": [
                    {
                        "scale": g.scale,
                        "capacity_bytes": int(g.scale * self.capacity),
                        "hit_rate": adjusted(g.hits, self._accesses, self._expected),
                    }
                    for g in self._ghosts
                ],
                "ceiling_hit_rate": adjusted(self._seen_hits, self._seen_accesses, self._seen_expected),
                "sampling_rate": self._ghost_sample.rate,
                "sampled_lookups": self._accesses,
            }
