#!/usr/bin/env bash
# Makes the Python base image the image test builds on, without a registry (none is reachable here):
# a minimal Debian bookworm with python3 and venv, made by mmdebstrap from Debian's packages and
# imported into podman. Its Python (3.11) matches python:3.11-slim's, so the Dockerfile is the same.
# Another Debian suite gives another Python (trixie: 3.13), for what must run on several.
# Installs runc and mmdebstrap from Debian's packages when missing (needs root and apt-get).
# Usage: base-image.sh IMAGE_NAME [SUITE]   (does nothing if the image exists; SUITE: bookworm)
set -euo pipefail
IMAGE=${1:?image name}
SUITE=${2:-bookworm}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$(dirname "$0")/containers.conf}

missing=()
command -v runc >/dev/null 2>&1 || missing+=(runc)
command -v mmdebstrap >/dev/null 2>&1 || missing+=(mmdebstrap)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[base-image] installing ${missing[*]} from Debian's packages" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "[base-image] missing: ${missing[*]} (apt-get install ${missing[*]})" >&2
    exit 2
  fi
fi

if podman image exists "$IMAGE"; then exit 0; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mmdebstrap --quiet --variant=apt --include=python3,python3-venv,ca-certificates \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  "$SUITE" "$work/rootfs.tar"
podman import --quiet --change 'CMD ["/usr/bin/python3"]' "$work/rootfs.tar" "$IMAGE" >/dev/null
echo "[base-image] $IMAGE ready" >&2
