#!/usr/bin/env bash
# connector-payload.sh - kvpool's connector as a directory any vLLM image's Python can import once it
# is on PYTHONPATH: the connector, the sidecar's client (both pure Python, 3.10+), and xxhash, whose
# compiled module is named per Python and machine (_xxhash.cpython-312-x86_64-linux-gnu.so), so one
# directory holds every CPython and both architectures the payload serves, and each Python loads its own.
#
#   connector-payload.sh wheels DIR            download xxhash's wheels for every (Python, platform) into DIR
#   connector-payload.sh build SRC WHEELS OUT  the payload in OUT: SRC's two packages, xxhash from WHEELS
#
# xxhash's version is the sidecar's pin (requirements/sidecar.txt): one version everywhere. PIP (default
# "python3 -m pip") is the pip that downloads; its index settings come from the environment (PIP_*).
set -euo pipefail
PYTHONS=(3.10 3.11 3.12 3.13 3.14)
PLATFORMS=(manylinux_2_17_x86_64 manylinux_2_17_aarch64)
HERE=$(cd "$(dirname "$0")" && pwd)
REQUIREMENTS=${REQUIREMENTS:-$HERE/../requirements/sidecar.txt}

pin() { grep -m1 '^xxhash==' "$REQUIREMENTS" | sed 's/[ ;].*//'; }

case ${1:-} in
wheels)
    dir=${2:?wheel directory}
    mkdir -p "$dir"
    for python in "${PYTHONS[@]}"; do
        for platform in "${PLATFORMS[@]}"; do
            ${PIP:-python3 -m pip} download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
                --implementation cp --python-version "$python" --platform "$platform" -d "$dir" "$(pin)"
        done
    done
    ;;
build)
    src=${2:?source tree} wheels=${3:?wheel directory} out=${4:?payload directory}
    mkdir -p "$out"
    cp -R "$src/connector/src/kvpool_connector" "$src/sidecar/src/kvpool_sidecar" "$out/"
    version=$(pin | cut -d= -f3)
    count=0
    for wheel in "$wheels"/xxhash-"$version"-cp3*-manylinux*.whl; do
        python3 -m zipfile -e "$wheel" "$out/"
        count=$((count + 1))
    done
    expected=$((${#PYTHONS[@]} * ${#PLATFORMS[@]}))
    [[ $count -eq $expected ]] || { echo "expected $expected xxhash wheels in $wheels, found $count" >&2; exit 1; }
    rm -rf "$out"/*.dist-info
    find "$out" \( -name __pycache__ -o -name '*.egg-info' \) -prune -exec rm -rf {} +
    chmod -R a+rX "$out"
    ;;
*)
    sed -n '2,12p' "$0" >&2
    exit 2
    ;;
esac
