"""A returning user's lookup (#24): the round trips it makes to the sidecar inside vLLM's scheduler, and
the returning users' TTFT, for kvpool at a base revision against kvpool from this tree, wave by wave.

Round 2 of a conversation misses kvpool's stored chunks where round 1's partial tail was (the next
round's chunk there is longer, so its key differs); the tail is found as a shorter span of that
chunk. A lookup asks those spans in its own round trip only for the chunk it guesses the prompt
misses at; elsewhere it asks again, a second round trip inside schedule() (`tail_lookups`).

Both servers are bench paired's kvpool (engine KV 48 blocks, a 2 GiB sidecar, 256-token chunks,
prefix caching on); the base runs, sidecar and all, from a git worktree of KVPOOL_BASE (default
HEAD) put first on its PYTHONPATH. The waves are bench paired's returning users, released at once
to both servers in turn, the first alternating; the TTFT ratios are over the waves of rounds 2 and
3. The connector's counters are read off each server's /metrics around each level.
Run: `KVPOOL_BASE=<rev> .venv/bin/python -m bench returning_lookups` (about 6 minutes on 2 cores);
BASE_FIRST = False starts this tree's server first.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

from bench.load_bench import ENGINE_BLOCKS, FLOOR_BLOCKS, KVPOOL, LEVELS
from bench.paired_bench import DEV_MODE, HEAD, compare, returning, returning_users, row, start_servers
from bench.stats import load_note
from bench.workloads_bench import arms
from kvpool_demo.openai_driver import counters
from kvpool_demo.tinymodel import BENCH, make_model

BASE = os.environ.get("KVPOOL_BASE", "HEAD")
WATCHED = {
    name: f"vllm:kvpool_{name}_total"
    for name in ("lookups", "tail_lookups", "lookup_seconds", "loaded_chunks")
}
# Which server starts first: two identical servers differ by a few percent in their forwards (bench
# paired's control), so a run with the order swapped tells the change from the process
BASE_FIRST = True
ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("connector/src", "sidecar/src")  # the packages a server imports from its tree


@contextlib.contextmanager
def worktree(rev: str, at: Path) -> Iterator[Path]:
    """A detached git worktree of `rev` at `at`, removed on exit."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(at), rev], check=True)
    try:
        yield at
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(at)], check=True)


@contextlib.contextmanager
def beside_base() -> Iterator[tuple[str, Path, dict[str, str], contextlib.ExitStack]]:
    """For servers of kvpool at KVPOOL_BASE beside this tree's, with vLLM's development endpoints on:
    the base's short name, a work directory in /dev/shm, the environment that runs the base (its
    worktree first on PYTHONPATH) and a stack the servers live on."""
    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", BASE], check=True, capture_output=True, text=True
    ).stdout.strip()
    with (
        mock.patch.dict(os.environ, DEV_MODE),
        tempfile.TemporaryDirectory(prefix="kvpool-bench-", dir="/dev/shm") as d,
        worktree(rev, Path(d) / "base") as tree,
        contextlib.ExitStack() as stack,
    ):
        path = os.pathsep.join([*(str(tree / s) for s in SOURCES), os.environ.get("PYTHONPATH", "")])
        yield rev, Path(d), {"PYTHONPATH": path}, stack


def main() -> None:
    print(f"({load_note()})")
    model = make_model(Path(tempfile.gettempdir()) / "kvpool-models" / "bench-llama", BENCH)
    lines: list[str] = []
    counts: list[str] = []
    with beside_base() as (rev, d, base_path, stack):
        base, this = f"kvpool at {rev}", "kvpool, this tree"
        every = arms(model, ENGINE_BLOCKS, FLOOR_BLOCKS)
        every = {base: every[KVPOOL], this: every[KVPOOL]}
        order = (base, this) if BASE_FIRST else (this, base)
        urls = start_servers(every, order, d, stack, lambda n: base_path if n == base else {})
        print(f"(servers up; {load_note()})", flush=True)
        for level in LEVELS:
            before = {a: counters(u, WATCHED) for a, u in urls.items()}
            waves = compare(urls, base, this, returning_users(level), level, returning)
            after = {a: counters(u, WATCHED) for a, u in urls.items()}
            lines.append(row(level, f"returning users: {this} / {base}", waves[base], waves[this]))
            print(lines[-1], flush=True)
            for a in urls:
                n = {k: after[a][k] - before[a][k] for k in WATCHED}
                counts.append(
                    f"| {level} | {a} | {n['lookups']:.0f} | {n['tail_lookups']:.0f} | "
                    f"{1000 * n['lookup_seconds'] / max(n['lookups'], 1):.2f} | {n['loaded_chunks']:.0f} |"
                )
    print("\n".join(["Wave by wave, rounds 2 and 3 (95% intervals):", *HEAD, *lines]))
    print(
        "\n".join(
            [
                "Every request of the level (rounds 1 to 3), read off /metrics:",
                "| concurrency | server | lookups | second round trips (tail_lookups) "
                "| ms in lookups a lookup | chunks loaded |",
                "| --- " * 6 + "|",
                *counts,
            ]
        )
    )
