"""kvpool's saves in a process of their own against saves on the worker's thread, with no reuse (#24).

bench opt_out at concurrency 2 and 8 (kvpool on against requests that opt out of it, in one server process,
the opted-out-again control beside them), in fresh servers whose connector has `save_process` true or
false, SETS of each, their order alternating. On a CPU engine the forward runs Python between its
kernels, and the save thread's copies and hashes take turns at its GIL; the save process reads the
blocks out of the worker's memory instead. What to compare: each config's on / opted out (TTFT, out
tok/s, the forward steps beside the saves) and its CPU by role.
Run: `.venv/bin/python -m bench save_process` (42 minutes on the 2-core VM of 2026-12-02);
writes bench/results/save-process.json.
"""

from __future__ import annotations

from bench.opt_out_bench import run
from kvpool_demo.tinymodel import BENCH

CONFIGS = {"save process": {"save_process": True}, "save thread": {"save_process": False}}
SETS = 3


def main() -> None:
    run(BENCH, "bench-llama", "save-process.json", configs=CONFIGS, levels=(2, 8), sets=SETS)
