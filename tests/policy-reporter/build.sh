#!/usr/bin/env bash
# Builds Policy Reporter (kyverno/policy-reporter) from its source tarball for the end-to-end
# tests and caches the binary outside the work tree, keyed by version. Its dependencies come from
# the Go module proxy; Policy Reporter itself is not an installable module there (its module path
# has no /v3 suffix), so the source comes from a tarball of the tag.
#
#   bash tests/policy-reporter/build.sh       # prints the cache directory as the last stdout line
#   REPORTS_SERVER_CACHE=/some/dir bash ...   # cache root (default ~/.cache/reports-server)
#   REPORTS_SERVER_POLICY_REPORTER_SRC=FILE   # the source tarball (default: the shared reference
#                                             # copy, ../shared/reference/policy-reporter/ next to
#                                             # the repository)
#   REPORTS_SERVER_GO_BUILD_P=1 bash ...      # go build -p N (default: Go's default, #CPUs)
#   REPORTS_SERVER_REBUILD=1 bash ...         # ignore the stamp and rebuild
#
# Layout of the cache directory (what tests/src/policy_reporter.rs reads):
#   bin/policy-reporter
#   stamp
#
# See docs/e2e.md ("Policy Reporter") and docs/policy-reporter.md. The source is unpacked into a
# temporary directory, never into the repository.
set -euo pipefail

# ---- pinned version ----------------------------------------------------------------------------
PR_VERSION=v3.9.0
# The tarball of tag v3.9.0 (commit 1f221445c3aed1cad08fa313d2ab45e94d75e49d): go.mod, go.sum,
# main.go, cmd/, pkg/, config/, templates/, LICENSE.md. The checksum pins exactly that source.
PR_SRC_SHA256=14c03aac6f43690c9707768ddcbf0836df17978458b0ce2838878a585828d460
# Its go.mod says `go 1.26.4`.
GO_MIN_MINOR=26
GO_MIN_PATCH=4
# ------------------------------------------------------------------------------------------------

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
CACHE_ROOT=${REPORTS_SERVER_CACHE:-$HOME/.cache/reports-server}
OUT=$CACHE_ROOT/policy-reporter-$PR_VERSION
BIN=$OUT/bin
STAMP=$OUT/stamp
SRC=${REPORTS_SERVER_POLICY_REPORTER_SRC:-$REPO/../shared/reference/policy-reporter/policy-reporter-$PR_VERSION-src.tar.gz}
# A clone elsewhere on this machine (CI's) finds the reference copy at its fixed place.
if [[ -z ${REPORTS_SERVER_POLICY_REPORTER_SRC:-} && ! -f $SRC ]]; then
    SRC=/work/shared/reference/policy-reporter/policy-reporter-$PR_VERSION-src.tar.gz
fi

log() { printf '[policy-reporter/build] %s\n' "$*" >&2; }
die() {
    printf '[policy-reporter/build] ERROR: %s\n' "$*" >&2
    exit 1
}

have_all() { [[ -f $STAMP && -x $BIN/policy-reporter ]]; }

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
    die "$GOVERSION is too old: Policy Reporter $PR_VERSION needs Go >= 1.$GO_MIN_MINOR.$GO_MIN_PATCH \
(GOTOOLCHAIN=local is set on purpose, so no toolchain is downloaded). Install a newer Go."
fi
# Policy Reporter keeps its state in SQLite through github.com/mattn/go-sqlite3, which needs cgo:
# built with CGO_ENABLED=0 it starts and then fails at the first database call.
command -v gcc >/dev/null 2>&1 ||
    die "'gcc' not found in PATH: Policy Reporter's SQLite driver (mattn/go-sqlite3) needs cgo. \
Install gcc and the C library headers (Debian: apt-get install gcc libc6-dev)."
[[ -f $SRC ]] ||
    die "the Policy Reporter $PR_VERSION source tarball is missing: $SRC. Point \
REPORTS_SERVER_POLICY_REPORTER_SRC at policy-reporter-$PR_VERSION-src.tar.gz (kyverno/policy-reporter \
at tag $PR_VERSION: go.mod, go.sum, main.go, cmd/, pkg/, config/, templates/)."
command -v sha256sum >/dev/null 2>&1 || die "'sha256sum' not found (Debian: coreutils)"
sum=$(sha256sum "$SRC" | cut -d' ' -f1)
[[ $sum == "$PR_SRC_SHA256" ]] ||
    die "$SRC has sha256 $sum, not $PR_SRC_SHA256 (the pinned Policy Reporter $PR_VERSION source)"

export GOTOOLCHAIN=local CGO_ENABLED=1 GOWORK=off GO111MODULE=on

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

WORK=$(mktemp -d "${TMPDIR:-/tmp}/reports-server-policy-reporter-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
tar xzf "$SRC" -C "$WORK"
[[ -f $WORK/go.mod ]] || die "$SRC holds no go.mod at its top level"
grep -q '^module github.com/kyverno/policy-reporter$' "$WORK/go.mod" ||
    die "$SRC is not kyverno/policy-reporter (go.mod: $(head -n1 "$WORK/go.mod"))"

start=$(date +%s)
log "building Policy Reporter $PR_VERSION with $GOVERSION into $BIN"
BUILD_P=()
[[ -n ${REPORTS_SERVER_GO_BUILD_P:-} ]] && BUILD_P=(-p "$REPORTS_SERVER_GO_BUILD_P")
NEW=$OUT/bin.new
rm -rf "$NEW"
mkdir -p "$NEW"
if ! (cd "$WORK" && go mod download >&2); then
    die "cannot download Policy Reporter's dependencies from the Go module proxy \
(GOPROXY=$(go env GOPROXY), GOSUMDB=$(go env GOSUMDB), GOFLAGS=$(go env GOFLAGS)). \
Configure network access to a Go module proxy (e.g. GOPROXY=https://proxy.golang.org)."
fi
# main.Version is what `policy-reporter version` prints (the release sets it the same way).
(cd "$WORK" && go build "${BUILD_P[@]}" -trimpath -ldflags="-s -w -X main.Version=$PR_VERSION" \
    -o "$NEW/policy-reporter" .) || die "building Policy Reporter failed (source in $WORK)"

# ---- smoke-check and publish -------------------------------------------------------------------
got=$("$NEW/policy-reporter" version 2>&1) || die "$NEW/policy-reporter version failed: $got"
[[ $got == *"$PR_VERSION"* ]] || die "$NEW/policy-reporter version printed '$got', not $PR_VERSION"

rm -f "$STAMP"
rm -rf "$BIN"
mv "$NEW" "$BIN"
elapsed=$(($(date +%s) - start))
{
    echo "policy-reporter $PR_VERSION built with $GOVERSION in ${elapsed}s on $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "source: $SRC (sha256 $PR_SRC_SHA256)"
} >"$STAMP"
log "done in ${elapsed}s: $(du -sh "$BIN" | cut -f1) in $BIN"
echo "$OUT"
