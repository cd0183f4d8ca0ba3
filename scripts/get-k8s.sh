#!/usr/bin/env bash
# get-k8s.sh - build a real Kubernetes control plane for the integration tests.
#
# Builds, with the ordinary Go client from the Go module proxy (the machine's
# default GOPROXY; no registry host is named here):
#   kube-apiserver, kube-controller-manager, kube-scheduler  (module k8s.io/kubernetes)
#   etcd                                                     (module go.etcd.io/etcd/server/v3)
#   kwok                                                     (module sigs.k8s.io/kwok)
# and, with --node, the real node's kubelet and kube-proxy (module k8s.io/kubernetes, same pins) and
# its cluster DNS, CoreDNS (module github.com/coredns/coredns, pinned by tests/node/coredns/go.mod)
# and kwok's "fast" Stage configs (node + pod lifecycle), then installs them into
#   <repo>/.tools/k8s/bin/      the five binaries (hard links, or copies)
#   <repo>/.tools/k8s/stages/   kwok-fast.yaml (all fast stages, for `kwok --config`)
#   <repo>/.tools/k8s/VERSIONS  the pins
#   <repo>/.tools/k8s/node/bin/ kubelet, kube-proxy, coredns (--node; their own cache entry, so adding
#                               the node never rebuilds the control plane)
#
# Build results are cached outside the work tree in
#   ${KVPOOL_TOOLS_CACHE:-$HOME/.cache/kvpool/k8s}/<pins-hash>/{bin,stages,stamp}
# A matching stamp means nothing is built; only the install step runs (seconds).
# GOMODCACHE and GOCACHE stay at Go's defaults (outside the work tree).
#
# k8s.io/kubernetes cannot be built with `go install pkg@version` (its go.mod replaces
# every k8s.io/* staging module with ./staging/...), so it is built from a throw-away
# wrapper module that requires k8s.io/kubernetes and replaces each staging module
# (every k8s.io/* it requires at v0.0.0) with the published v0.<minor>.<patch>.
# etcd's server module has replace directives too (=> ../api, ...) but requires real
# tags, so its wrapper needs no replaces. kwok is a plain `go install`.
#
# Env: KVPOOL_TOOLS_CACHE   cache root (default $HOME/.cache/kvpool/k8s)
#      KVPOOL_BUILD_JOBS    go build -p (default 2)
#      KVPOOL_K8S_REBUILD=1 ignore the stamp and rebuild
# Prints the bin directory on stdout; logs go to stderr.
set -euo pipefail

# ---- pins (change one -> new cache dir -> rebuild) ---------------------------------
K8S_VERSION=v1.35.4   # newest 1.35.x on the proxy; go.mod says go 1.25.0
ETCD_VERSION=v3.6.16  # newest 3.6.x; go.mod says go 1.26.0 (>= 3.5.13 needed for RequestWatchProgress)
KWOK_VERSION=v0.8.0   # go.mod says go 1.26.0 (must stay <= the local Go: GOTOOLCHAIN=local)
RECIPE_REV=1          # bump when the build recipe below changes in a way that alters the output

