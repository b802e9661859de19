#!/usr/bin/env bash
# Builds Kyverno (admission controller, reports controller, background controller) from the Go
# module proxy for the end-to-end tests and caches the binaries plus the Kyverno CRDs the tests
# install, outside the work tree, keyed by version.
#
#   bash tests/kyverno/build.sh               # prints the cache directory as the last stdout line
#   REPORTS_SERVER_CACHE=/some/dir bash ...   # cache root (default ~/.cache/reports-server)
#   REPORTS_SERVER_GO_BUILD_P=1 bash ...      # go build -p N (default: Go's default, #CPUs)
#   REPORTS_SERVER_REBUILD=1 bash ...         # ignore the stamp and rebuild
#
# Layout of the cache directory (what tests/src/kyverno.rs reads):
#   bin/kyverno bin/reports-controller bin/background-controller
#   crds/kyverno/*.yaml crds/policies.kyverno.io/*.yaml   (copied from the module source)
#   stamp
#
# See docs/e2e.md and docs/kyverno.md. The wrapper module lives in the cache directory, never in
# the repository.
set -euo pipefail

# ---- pinned versions ---------------------------------------------------------------------------
KYVERNO_VERSION=v1.19.1
# Kyverno v1.19.1's go.mod says `go 1.26.6`.
GO_MIN_MINOR=26
GO_MIN_PATCH=6
# ------------------------------------------------------------------------------------------------

CACHE_ROOT=${REPORTS_SERVER_CACHE:-$HOME/.cache/reports-server}
OUT=$CACHE_ROOT/kyverno-$KYVERNO_VERSION
BIN=$OUT/bin
STAMP=$OUT/stamp
BINARIES=(kyverno reports-controller background-controller)
CRD_DIRS=(kyverno policies.kyverno.io)

# shellcheck source=../lib/gomod.sh
source "$(dirname "$0")/../lib/gomod.sh"
log() { printf '[kyverno/build] %s\n' "$*" >&2; }
die() {
    printf '[kyverno/build] ERROR: %s\n' "$*" >&2
    exit 1
}

have_all() {
    [[ -f $STAMP ]] || return 1
    local b d
    for b in "${BINARIES[@]}"; do [[ -x $BIN/$b ]] || return 1; done
    for d in "${CRD_DIRS[@]}"; do compgen -G "$OUT/crds/$d/*.yaml" >/dev/null || return 1; done
}

if [[ ${REPORTS_SERVER_REBUILD:-} != 1 ]] && have_all; then
    log "cached: $(head -n1 "$STAMP")"
    echo "$OUT"
    exit 0
fi

# ---- preconditions -----------------------------------------------------------------------------
command -v go >/dev/null 2>&1 ||
    die "'go' not found in PATH. Install Go >= 1.$GO_MIN_MINOR.$GO_MIN_PATCH (https://go.dev/dl/ or \
your distribution) and make sure the Go module proxy is reachable (go env GOPROXY)."

GOVERSION=$(go env GOVERSION)
minor=$(sed -n 's/^go1\.\([0-9][0-9]*\).*/\1/p' <<<"$GOVERSION")
patch=$(sed -n 's/^go1\.[0-9][0-9]*\.\([0-9][0-9]*\).*/\1/p' <<<"$GOVERSION")
if [[ -z $minor || $minor -lt $GO_MIN_MINOR || ($minor -eq $GO_MIN_MINOR && ${patch:-0} -lt $GO_MIN_PATCH) ]]; then
    die "$GOVERSION is too old: Kyverno $KYVERNO_VERSION needs Go >= 1.$GO_MIN_MINOR.$GO_MIN_PATCH \
(GOTOOLCHAIN=local is set on purpose, so no toolchain is downloaded). Install a newer Go."
fi

export GOTOOLCHAIN=local CGO_ENABLED=0 GOWORK=off GO111MODULE=on

mkdir -p "$OUT"
exec 9>"$OUT/.lock"
if ! flock -n 9; then
    log "another build holds $OUT/.lock; waiting"
    flock 9
