#!/usr/bin/env bash
# The e2e suite on kind (`make e2e-kind`): the scenarios `make test` runs on the real node, plus
# the vLLM scenarios. Creates a kind cluster (or reuses KVPOOL_E2E_CLUSTER), builds
# and loads kvpool's images, installs the chart, runs a shared-Redis pool under a two-replica vLLM CPU
# Deployment and checks what tests/e2e/test_vllm.py says. Needs Docker and kind; helm and kubectl
# come from scripts/get-helm.sh. The two vLLM images (stock and with the connector, ~5 GB) are built
# from the Dockerfile like the others.
# KVPOOL_E2E_KEEP=1 keeps the cluster afterwards. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/get-helm.sh
export PATH="$PWD/.tools/bin:$PATH"
# The first run builds a vLLM image: far longer than the unit suite's per-test timeout.
KVPOOL_E2E_ON=kind exec .venv/bin/python -m pytest -p no:cacheprovider -m e2e -rs -v --timeout 5400 tests/e2e "$@"
