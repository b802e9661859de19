#!/usr/bin/env bash
# Builds the Go "peer" project, kyverno/reports-server, for the side-by-side benchmark (issue 14).
# The peer cannot be built from the Go module proxy (it is not published there as an installable
# module: its go.mod replaces openreports.io, which `go install pkg@version` refuses), so it is
# built from a copy of its source that the caller provides: a git directory (e.g. a bare clone of
# https://github.com/kyverno/reports-server) or a checked-out source directory. The source is
# extracted to a temporary directory and the binary is cached outside the work tree; this script
# never vendors the peer's code into our tree.
#
#   bash bench/peer/build.sh GIT_DIR [COMMIT]   # COMMIT defaults to HEAD (git archive of it)
#   bash bench/peer/build.sh SOURCE_DIR         # a checkout (keyed by its HEAD; a dirty or non-git
#                                               # tree is keyed by a hash of its files)
#   prints $REPORTS_SERVER_CACHE/peer/<key>/reports-server-peer as the last stdout line
#
#   REPORTS_SERVER_CACHE=/dir  REPORTS_SERVER_REBUILD=1  REPORTS_SERVER_GO_BUILD_P=N   as for
#   tests/controlplane/build.sh (cache root, ignore the stamp, go build -p N).
set -euo pipefail

CACHE_ROOT=${REPORTS_SERVER_CACHE:-$HOME/.cache/reports-server}

log() { printf '[peer/build] %s\n' "$*" >&2; }
die() {
    printf '[peer/build] ERROR: %s\n' "$*" >&2
    exit 1
}

