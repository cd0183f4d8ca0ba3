"""Runs the benchmark modules: every bench/*_bench.py, or those named (`python -m bench sidecar`)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path


def available() -> list[str]:
    return sorted(p.stem.removesuffix("_bench") for p in Path(__file__).parent.glob("*_bench.py"))


def main(argv: list[str]) -> int:
    names = argv or available()
    unknown = [n for n in names if n not in available()]
    if unknown:
        print(
            f"unknown benchmark(s) {', '.join(unknown)}; available: {', '.join(available())}", file=sys.stderr
        )
        return 2
    for name in names:
        print(f"== bench/{name}_bench.py")
        importlib.import_module(f"bench.{name}_bench").main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
