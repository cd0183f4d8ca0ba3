"""kvpool's benchmarks: `python -m bench [name ...]` runs bench/<name>_bench.py (all by default)."""
