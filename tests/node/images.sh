#!/usr/bin/env bash
# images.sh - kvpool's images for the real node, built locally from the project's Dockerfile with
# podman and saved as docker-archives that `ctr images import` takes (no registry is reachable here):
#   pause.tar      localhost/kvpool/pause:1        the pod sandbox (a static Go pause, tests/node/pause)
#   sidecar.tar    localhost/kvpool/sidecar:node   Dockerfile --target sidecar
#   operator.tar   localhost/kvpool/operator:node  Dockerfile --target operator
#   redis.tar      localhost/kvpool/redis:7        Debian's redis-server (what a pool's spec.redis.image
#                                                  names; the public redis image needs a registry)
# The Python base is Debian bookworm's python3 made by mmdebstrap (as the image test makes it), and
# pip installs from a wheelhouse of the pinned requirements mounted into the build.
#
# Cached outside the work tree, keyed by a hash of every input:
#   ${KVPOOL_IMAGES_CACHE:-$HOME/.cache/kvpool/images}/<hash>/*.tar
# A complete entry means nothing is built. podman runs with its own store under the cache root, so
# the host's podman store is left alone. Prints the directory holding the tars.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
ROOT=${KVPOOL_IMAGES_CACHE:-$HOME/.cache/kvpool/images}
RECIPE_REV=1
log() { printf '[images] %s\n' "$*" >&2; }

inputs() {
    cd "$REPO"
    echo "recipe=$RECIPE_REV"
    find Dockerfile requirements sidecar/src sidecar/pyproject.toml connector/src connector/pyproject.toml \
        operator/src operator/pyproject.toml tests/node/pause tests/node/images.sh -type f \
        -not -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum
}
HASH=$(inputs | sha256sum | cut -c1-16)
OUT=$ROOT/$HASH
TARS=(pause sidecar operator redis)
complete() { local t; for t in "${TARS[@]}"; do [[ -s $OUT/$t.tar ]] || return 1; done; }

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
PODMAN=(nice -n 10 podman --root "$ROOT/podman/root" --runroot "$ROOT/podman/runroot" --storage-driver overlay)
WORK=$ROOT/work.$$
trap 'rm -rf "$WORK"' EXIT
rm -rf "$OUT.new"; mkdir -p "$WORK/pause-root" "$OUT.new"

# the sandbox: a static pause binary, nothing else
(cd "$HERE/pause" && GOTOOLCHAIN=local GOWORK=off CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" \
    -o "$WORK/pause-root/pause" .)
tar -C "$WORK/pause-root" -cf "$WORK/pause-rootfs.tar" .
"${PODMAN[@]}" import --quiet --change 'ENTRYPOINT ["/pause"]' "$WORK/pause-rootfs.tar" localhost/kvpool/pause:1 >/dev/null

# the Python base, once per cache root (its own recipe: Debian's bookworm python3)
BASE=localhost/kvpool/python-base:3.11-bookworm
if [[ ! -s $ROOT/python-base-rootfs.tar ]]; then
    log "making the Python base from Debian's packages (mmdebstrap)"
    mmdebstrap --quiet --variant=apt --include=python3,python3-venv,ca-certificates \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' bookworm "$WORK/base.tar"
    mv "$WORK/base.tar" "$ROOT/python-base-rootfs.tar"
fi
"${PODMAN[@]}" image exists "$BASE" ||
    "${PODMAN[@]}" import --quiet --change 'CMD ["/usr/bin/python3"]' "$ROOT/python-base-rootfs.tar" "$BASE" >/dev/null

# Redis: Debian's redis-server and what it depends on, nothing else
mmdebstrap --quiet --variant=essential --include=redis-server \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' bookworm "$WORK/redis.tar"
"${PODMAN[@]}" import --quiet --change 'CMD ["redis-server"]' "$WORK/redis.tar" localhost/kvpool/redis:7 >/dev/null
rm -f "$WORK/redis.tar"

mkdir -p "$WORK/wheels"
# every pinned wheel, markers dropped: a line for another Python (async-timeout before 3.11.3) is
# skipped by this one, but the image's Python may need it
sed 's/;.*//' "$REPO"/requirements/{sidecar,operator,build}.txt >"$WORK/wheels.txt"
"$REPO/.venv/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    -r "$WORK/wheels.txt" -d "$WORK/wheels" 2> >(grep -v 'is neither a file nor a directory' >&2)
for target in sidecar operator; do
    log "building $target"
    "${PODMAN[@]}" build --quiet --target "$target" --tag "localhost/kvpool/$target:node" \
        --build-arg "PYTHON_IMAGE=$BASE" --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=/wheelhouse \
        --volume "$WORK/wheels:/wheelhouse:ro" "$REPO" 2> >(grep -v 'build argument' >&2) >/dev/null
done
"${PODMAN[@]}" save --quiet --format docker-archive -o "$OUT.new/pause.tar" localhost/kvpool/pause:1
"${PODMAN[@]}" save --quiet --format docker-archive -o "$OUT.new/redis.tar" localhost/kvpool/redis:7
for target in sidecar operator; do
    "${PODMAN[@]}" save --quiet --format docker-archive -o "$OUT.new/$target.tar" "localhost/kvpool/$target:node"
done
# only the tars are kept: the store's layers would double the disk they take
"${PODMAN[@]}" rmi --all --force >/dev/null 2>&1 || true
rm -rf "$OUT"; mv "$OUT.new" "$OUT"
# older entries are other inputs' images: drop them
find "$ROOT" -mindepth 1 -maxdepth 1 -type d -name '????????????????' -not -name "$HASH" -exec rm -rf {} +
log "built in $((SECONDS - T0)) s: $(du -sh "$OUT" | cut -f1) in $OUT"
echo "$OUT"
