#!/usr/bin/env bash
# The test suite: lint and type checks, the newest vLLM's scheduler tests in their own environment, then everything
# else, the e2e scenarios on the real node (vLLM pods included) too, but the GPU tests (marker gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/mypy  # every package, the benches and the tests (pyproject.toml [tool.mypy])
.venv-vllm-latest/bin/python -m pytest -m vllm_latest -p no:cacheprovider "$@"
.venv/bin/python -m pytest -m "not vllm_latest and not gpu" --durations=30 "$@"  # the slowest tests: where CI time goes
