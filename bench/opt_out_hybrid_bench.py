"""bench opt_out on a hybrid model: sliding-window and full attention in alternate layers, as in
Gemma 2 and gpt-oss (vLLM's hybrid KV cache manager keeps two groups; kvpool stores each chunk's part
of each group apart, and its lookup asks for the windows a hit needs). The window (512 tokens) is
longer than the prompts, so every part is saved and a wave's saves can be counted. Otherwise the
same bench, shapes and prompts: kvpool on against requests that opt out, in one server process.
Run: `.venv/bin/python -m bench opt_out_hybrid` (about 8 minutes on the 2-core VM of 2026-11-29);
writes bench/results/opt-out-hybrid.json.
"""

from __future__ import annotations

from bench.opt_out_bench import run
from kvpool_demo.tinymodel import BENCH_HYBRID


def main() -> None:
    run(BENCH_HYBRID, "bench-hybrid", "opt-out-hybrid.json")
