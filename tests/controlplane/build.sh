#!/usr/bin/env bash
# Builds the end-to-end control plane (etcd, kube-apiserver, kube-controller-manager) from the
# Go module proxy and caches the binaries outside the work tree, keyed by version.
#
#   bash tests/controlplane/build.sh          # prints the bin directory as the last stdout line
#   REPORTS_SERVER_CACHE=/some/dir bash ...   # cache root (default ~/.cache/reports-server)
#   REPORTS_SERVER_GO_BUILD_P=1 bash ...      # go build -p N (default: Go's default, #CPUs)
#   REPORTS_SERVER_REBUILD=1 bash ...         # ignore the stamp and rebuild
#   bash tests/controlplane/build.sh node     # kubelet + kube-scheduler instead (a real node, see
#                                             # tests/src/node.rs), same pin, own cache directory
#
# See docs/e2e.md. Wrapper modules live in the cache directory, never in the repository.
set -euo pipefail

# ---- pinned versions ---------------------------------------------------------------------------
# Kubernetes release (k8s.io/kubernetes) and the matching published staging modules (v0.Y.Z).
KUBE_VERSION=1.36.3
# etcd 3.6.8 is the etcd that Kubernetes v1.36.3 ships with (build/dependencies.yaml and kubeadm's
# DefaultEtcdVersion) and whose client libraries its go.mod requires.
ETCD_VERSION=3.6.8
# Oldest Go that can build both (k8s.io/kubernetes v1.36.3 says `go 1.26.0`).
GO_MIN_MINOR=26
# Build tags of Kubernetes' own release builds (hack/lib/golang.sh, non-debug builds).
KUBE_TAGS=selinux,notest,grpcnotrace
# ------------------------------------------------------------------------------------------------

CACHE_ROOT=${REPORTS_SERVER_CACHE:-$HOME/.cache/reports-server}
# What to build: the control plane (default) or the node's Kubernetes binaries. The node binaries
# get their own cache directory, keyed by the same Kubernetes version, so adding them never
# invalidates the control plane's cache (and a CI machine with a warm control-plane cache only
# builds the two new binaries).
TARGET=${1:-controlplane}
case $TARGET in
controlplane)
    OUT=$CACHE_ROOT/controlplane/k8s-$KUBE_VERSION-etcd-$ETCD_VERSION
    BINARIES=(etcd kube-apiserver kube-controller-manager)
    KUBE_CMDS=(kube-apiserver kube-controller-manager)
    ;;
node)
    OUT=$CACHE_ROOT/node/k8s-$KUBE_VERSION
    BINARIES=(kubelet kube-scheduler)
    KUBE_CMDS=(kubelet kube-scheduler)
    ;;
*)
    printf '[controlplane/build] ERROR: unknown target %s (expected controlplane or node)\n' "$TARGET" >&2
    exit 2
    ;;
esac
BIN=$OUT/bin
STAMP=$OUT/stamp

log() { printf '[controlplane/build] %s\n' "$*" >&2; }
die() {
    printf '[controlplane/build] ERROR: %s\n' "$*" >&2
    exit 1
}

have_all() {
    [[ -f $STAMP ]] || return 1
    local b
    for b in "${BINARIES[@]}"; do [[ -x $BIN/$b ]] || return 1; done
}

if [[ ${REPORTS_SERVER_REBUILD:-} != 1 ]] && have_all; then
    log "cached: $(head -n1 "$STAMP")"
    echo "$BIN"
    exit 0
fi

# ---- preconditions -----------------------------------------------------------------------------
command -v go >/dev/null 2>&1 ||
    die "'go' not found in PATH. Install Go >= 1.$GO_MIN_MINOR (https://go.dev/dl/ or your distribution) \
and make sure the Go module proxy is reachable (go env GOPROXY). Alternatively point \
REPORTS_SERVER_CONTROLPLANE_BIN at a directory containing ${BINARIES[*]}."

GOVERSION=$(go env GOVERSION)
minor=$(sed -n 's/^go1\.\([0-9][0-9]*\).*/\1/p' <<<"$GOVERSION")
if [[ -z $minor || $minor -lt $GO_MIN_MINOR ]]; then
    die "$GOVERSION is too old: Kubernetes v$KUBE_VERSION needs Go >= 1.$GO_MIN_MINOR (GOTOOLCHAIN=local is set on purpose, so no toolchain is downloaded). Install a newer Go."
fi