fi
# Someone else may have finished the build while we waited.
if [[ ${REPORTS_SERVER_REBUILD:-} != 1 ]] && have_all; then
    echo "$OUT"
    exit 0
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/reports-server-kyverno-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if ! (cd "$WORK" && timeout 300 go mod download -json "github.com/kyverno/kyverno@$KYVERNO_VERSION" >"$WORK/kyv.json" 2>"$WORK/kyv.err"); then
    sed -n 's/^[[:space:]]*"Error": "\(.*\)",\{0,1\}$/\1/p' "$WORK/kyv.json" >&2 || true
    cat "$WORK/kyv.err" >&2 || true
    die "cannot download github.com/kyverno/kyverno@$KYVERNO_VERSION from the Go module proxy \
(GOPROXY=$(go env GOPROXY), GOSUMDB=$(go env GOSUMDB), GOFLAGS=$(go env GOFLAGS)). \
Configure network access to a Go module proxy (e.g. GOPROXY=https://proxy.golang.org)."
fi
KYV_GOMOD=$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p' "$WORK/kyv.json")
KYV_DIR=$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p' "$WORK/kyv.json")
[[ -f $KYV_GOMOD ]] || die "could not find the go.mod of github.com/kyverno/kyverno@$KYVERNO_VERSION (go mod download -json printed: $(cat "$WORK/kyv.json"))"
[[ -d $KYV_DIR/config/crds ]] || die "the module source of github.com/kyverno/kyverno@$KYVERNO_VERSION has no config/crds (looked in $KYV_DIR)"

start=$(date +%s)
log "building Kyverno $KYVERNO_VERSION with $GOVERSION into $BIN"
BUILD_P=()
[[ -n ${REPORTS_SERVER_GO_BUILD_P:-} ]] && BUILD_P=(-p "$REPORTS_SERVER_GO_BUILD_P")
NEW=$OUT/bin.new
rm -rf "$NEW"
mkdir -p "$NEW"

# ---- wrapper module ----------------------------------------------------------------------------
# `go install pkg@version` refuses modules with replace directives, and replace directives only act
# in the main module: a throw-away wrapper module copies every non-local replace of Kyverno's go.mod.
# Kyverno's own godebug lines are main-module only as well, so they are copied too.
W=$OUT/wrapper
rm -rf "$W"
mkdir -p "$W"
(
    cd "$W"
    go mod init local/reports-server-e2e-kyverno >/dev/null 2>&1
    copy_main_module_directives "$KYV_GOMOD"
    KC=github.com/kyverno/kyverno/cmd
    go get "$KC/kyverno@$KYVERNO_VERSION" "$KC/reports-controller@$KYVERNO_VERSION" \
        "$KC/background-controller@$KYVERNO_VERSION" >&2
) || die "resolving the Kyverno wrapper module failed (see above; wrapper in $W)"

t0=$(date +%s)
(
    cd "$W"
    KC=github.com/kyverno/kyverno/cmd
    go build "${BUILD_P[@]}" -trimpath \
        -ldflags="-s -w -X github.com/kyverno/kyverno/pkg/version.BuildVersion=$KYVERNO_VERSION" \
        -o "$NEW/" "$KC/kyverno" "$KC/reports-controller" "$KC/background-controller"
) || die "building Kyverno failed (wrapper in $W)"
log "Kyverno binaries built in $(($(date +%s) - t0)) s"

# ---- CRDs --------------------------------------------------------------------------------------
# Only Kyverno's own groups: wgpolicyk8s.io, reports.kyverno.io and openreports.io are served by
# reports-server through APIServices and must not be installed as CRDs.
NEWCRDS=$OUT/crds.new
rm -rf "$NEWCRDS"
mkdir -p "$NEWCRDS"
for d in "${CRD_DIRS[@]}"; do
    [[ -d $KYV_DIR/config/crds/$d ]] || die "missing $KYV_DIR/config/crds/$d"
    mkdir -p "$NEWCRDS/$d"
    cp "$KYV_DIR"/config/crds/"$d"/*.yaml "$NEWCRDS/$d/"
    chmod u+w "$NEWCRDS/$d"/*.yaml
done

# ---- smoke-check and publish -------------------------------------------------------------------
for b in "${BINARIES[@]}"; do
    [[ -x $NEW/$b ]] || die "$NEW/$b was not built"
done

rm -f "$STAMP"
rm -rf "$BIN" "$OUT/crds"
mv "$NEW" "$BIN"
mv "$NEWCRDS" "$OUT/crds"
elapsed=$(($(date +%s) - start))
{
    echo "kyverno $KYVERNO_VERSION built with $GOVERSION in ${elapsed}s on $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "module: $(sed -n 's/^[[:space:]]*"Sum": "\(.*\)",\{0,1\}$/\1/p' "$WORK/kyv.json")"
    for d in "${CRD_DIRS[@]}"; do echo "crds/$d: $(ls "$OUT/crds/$d" | wc -l) files"; done
} >"$STAMP"
log "done in ${elapsed}s: $(du -sh "$BIN" | cut -f1) in $BIN"
echo "$OUT"
