"""Saves off the step: one thread per worker reserves, copies out and commits each step's chunks while
vLLM runs its next steps, so a step's end never waits on the sidecar.

On the CPU a save copies straight from vLLM's paged blocks, so a block must not be written before its
save has read it. vLLM never writes a block it has not handed out again (a request's computed blocks
are immutable while it runs), so the scheduler names, in each step's metadata, the newest step whose
saves read a block handed out in this one (scheduler.py: the fence), and the worker waits for those
saves' copies before the step runs (vLLM's handle_preemptions hook). That covers finished, preempted
and sliding-window-freed blocks alike, without holding a block past its request. A fence waits at most
FENCE_SECONDS for a slow sidecar, then drops the saves that have not started copying (a future miss);
a copy in progress is memory speed and is waited for. On CUDA the saves copy from private bounce
buffers filled on a side stream during the forward, so they read no block after the step.

A step's saves start once the next step has begun (or after HOLD_SECONDS, for an engine with no next
step), not as the step ends: the step's end is when the engine hands its output on (the first token of
a prefill) and schedules the next step, and a save thread starting then takes the GIL and a CPU from
exactly that work. Started a step later, the save overlaps the next forward, as it did anyway.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .affinity import below_vllm, side_thread

# How long a step waits for the saves of blocks it reuses before dropping those not yet copying.
FENCE_SECONDS = 0.1
# Steps of saves queued at most: past it a slow sidecar's new saves are skipped, not queued.
MAX_QUEUED_STEPS = 64
# How long a step's saves wait for the next step to begin before they start anyway.
HOLD_SECONDS = 0.02
# How long a worker shutting down lets its queued saves finish.
CLOSE_DRAIN_SECONDS = 5.0

QUEUED, COPYING, COPIED, FENCED = "queued", "copying", "copied", "fenced"  # QUEUED: not copying yet


@dataclass(eq=False)
class SaveJob:
    step: int  # the scheduler's step that planned these saves
    saves: list[Any]  # the worker's chunk saves
    reads_blocks: bool  # copies from vLLM's paged blocks (CPU), not from bounce buffers (CUDA)
    state: str = field(default=QUEUED)

    def reads(self, through: int) -> bool:
        """Whether this job still reads (or may still read) vLLM's blocks for a fence at `through`."""
        return self.reads_blocks and self.step <= through and self.state in (QUEUED, COPYING)


class SaveQueue:
    """The save thread and its fence. `run(job)` saves one job on the thread; it calls start_copy
    before reading any block (False: fenced off, read nothing) and end_copy once it reads none.
    threaded=False runs each job inside put(), as before saves left the step."""

    def __init__(self, run: Callable[[SaveJob], None], threaded: bool = True):
        self._run = run
        self._threaded = threaded
        # One lock, two conditions: the save thread waits on _work, the worker's fence, drain and close
        # on _done. A step that neither queues nor waits for a save wakes neither: each wake of the
        # save thread is a turn at vLLM's GIL on the step's path.
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._done = threading.Condition(self._lock)
        self._queue: deque[SaveJob] = deque()
        self._busy: SaveJob | None = None
        self._last_step = 0
        self._begun = 0  # the newest step the worker has begun
        self._closed = False
        self._thread: threading.Thread | None = None

    def put(self, job: SaveJob) -> bool:
        """Queues a step's saves (the caller has noted its step); False when MAX_QUEUED_STEPS are queued
        already (skip them)."""
        if not self._threaded:
            self._busy = job
            try:
                self._run(job)
            finally:
                self._busy = None
            return True
        with self._lock:
            if self._closed or len(self._queue) >= MAX_QUEUED_STEPS:
                return False
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvpool-save", daemon=True)
                self._thread.start()
            self._work.notify()
        return True

    def note(self, step: int) -> None:
        """The worker has seen `step`: once its saves (if any) finish, saved_through passes it."""
        with self._lock:
            self._last_step = max(self._last_step, step)

    def begin(self, step: int) -> None:
        """The worker begins `step`: the saves of earlier steps may start."""
        with self._lock:
            self._begun = max(self._begun, step)
            if self._busy is not None and self._busy.step < step:  # held (else no one waits on _work)
                self._work.notify()

    def _hold(self, step: int) -> None:
        """Called with the lock held: waits until a step after `step` has begun, or HOLD_SECONDS."""
        self._work.wait_for(lambda: self._begun > step or self._closed, timeout=HOLD_SECONDS)

    def _loop(self) -> None:
        side_thread()  # started from vLLM's thread: a CPU engine's compute cores and OpenMP team
        below_vllm()  # nothing in the step waits for a save: vLLM's threads take the CPU first
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._work.wait()
                if not self._queue:
                    return
                job = self._busy = self._queue.popleft()
                self._hold(job.step)
            try:
                if job.state != FENCED:
                    self._run(job)
            finally:
                with self._lock:
                    if job.state != FENCED:
                        job.state = COPIED
                    self._busy = None
                    self._done.notify_all()
            # Not held while waiting for the next job: on CUDA its pinned buffer could not be reused,
            # and every step's new one was a cudaHostAlloc, which waits for the whole device (#26).
            del job

    # --- called by run(job), on the save thread ----------------------------------------------------

    def start_copy(self, job: SaveJob) -> bool:
        with self._lock:
            if job.state == FENCED:
                return False
            job.state = COPYING
            return True

    def end_copy(self, job: SaveJob) -> None:
        with self._lock:
            if job.state == COPYING:
                job.state = COPIED
            self._done.notify_all()

    # --- called by the worker, on vLLM's thread ------------------------------------------------------

    def _pending(self) -> list[SaveJob]:
        return ([self._busy] if self._busy is not None else []) + list(self._queue)

    def fence(self, through: int, wait: float = FENCE_SECONDS) -> list[SaveJob]:
        """Returns once no save of a step <= `through` reads a block: waits up to `wait` seconds for
        them, then fences off those not copying yet (returned: the caller counts them) and waits for a
        copy in progress."""
        with self._lock:
            reading = lambda: any(j.reads(through) for j in self._pending())  # noqa: E731
            if not reading() or self._done.wait_for(lambda: not reading(), timeout=wait):
                return []
            fenced = [j for j in self._pending() if j.reads(through) and j.state != COPYING]
            for j in fenced:
                j.state = FENCED
            self._done.wait_for(lambda: not reading())
            return fenced

    def saved_through(self) -> int:
        """Every save planned at a step <= this has finished (committed, skipped or dropped)."""
        with self._lock:
            pending = self._pending()
            return min(j.step for j in pending) - 1 if pending else self._last_step

    def drain(self, timeout: float) -> bool:
        """Waits until every queued save has finished; False if `timeout` passed first."""
        with self._lock:
            return self._done.wait_for(lambda: not self._pending(), timeout=timeout)

    def close(self, drain: float = CLOSE_DRAIN_SECONDS) -> None:
        """Lets the queued saves finish for up to `drain` seconds (an engine shutting down keeps what
        its last steps computed), drops the rest and stops the thread once a copy in progress is done
        (the caller unmaps the arena and frees the blocks next)."""
        with self._lock:
            self._done.wait_for(lambda: not self._pending(), timeout=drain)
            self._closed = True
            for j in self._pending():
                if j.state != COPYING:
                    j.state = FENCED
            self._work.notify_all()
            self._done.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=10)