# GOFLAGS is left alone (go get writes go.mod/go.sum; go build then needs no -mod=mod).
export GOTOOLCHAIN=local CGO_ENABLED=0 GOWORK=off GO111MODULE=on

mkdir -p "$OUT"
exec 9>"$OUT/.lock"
if ! flock -n 9; then
    log "another build holds $OUT/.lock; waiting"
    flock 9
fi
# Someone else may have finished the build while we waited.
if [[ ${REPORTS_SERVER_REBUILD:-} != 1 ]] && have_all; then
    echo "$BIN"
    exit 0
fi

# Is the module proxy reachable? (a cached module answers without the network, which is fine)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/reports-server-cp-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if ! (cd "$WORK" && timeout 120 go mod download -json "k8s.io/kubernetes@v$KUBE_VERSION" >"$WORK/k8s.json" 2>"$WORK/k8s.err"); then
    # go mod download -json reports module errors in the JSON ("Error"), other errors on stderr.
    sed -n 's/^[[:space:]]*"Error": "\(.*\)",\{0,1\}$/\1/p' "$WORK/k8s.json" >&2 || true
    cat "$WORK/k8s.err" >&2 || true
    die "cannot download k8s.io/kubernetes@v$KUBE_VERSION from the Go module proxy \
(GOPROXY=$(go env GOPROXY), GOSUMDB=$(go env GOSUMDB), GOFLAGS=$(go env GOFLAGS)). \
Configure network access to a Go module proxy (e.g. GOPROXY=https://proxy.golang.org) or set \
REPORTS_SERVER_CONTROLPLANE_BIN to prebuilt binaries."
fi
K8S_GOMOD=$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p' "$WORK/k8s.json")
[[ -f $K8S_GOMOD ]] || die "could not find the go.mod of k8s.io/kubernetes@v$KUBE_VERSION (go mod download -json printed: $(cat "$WORK/k8s.json"))"

start=$(date +%s)
log "building $TARGET (${BINARIES[*]}) of Kubernetes v$KUBE_VERSION with $GOVERSION into $BIN"
BUILD_P=()
[[ -n ${REPORTS_SERVER_GO_BUILD_P:-} ]] && BUILD_P=(-p "$REPORTS_SERVER_GO_BUILD_P")
NEW=$OUT/bin.new
rm -rf "$NEW"
mkdir -p "$NEW"

