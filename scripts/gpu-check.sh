#!/bin/bash
# The CUDA path's check where a GPU is lent (#26): a machine with torch and CUDA but no vLLM and no
# package index. Two steps:
#   scripts/gpu-check.sh wheels   here: the sidecar's dependencies as Python 3.12 wheels into .whl/
#                                 (git-ignored through .git/info/exclude; carry it to the GPU machine)
#   scripts/gpu-check.sh run      there, from the repo root: the GPU tests; `bench cuda`; each stream
#                                 ordering removed in turn from a copy of the code, whose test must then fail.
#                                 Output also under $OUT when it is set.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(fastapi==0.136.3 starlette==1.10.0 pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0
  typing-inspection==0.4.5 uvicorn==0.54.0 httptools==0.9.0 redis==8.1.0 hiredis==3.5.0 typing_extensions==4.16.0)

wheels() {
  mkdir -p .whl .git/info
  grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 \
    -d .whl "${WHEELS[@]}"
}

paths() { echo "/tmp/kvpool-site:$PWD:$PWD/sidecar/src:$1:$PWD/demo/src:$PWD/tests"; }

mutated() {  # $1 file, $2 the ordering to drop, $3 the test that must then fail
  rm -rf /tmp/kvpool-mut && cp -r connector/src /tmp/kvpool-mut
  grep -q "$2" "/tmp/kvpool-mut/kvpool_connector/$1" || { echo "not found in $1: $2"; return 0; }
  sed -i "s/$2/None/" "/tmp/kvpool-mut/kvpool_connector/$1"
  echo "== without '$2' in $1 (must fail):"
  PYTHONPATH=$(paths /tmp/kvpool-mut) timeout 60 python3 -m pytest -m gpu -p no:cacheprovider -q --timeout 40 \
    "tests/connector/test_worker_cuda.py::$3" 2>&1 | grep -E "^E  +[A-Z]|passed|failed" | head -3 || true
}

run() {
  local out=${OUT:-/tmp/kvpool-gpu-out}
  mkdir -p "$out"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvpool-site .whl/*.whl
  export PYTHONUNBUFFERED=1 PYTHONPATH=$(paths "$PWD/connector/src")
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())' || true
    nproc
  } 2>&1 | tee "$out/env.log"
  timeout 150 python3 -m pytest -m gpu tests/connector/test_worker_cuda.py -p no:cacheprovider -q -rA --timeout 60 \
    2>&1 | tee "$out/tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" || true
  timeout 240 python3 -m bench cuda 2>&1 | tee "$out/bench.log" || echo "bench cuda: exit $?"
  {
    mutated chunk_io.py 'stream.wait_stream(torch.cuda.current_stream())' \
      test_a_layer_is_copied_out_after_the_forward_wrote_it
    mutated worker.py 'torch.cuda.current_stream().wait_event(done)' \
      test_blocks_reused_after_the_step_do_not_change_its_saves_and_need_no_fence
    mutated loader.py 'self.stream.wait_event(queued)' \
      test_a_load_writes_its_blocks_after_what_vllm_queued_before_it
  } 2>&1 | tee "$out/mutations.log"
}

case "${1:-}" in
  wheels) wheels ;;
  run) run ;;
  *) echo "usage: $0 wheels|run" >&2; exit 2 ;;
esac