(($# >= 1 && $# <= 2)) || die "usage: $0 GIT_DIR [COMMIT] | $0 SOURCE_DIR
  (e.g. a bare clone of https://github.com/kyverno/reports-server)"
SRC=$1
REV=${2:-HEAD}
[[ -d $SRC ]] || die "$SRC is not a directory (expected a git directory or the peer's source tree)"

command -v git >/dev/null 2>&1 || die "'git' not found in PATH: install git"

# ---- what to build: a commit of a git directory, or a source tree -------------------------------
MODE=
if [[ -f $SRC/go.mod ]]; then
    MODE=tree
elif [[ $(git --git-dir="$SRC" rev-parse --is-bare-repository 2>/dev/null || true) == true ||
    -f $SRC/HEAD && -d $SRC/objects ]]; then
    MODE=gitdir
else
    die "$SRC holds neither a go.mod nor a git repository"
fi
if [[ $MODE == gitdir ]]; then
    SHA=$(git --git-dir="$SRC" rev-parse --verify --quiet "$REV^{commit}") ||
        die "commit '$REV' not found in $SRC"
    KEY=$SHA
else
    (($# == 1)) || die "a COMMIT argument only applies to a git directory, not to the source tree $SRC"
    tree_hash() { (cd "$SRC" && find . -path ./.git -prune -o -type f -print0 | LC_ALL=C sort -z |
        xargs -0 sha256sum | sha256sum | cut -c1-16); }
    if SHA=$(git -C "$SRC" rev-parse --verify --quiet HEAD 2>/dev/null) &&
        [[ $(git -C "$SRC" rev-parse --show-toplevel) -ef $SRC ]]; then
        KEY=$SHA
        [[ -z $(git -C "$SRC" status --porcelain --untracked-files=normal) ]] || KEY=$SHA-dirty-$(tree_hash)
    else
        SHA=unknown
        KEY=src-$(tree_hash)
    fi
fi

OUT=$CACHE_ROOT/peer/$KEY
BIN=$OUT/reports-server-peer
STAMP=$OUT/stamp
if [[ ${REPORTS_SERVER_REBUILD:-} != 1 && -x $BIN && -f $STAMP ]]; then
    log "cached: $(head -n1 "$STAMP")"
    echo "$BIN"
    exit 0
fi

# ---- preconditions -----------------------------------------------------------------------------
command -v go >/dev/null 2>&1 ||
    die "'go' not found in PATH. Install Go (https://go.dev/dl/ or your distribution; at least the \
version in the peer's go.mod) and make sure the Go module proxy is reachable (go env GOPROXY)."
command -v flock >/dev/null 2>&1 || die "'flock' not found: install util-linux"

export GOTOOLCHAIN=local CGO_ENABLED=0 GOWORK=off GO111MODULE=on GOFLAGS="-mod=mod -buildvcs=false"
BUILD_P=()
[[ -n ${REPORTS_SERVER_GO_BUILD_P:-} ]] && BUILD_P=(-p "$REPORTS_SERVER_GO_BUILD_P")

mkdir -p "$OUT"
exec 9>"$OUT/.lock"
if ! flock -n 9; then
    log "another build holds $OUT/.lock; waiting"
    flock 9
fi
# Someone else may have finished the build while we waited.
if [[ ${REPORTS_SERVER_REBUILD:-} != 1 && -x $BIN && -f $STAMP ]]; then
    echo "$BIN"
    exit 0
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/reports-server-peer-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)
if [[ $MODE == gitdir ]]; then
    log "extracting $SHA from $SRC"
    git --git-dir="$SRC" archive --format=tar "$SHA" | tar -x -C "$WORK" ||
        die "git archive of $SHA from $SRC failed"
else
    log "copying the source tree $SRC (key $KEY)"
    tar -C "$SRC" --exclude=./.git -cf - . | tar -x -C "$WORK" || die "copying $SRC failed"
fi
[[ -f $WORK/go.mod && -f $WORK/main.go ]] || die "no go.mod/main.go at the top of the peer's source ($KEY)"

# GOTOOLCHAIN=local: refuse early, with a clear message, when the local Go is older than go.mod's.
GOVERSION=$(go env GOVERSION)
need=$(sed -n 's/^go[[:space:]]\{1,\}\([0-9][0-9.]*\).*/\1/p' "$WORK/go.mod" | head -n1)
have=${GOVERSION#go}
have=${have%%[!0-9.]*}
if [[ -n $need ]] && [[ $(printf '%s\n%s\n' "$need" "$have" | sort -V | head -n1) != "$need" ]]; then
    die "$GOVERSION is too old: the peer's go.mod says go $need (GOTOOLCHAIN=local is set on \
purpose, so no toolchain is downloaded). Install a newer Go."
fi

log "downloading modules (GOPROXY=$(go env GOPROXY))"
(cd "$WORK" && timeout 1800 go mod download) >&2 ||
    die "cannot download the peer's dependencies from the Go module proxy (GOPROXY=$(go env GOPROXY), \
GOSUMDB=$(go env GOSUMDB)). Configure network access to a Go module proxy."

log "building the peer $KEY with $GOVERSION (this takes several minutes on a small machine)"
t0=$(date +%s)
(cd "$WORK" && go build "${BUILD_P[@]}" -trimpath -ldflags='-s -w' -o "$BIN.new" .) ||
    die "building the peer failed (source in $WORK)"
"$BIN.new" --help >/dev/null 2>&1 || die "$BIN.new --help failed: $("$BIN.new" --help 2>&1 | tail -n5)"
mv "$BIN.new" "$BIN"
elapsed=$(($(date +%s) - start))
{
    echo "kyverno/reports-server $KEY built with $GOVERSION in ${elapsed}s (compile $(($(date +%s) - t0))s) on $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $SHA"
    echo "source: $(cd "$SRC" && pwd)"
    echo "flags: GOTOOLCHAIN=$GOTOOLCHAIN CGO_ENABLED=$CGO_ENABLED GOWORK=$GOWORK GOFLAGS=$GOFLAGS -trimpath -ldflags='-s -w' ${BUILD_P[*]}"
} >"$STAMP"
log "$(head -n1 "$STAMP")"
echo "$BIN"