# ---- kube-apiserver + kube-controller-manager --------------------------------------------------
# k8s.io/kubernetes requires every staging module at v0.0.0 and maps it to ./staging/src/... with
# replace directives, which only work inside that repository. A wrapper module replaces each staging
# module with its published twin v0.Y.Z of Kubernetes v1.Y.Z; the list comes from the real go.mod.
STAGING_VERSION=0.${KUBE_VERSION#1.}
MINOR=${KUBE_VERSION#1.}
MINOR=${MINOR%%.*}
mapfile -t STAGING < <(sed -n 's#^[[:space:]]*\(k8s\.io/[^[:space:]]*\)[[:space:]]*=>[[:space:]]*\./staging/.*#\1#p' "$K8S_GOMOD")
((${#STAGING[@]} > 0)) || die "no staging replace directives found in $K8S_GOMOD"
log "k8s.io/kubernetes v$KUBE_VERSION has ${#STAGING[@]} staging modules -> v$STAGING_VERSION"

KW=$OUT/wrappers/k8s
rm -rf "$KW"
mkdir -p "$KW"
(
    cd "$KW"
    go mod init local/reports-server-e2e-k8s >/dev/null 2>&1
    args=()
    for m in "${STAGING[@]}"; do args+=("-replace=$m=$m@v$STAGING_VERSION"); done
    # Keep the GODEBUG defaults Kubernetes chose for its own binaries (godebug lines are main-module only).
    while read -r gd; do [[ -n $gd ]] && args+=("-godebug=$gd"); done < <(sed -n 's/^godebug[[:space:]]\{1,\}\([^()[:space:]]*\)$/\1/p' "$K8S_GOMOD")
    go mod edit "${args[@]}"
    pkgs=()
    for c in "${KUBE_CMDS[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$c@v$KUBE_VERSION"); done
    go get "${pkgs[@]}" >&2
) || die "resolving the Kubernetes wrapper module failed (see above; wrapper in $KW)"

# Version stamping as in hack/lib/version.sh, otherwise /version says v0.0.0-master+$Format:%H$.
KUBE_TIME=$(sed -n 's/^[[:space:]]*"Time": "\(.*\)",\{0,1\}$/\1/p' "$WORK/k8s.json")
KUBE_COMMIT=$(sed -n 's/^[[:space:]]*"Hash": "\(.*\)",\{0,1\}$/\1/p' "$WORK/k8s.json" | head -n1)
LDF="-s -w"
for kv in "gitVersion=v$KUBE_VERSION" "gitMajor=1" "gitMinor=$MINOR" "gitTreeState=clean" \
    ${KUBE_TIME:+"buildDate=$KUBE_TIME"} ${KUBE_COMMIT:+"gitCommit=$KUBE_COMMIT"}; do
    LDF="$LDF -X k8s.io/component-base/version.$kv -X k8s.io/client-go/pkg/version.$kv"
done
t0=$(date +%s)
(
    cd "$KW"
    go build "${BUILD_P[@]}" -trimpath -tags="$KUBE_TAGS" -ldflags="$LDF" -o "$NEW/" \
        "${KUBE_CMDS[@]/#/k8s.io/kubernetes/cmd/}"
) || die "building ${KUBE_CMDS[*]} failed (wrapper in $KW)"
log "${KUBE_CMDS[*]} built in $(($(date +%s) - t0)) s"

# ---- etcd --------------------------------------------------------------------------------------
if [[ $TARGET == controlplane ]]; then
# go.etcd.io/etcd/server/v3 is `package main` at its module root; its replace directives point into
# the etcd monorepo and are not needed: the tagged go.mod requires the published v3.6.x modules.
EW=$OUT/wrappers/etcd
rm -rf "$EW"
mkdir -p "$EW"
(
    cd "$EW"
    go mod init local/reports-server-e2e-etcd >/dev/null 2>&1
    go get "go.etcd.io/etcd/server/v3@v$ETCD_VERSION" >&2
) || die "resolving go.etcd.io/etcd/server/v3@v$ETCD_VERSION failed (wrapper in $EW)"
ETCD_INFO=$(cd "$EW" && go mod download -json "go.etcd.io/etcd/server/v3@v$ETCD_VERSION")
ETCD_COMMIT=$(sed -n 's/^[[:space:]]*"Hash": "\(.*\)",\{0,1\}$/\1/p' <<<"$ETCD_INFO" | head -n1)
t0=$(date +%s)
(
    cd "$EW"
    go build "${BUILD_P[@]}" -trimpath \
        -ldflags="-s -w${ETCD_COMMIT:+ -X go.etcd.io/etcd/api/v3/version.GitSHA=${ETCD_COMMIT:0:10}}" \
        -o "$NEW/etcd" go.etcd.io/etcd/server/v3
) || die "building etcd failed (wrapper in $EW)"
log "etcd built in $(($(date +%s) - t0)) s"
fi

# ---- smoke-check and publish -------------------------------------------------------------------
# The output is captured, not piped into `grep -q`: grep exits at its first match, the
# command then dies of SIGPIPE writing its next line, and pipefail fails the check (seen with
# etcd's four-line --version).
for c in "${KUBE_CMDS[@]}"; do
    reported=$("$NEW/$c" --version) || die "$c --version failed"
    [[ $reported == *"v$KUBE_VERSION"* ]] || die "$c --version does not report v$KUBE_VERSION: $reported"
done
if [[ $TARGET == controlplane ]]; then
    reported=$("$NEW/etcd" --version) || die "etcd --version failed"
    [[ $reported == *"$ETCD_VERSION"* ]] || die "etcd --version does not report $ETCD_VERSION: $reported"
fi

rm -f "$STAMP"
rm -rf "$BIN"
mv "$NEW" "$BIN"
elapsed=$(($(date +%s) - start))
{
    if [[ $TARGET == controlplane ]]; then
        echo "kubernetes v$KUBE_VERSION etcd v$ETCD_VERSION built with $GOVERSION in ${elapsed}s on $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    else
        echo "kubernetes v$KUBE_VERSION ${KUBE_CMDS[*]} built with $GOVERSION in ${elapsed}s on $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    fi
    echo "staging modules: ${#STAGING[@]}"
    echo "tags: $KUBE_TAGS"
    for c in "${KUBE_CMDS[@]}"; do "$BIN/$c" --version; done
    if [[ $TARGET == controlplane ]]; then "$BIN/etcd" --version; fi
} >"$STAMP"
log "done in ${elapsed}s: $(du -sh "$BIN" | cut -f1) in $BIN"
echo "$BIN"
