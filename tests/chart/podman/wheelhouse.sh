#!/usr/bin/env bash
# Downloads every wheel the pinned requirement files name into DIR, for an image build with
# PIP_NO_INDEX=1 and PIP_FIND_LINKS pointing at it (no registry is reachable from a build here).
# Markers are dropped: a line only another Python needs (async-timeout before 3.11.3) is skipped by
# this Python's pip, but the image's own Python (Debian bookworm's 3.11.2) may need it.
# The connector payload's wheels (xxhash for every Python it serves) are always added: the sidecar
# image's build makes the payload from them.
# Usage: PYTHON=python3 wheelhouse.sh DIR REQUIREMENTS_FILE...
set -euo pipefail
DIR=${1:?wheelhouse directory}; shift
mkdir -p "$DIR"
sed 's/;.*//' "$@" >"$DIR/pinned.txt"
"${PYTHON:-python3}" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    -r "$DIR/pinned.txt" -d "$DIR" 2> >(grep -v 'is neither a file nor a directory' >&2)
PIP="${PYTHON:-python3} -m pip" bash "$(dirname "$0")/../../../scripts/connector-payload.sh" wheels "$DIR"
