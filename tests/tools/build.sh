#!/usr/bin/env bash
# Builds the Go tools the operator tests use, from the Go module proxy, and caches them outside
# the work tree, keyed by version:
#
#   helm     helm.sh/helm/v4/cmd/helm v4.3.1 (renders manifests/helm/reports-server)
#   kstatus  tests/tools/kstatus/main.go against sigs.k8s.io/cli-utils v0.37.2 (pkg/kstatus/status)
#   argocd   tests/tools/argocd-lua/main.go against github.com/argoproj/argo-cd/v3 v3.6.1 (util/lua)
#
#   bash tests/tools/build.sh helm|kstatus|argocd   # prints the tool's binary path as the last stdout line
#   bash tests/tools/build.sh all                   # builds all three (what .ci/run calls)
#   REPORTS_SERVER_GOTOOLCHAIN=goX.Y.Z              # the Go toolchain (default: the local go; go1.27.0
#                                                   # for argocd, which needs Go >= 1.27: the go command
#                                                   # fetches it from the module proxy)
#   REPORTS_SERVER_CACHE=/dir  REPORTS_SERVER_REBUILD=1  REPORTS_SERVER_GO_BUILD_P=N   as for
#   tests/controlplane/build.sh (cache root, ignore the stamp, go build -p N).
#
# Non-local `replace` and `godebug` lines of the required module's go.mod are copied into the
# throw-away wrapper module, because they only act in the main module (Argo CD pins k8s.io/*
# that way). See docs/operator.md.
set -euo pipefail

HELM_VERSION=v4.3.1
CLI_UTILS_VERSION=v0.37.2
ARGOCD_VERSION=v3.6.1

HERE=$(cd "$(dirname "$0")" && pwd)
CACHE_ROOT=${REPORTS_SERVER_CACHE:-$HOME/.cache/reports-server}

# shellcheck source=../lib/gomod.sh
source "$HERE/../lib/gomod.sh"
log() { printf '[tools/build] %s\n' "$*" >&2; }
die() {
    printf '[tools/build] ERROR: %s\n' "$*" >&2
    exit 1
}

command -v go >/dev/null 2>&1 ||
    die "'go' not found in PATH. Install Go >= 1.26 (https://go.dev/dl/ or your distribution) and make \
sure the Go module proxy is reachable (go env GOPROXY)."
command -v flock >/dev/null 2>&1 || die "'flock' not found: install util-linux"
# GOTOOLCHAIN=local unless REPORTS_SERVER_GOTOOLCHAIN names one. Argo CD v3.6.1 needs Go >= 1.27,
# so its build defaults to go1.27.0, which the go command fetches from the module proxy (a cold
# build takes 45-60 min on 2 cores: the runner pulls in most of Argo CD; it is then cached).
ARGOCD_GOTOOLCHAIN=${REPORTS_SERVER_GOTOOLCHAIN:-go1.27.0}
export GOTOOLCHAIN=${REPORTS_SERVER_GOTOOLCHAIN:-local} CGO_ENABLED=0 GOWORK=off GO111MODULE=on
BUILD_P=()
[[ -n ${REPORTS_SERVER_GO_BUILD_P:-} ]] && BUILD_P=(-p "$REPORTS_SERVER_GO_BUILD_P")

# build NAME MODULE VERSION PACKAGE [SOURCE_DIR]: builds PACKAGE (or SOURCE_DIR/main.go in the
# wrapper module) into $CACHE_ROOT/tools/NAME-VERSION/bin/NAME and prints that path.
build() {
    local name=$1 module=$2 version=$3 package=$4 source=${5:-}
    local out=$CACHE_ROOT/tools/$name-$version
    local bin=$out/bin/$name stamp=$out/stamp
    local src_sum=none
    [[ -n $source ]] && src_sum=$(sha256sum "$source/main.go" | cut -c1-16)
    if [[ ${REPORTS_SERVER_REBUILD:-} != 1 && -x $bin && -f $stamp ]] && grep -q "source=$src_sum" "$stamp"; then
        log "cached: $(head -n1 "$stamp")"
        echo "$bin"
        return 0
    fi
    mkdir -p "$out"
    exec 9>"$out/.lock"
    flock 9
    local start w
    start=$(date +%s)
    w=$out/wrapper
    rm -rf "$w"
    mkdir -p "$w"
    (
        cd "$w"
        go mod init local/reports-server-tools-$name >/dev/null 2>&1
        local json
        json=$(timeout 600 go mod download -json "$module@$version") ||
            die "cannot download $module@$version from the Go module proxy (GOPROXY=$(go env GOPROXY)). \
If the error says 'requires go >= X', install that Go or set REPORTS_SERVER_GOTOOLCHAIN=goX (fetched from the module proxy): $json"
        local gomod
        gomod=$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p' <<<"$json")
        [[ -f $gomod ]] || die "no go.mod for $module@$version"
        copy_main_module_directives "$gomod"
        if [[ -n $source ]]; then
            cp "$source/main.go" .
            go get "$module@$version" >&2
            go mod tidy >&2
        else
            go get "$package@$version" >&2
        fi
    ) || die "resolving the $name wrapper module failed (wrapper in $w)"
    local t0
    t0=$(date +%s)
    (
        cd "$w"
        if [[ -n $source ]]; then
            go build "${BUILD_P[@]}" -trimpath -ldflags="-s -w" -o "$bin.new" .
        else
            go build "${BUILD_P[@]}" -trimpath -ldflags="-s -w" -o "$bin.new" "$package"
        fi
    ) || die "building $name failed (wrapper in $w)"
    mv "$bin.new" "$bin"
    echo "$name $version ($module) built with $(go env GOVERSION) in $(($(date +%s) - start))s (compile $(($(date +%s) - t0))s) on $(date -u +%Y-%m-%dT%H:%M:%SZ) source=$src_sum" >"$stamp"
    log "$(cat "$stamp")"
    echo "$bin"
}

case ${1:-all} in
helm) build helm helm.sh/helm/v4 "$HELM_VERSION" helm.sh/helm/v4/cmd/helm ;;
kstatus) build kstatus sigs.k8s.io/cli-utils "$CLI_UTILS_VERSION" "" "$HERE/kstatus" ;;
argocd) GOTOOLCHAIN=$ARGOCD_GOTOOLCHAIN build argocd-lua github.com/argoproj/argo-cd/v3 "$ARGOCD_VERSION" "" "$HERE/argocd-lua" ;;
all)
    "$0" helm
    "$0" kstatus
    "$0" argocd
    ;;
*) die "unknown tool ${1}: use helm, kstatus, argocd or all" ;;
esac