log() { printf '[get-k8s] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

command -v go >/dev/null 2>&1 ||
    die "'go' not found on PATH. Install Go >= 1.26 and re-run."

export GOTOOLCHAIN=local  # never download another toolchain
export GOWORK=off         # an outer go.work must not leak into the wrapper modules
export CGO_ENABLED=0

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=$REPO_ROOT/.tools/k8s
CACHE_ROOT=${KVPOOL_TOOLS_CACHE:-$HOME/.cache/kvpool/k8s}
JOBS=${KVPOOL_BUILD_JOBS:-2}
GOOS_ARCH=$(go env GOOS)/$(go env GOARCH)
PINS="kubernetes=$K8S_VERSION
etcd=$ETCD_VERSION
kwok=$KWOK_VERSION
recipe=$RECIPE_REV
platform=$GOOS_ARCH"
HASH=$(printf '%s\n' "$PINS" | sha256sum | cut -c1-16)
CACHE=$CACHE_ROOT/$HASH
STAMP=$CACHE/stamp
BINS=(kube-apiserver kube-controller-manager kube-scheduler etcd kwok)
NODE_BINS=(kubelet kube-proxy coredns)
COREDNS_SRC=$REPO_ROOT/tests/node/coredns
NODE_PINS="kubernetes=$K8S_VERSION
node=kubelet,kube-proxy,coredns
coredns=$(cat "$COREDNS_SRC/go.mod" "$COREDNS_SRC/main.go" | sha256sum | cut -c1-16)
recipe=$RECIPE_REV
platform=$GOOS_ARCH"
NODE_CACHE=$CACHE_ROOT/$(printf '%s\n' "$NODE_PINS" | sha256sum | cut -c1-16)

NICE=()
command -v nice >/dev/null 2>&1 && NICE=(nice -n 10)
gobuild() { "${NICE[@]}" go "$@"; }

# built DIR PINS BIN...: DIR holds a build of exactly PINS with every BIN in DIR/bin
built() {
    local dir=$1 pins=$2 b; shift 2
    [[ -f $dir/stamp ]] && [[ "$(cat "$dir/stamp")" == "$pins" ]] || return 1
    for b; do [[ -x $dir/bin/$b ]] || return 1; done
}

cache_ok() { built "$CACHE" "$PINS" "${BINS[@]}" && [[ -f $CACHE/stages/kwok-fast.yaml ]]; }

# Hard link when on the same filesystem (no copy, survives cache removal), else copy.
link_or_copy() { ln -f "$1" "$2" 2>/dev/null || cp -f "$1" "$2"; }

# Print the value of a "Key": "value" field from `go mod download -json` output.
json_field() { sed -n "s/^[[:space:]]*\"$1\": \"\(.*\)\",\{0,1\}\$/\1/p" | head -n1; }

build_k8s() {  # build_k8s WORK OUT CMD...  (CMD: names under k8s.io/kubernetes/cmd/)
    local work=$1 out=$2; shift 2
    local ver=$K8S_VERSION
    local xy=${ver#v1.}              # 35.4
    local minor=${xy%%.*}            # 35
    local staging_ver=v0.$xy         # v0.35.4
    log "kubernetes $ver: reading its go.mod"
    mkdir -p "$work/k8s"
    cd "$work/k8s"
    go mod init kvpool.local/k8sbins 2>/dev/null || die "go mod init failed in $PWD"
    local gomod
    gomod=$(go mod download -json "k8s.io/kubernetes@$ver" | json_field GoMod)
    [[ -f $gomod ]] || die "could not download k8s.io/kubernetes@$ver's go.mod"
    # Staging modules: every k8s.io/* required at v0.0.0 (plus any `=> ./staging/...`
    # replace, which covers staging modules that are not required).
    local mods
    mods=$(awk '
        $1 ~ /^k8s\.io\// && $2 == "v0.0.0" { print $1 }
        $0 ~ /^require k8s\.io\/.* v0\.0\.0$/ { print $2 }
        $2 == "=>" && $3 ~ /^\.\/staging\// { print $1 }
        $1 == "replace" && $3 == "=>" && $4 ~ /^\.\/staging\// { print $2 }
    ' "$gomod" | sort -u)
    [[ -n $mods ]] || die "found no v0.0.0 staging modules in $gomod"
    log "kubernetes $ver: replacing $(wc -l <<<"$mods") staging modules with $staging_ver"
    local m args=()
    for m in $mods; do args+=("-replace=$m=$m@$staging_ver"); done
    go mod edit "${args[@]}"
    local pkgs=("${@/#/k8s.io/kubernetes/cmd/}")
    log "kubernetes $ver: resolving modules (go get)"
    gobuild get "${pkgs[@]/%/@$ver}"
    local ld=(-s -w) k
    for k in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ld+=("-X=$k.gitVersion=$ver" "-X=$k.gitMajor=1" "-X=$k.gitMinor=$minor" "-X=$k.gitTreeState=clean")
    done
    log "kubernetes $ver: building ${pkgs[*]##*/} (-p $JOBS)"
    gobuild build -p "$JOBS" -trimpath -ldflags "${ld[*]}" -o "$out/" "${pkgs[@]}"
}

build_etcd() {
    local work=$1 out=$2
    log "etcd $ETCD_VERSION: resolving modules"
    mkdir -p "$work/etcd"
    cd "$work/etcd"
    go mod init kvpool.local/etcdbin 2>/dev/null || die "go mod init failed in $PWD"
    gobuild get "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
    log "etcd $ETCD_VERSION: building (-p $JOBS)"
    gobuild build -p "$JOBS" -trimpath -ldflags "-s -w" -o "$out/etcd" go.etcd.io/etcd/server/v3
}

build_kwok() {
    local work=$1 out=$2
    log "kwok $KWOK_VERSION: building (-p $JOBS)"
    cd "$work"
    GOBIN=$out gobuild install -p "$JOBS" -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
}

copy_kwok_stages() {
    local out=$1 dir s f
    cd "$CACHE"
    dir=$(go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | json_field Dir)
    [[ -d $dir/kustomize/stage ]] || die "kwok module dir has no kustomize/stage: '$dir'"
    mkdir -p "$out"
    # One file, the set of kwok's kustomize/stage/fast: node initialize + heartbeat (with lease) + pod fast.
    : >"$out/kwok-fast.yaml"
    for s in node/fast node/heartbeat-with-lease pod/fast; do
        for f in "$dir/kustomize/stage/$s"/*.yaml; do
            [[ $(basename "$f") == kustomization.yaml ]] && continue
            { [[ -s $out/kwok-fast.yaml ]] && echo '---'; cat "$f"; } >>"$out/kwok-fast.yaml"
        done
    done
}

verify() {
    local bin=$1 v
    v=$("$bin/kube-apiserver" --version 2>&1) || die "kube-apiserver --version failed: $v"
    [[ $v == "Kubernetes $K8S_VERSION" ]] || die "kube-apiserver reports '$v', expected 'Kubernetes $K8S_VERSION'"
    v=$("$bin/etcd" --version 2>&1) || die "etcd --version failed: $v"
    grep -q "^etcd Version: ${ETCD_VERSION#v}\$" <<<"$v" || die "etcd reports '$v'"
    v=$("$bin/kwok" --version 2>&1) || die "kwok --version failed: $v"
    grep -q "${KWOK_VERSION#v}" <<<"$v" || die "kwok reports '$v'"
    "$bin/kube-controller-manager" --version >/dev/null 2>&1 || die "kube-controller-manager --version failed"
    "$bin/kube-scheduler" --version >/dev/null 2>&1 || die "kube-scheduler --version failed"
}

build_all() {
    local work=$CACHE/work new=$CACHE/bin.new
    rm -rf "$work" "$new" "$CACHE/stages.new" "$STAMP"
    mkdir -p "$work" "$new"
    log "building into $CACHE (go: $(go env GOVERSION), GOMODCACHE=$(go env GOMODCACHE), GOCACHE=$(go env GOCACHE))"
    local t0=$SECONDS
    (build_etcd "$work" "$new")
    (build_kwok "$work" "$new")
    (build_k8s "$work" "$new" kube-apiserver kube-controller-manager kube-scheduler)
    (copy_kwok_stages "$CACHE/stages.new")
    verify "$new"
    rm -rf "$CACHE/bin" "$CACHE/stages"
    mv "$new" "$CACHE/bin"
    mv "$CACHE/stages.new" "$CACHE/stages"
    rm -rf "$work"
    printf '%s\n' "$PINS" >"$STAMP"
    log "build done in $((SECONDS - t0)) s"
}

installed_ok() {
    local b
    [[ -f $DEST/VERSIONS && "$(cat "$DEST/VERSIONS")" == "$PINS" ]] || return 1
    for b in "${BINS[@]}"; do cmp -s "$CACHE/bin/$b" "$DEST/bin/$b" || return 1; done
    diff -rq "$CACHE/stages" "$DEST/stages" >/dev/null 2>&1
}

install_into_repo() {
    local b
    if installed_ok; then
        log "$DEST is up to date"
        return 0
    fi
    rm -rf "$DEST/bin" "$DEST/stages"
    mkdir -p "$DEST/bin" "$DEST/stages"
    for b in "${BINS[@]}"; do link_or_copy "$CACHE/bin/$b" "$DEST/bin/$b"; done
    cp -f "$CACHE/stages/"*.yaml "$DEST/stages/"
    printf '%s\n' "$PINS" >"$DEST/VERSIONS"
    log "installed ${BINS[*]} into $DEST/bin, kwok stages into $DEST/stages"
}

# The real node's binaries: cached and installed like the control plane's, under their own pins.
node_binaries() {
    local b v dest=$DEST/node
    mkdir -p "$NODE_CACHE"
    if ! built "$NODE_CACHE" "$NODE_PINS" "${NODE_BINS[@]}"; then
        local work=$NODE_CACHE/work new=$NODE_CACHE/bin.new t0=$SECONDS
        rm -rf "$work" "$new" "$NODE_CACHE/stamp"; mkdir -p "$work" "$new"
        (build_k8s "$work" "$new" kubelet kube-proxy)
        log "coredns: building (-p $JOBS)"
        (cd "$COREDNS_SRC" && gobuild build -p "$JOBS" -trimpath -ldflags "-s -w" -o "$new/coredns" .)
        v=$("$new/kubelet" --version 2>&1) || die "kubelet --version failed: $v"
        [[ $v == "Kubernetes $K8S_VERSION" ]] || die "kubelet reports '$v', expected 'Kubernetes $K8S_VERSION'"
        rm -rf "$NODE_CACHE/bin" "$work"; mv "$new" "$NODE_CACHE/bin"
        printf '%s\n' "$NODE_PINS" >"$NODE_CACHE/stamp"
        log "node binaries built in $((SECONDS - t0)) s"
    fi
    mkdir -p "$dest/bin"
    for b in "${NODE_BINS[@]}"; do
        cmp -s "$NODE_CACHE/bin/$b" "$dest/bin/$b" || link_or_copy "$NODE_CACHE/bin/$b" "$dest/bin/$b"
    done
}

mkdir -p "$CACHE"
# Serialise concurrent runs sharing one cache.
if command -v flock >/dev/null 2>&1; then
    exec 9>"$CACHE/.lock"
    flock 9
fi

if [[ ${KVPOOL_K8S_REBUILD:-0} != 1 ]] && cache_ok; then
    log "cache hit: $CACHE ($(paste -sd ' ' "$STAMP"))"
else
    trap 'log "FAILED; partial work left in $CACHE/work"' ERR
    build_all
    trap - ERR
fi
install_into_repo
[[ ${1:-} == --node ]] && node_binaries
printf '%s\n' "$DEST/bin"
