#!/usr/bin/env bash
# Builds .venv-lmcache for the LMCache arm of `python -m bench workloads`: LMCache from PyPI
# (requirements/lmcache.txt, --no-deps) over .venv's packages, shared through a .pth file placed after
# its own site-packages, like .venv-vllm-latest. Not part of the tests. Run `make env` first.
set -euo pipefail
cd "$(dirname "$0")/.."
V=.venv-lmcache
[ -x .venv/bin/python ] || { echo "no .venv: run 'make env' first" >&2; exit 1; }
[ -x "$V/bin/python" ] || python3 -m venv "$V"
"$V/bin/pip" install --quiet --disable-pip-version-check --no-deps -r requirements/lmcache.txt
own=$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
shared=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$shared')" > "$own/zz-kvpool-shared.pth"
echo "[lmcache-env] $V ready: $("$V/bin/python" -c 'import lmcache; print("lmcache", lmcache.__version__)' 2>/dev/null || echo 'lmcache does not import')"
