#!/usr/bin/env bash
# The test suite: lint and type checks, the newest vLLM's scheduler tests in their own environment, then everything
# else, the e2e scenarios on the real node (vLLM pods included) too, but the GPU tests (marker gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
# The real node's images (tests/node/images.sh, cached outside the work tree) build in the background,
# niced, while the checks and the first tests run: from a cold cache that is 8-17 minutes, most of it
# vLLM's image. The e2e set-up then finds them built, or waits on the same lock (and builds them again,
# showing why, if this build failed).
images_log=$(mktemp -t kvpool-images.XXXX.log)
echo "[test] the node's images build in the background: $images_log" >&2
setsid nice -n 10 bash tests/node/images.sh >"$images_log" 2>&1 &
images=$!
trap 'kill -- -$images 2>/dev/null || true' EXIT
.venv/bin/ruff check .
.venv/bin/mypy  # every package, the benches and the tests (pyproject.toml [tool.mypy])
.venv-vllm-latest/bin/python -m pytest -m vllm_latest -p no:cacheprovider "$@"
.venv/bin/python -m pytest -m "not vllm_latest and not gpu" --durations=30 "$@"  # the slowest tests: where CI time goes
