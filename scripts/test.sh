#!/usr/bin/env bash
# The test suite: lint and type checks, the newest vLLM's scheduler tests in their own environment, then everything
# else, the e2e scenarios on the real node (vLLM pods included) too, but the GPU tests (marker gpu), in two
# halves side by side.
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
# The rest in two pytest processes side by side: the engine tests (tests/connector), and everything
# else (the control plane, the real node, the demo). One after the other they left a core of two idle
# 46% of the time, waiting on engine starts and pods; side by side the stage took 0.69x as long. The
# engine tests that assert a hit right after a saving run let a lookup wait for the save as long as it
# takes (enginekit.SAVE_WAIT_MS): under this load a save can outlast the default 1 s. The engine half
# writes to its own log, printed when both are done. --durations: where CI time goes.
marks="not vllm_latest and not gpu"
engine_log=$(mktemp -t kvpool-engine-tests.XXXX.log)
echo "[test] tests/connector runs beside the rest; its log, printed at the end: $engine_log" >&2
setsid .venv/bin/python -m pytest tests/connector -m "$marks" --durations=20 "$@" >"$engine_log" 2>&1 &
engines=$!
trap 'kill -- -$images -$engines 2>/dev/null || true' EXIT
rest=0
.venv/bin/python -m pytest tests --ignore=tests/connector -m "$marks" --durations=20 "$@" || rest=$?
engine=0
wait $engines || engine=$?
echo "[test] ===== tests/connector (beside the rest) =====" >&2
cat "$engine_log"
echo "[test] tests/connector: exit $engine; the rest: exit $rest" >&2
exit $((rest || engine))
