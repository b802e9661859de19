#!/usr/bin/env bash
# The server's own memory with REPORTS stored (issue 37, target 2: flat in N), idle and while two
# clients page through every report at once (limit=500), and the list times of target 1 against
# the server in its own process. The reports are loaded in bulk through the store
# (`bench --phases seed`, as the migration imports), not through the API, so a million takes
# minutes. The server's VmRSS is sampled every 0.5 s while the clients run; its VmHWM is the
# peak since it started. Not part of CI; see docs/benchmarks.md "Scale".
#
#   bash bench/scale-memory.sh [REPORTS] [DATABASE_URL]
#
# REPORTS defaults to 1000000. DATABASE_URL defaults to a SQLite file in SCALE_MEMORY_DIR
# (default: a new directory under /var/tmp, deleted afterwards unless SCALE_MEMORY_KEEP=1). Check
# free disk first: about 8 KB per report on either backend (8 GB at a million). With
# SCALE_MEMORY_SEEDED=1 the database already holds the reports (an earlier run's, kept) and
# the seed is skipped. SCALE_MEMORY_BIN: a reports-server built with `--features bench`
# (default: the release build, built here). Needs kubectl.
set -euo pipefail

REPORTS=${1:-1000000}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/reports-server/target}
PORT=${SCALE_MEMORY_PORT:-18644}
IDLE_SECONDS=${SCALE_MEMORY_IDLE_SECONDS:-30}

log() { printf '[scale-memory] %s\n' "$*" >&2; }
# shellcheck source=bench/standalone-server.sh
source "$ROOT/bench/standalone-server.sh"

if [[ -n ${SCALE_MEMORY_BIN:-} ]]; then
    BIN=$SCALE_MEMORY_BIN
else
    log "building reports-server (release, --features bench)"
    (cd "$ROOT" && cargo build --release --features bench --bin reports-server)
    BIN=$CARGO_TARGET_DIR/release/reports-server
fi

MADE_WORK=
if [[ -n ${SCALE_MEMORY_DIR:-} ]]; then
    WORK=$SCALE_MEMORY_DIR
else
    WORK=$(mktemp -d /var/tmp/scale-memory.XXXXXX)
    MADE_WORK=1
fi
mkdir -p "$WORK/data"
DATABASE_URL=${2:-sqlite://$WORK/reports.db?mode=rwc}
if [[ ${SCALE_MEMORY_SEEDED:-0} == 1 && -z ${SCALE_MEMORY_DIR:-} && -z ${2:-} ]]; then
    log "SCALE_MEMORY_SEEDED=1 needs the seeded database: SCALE_MEMORY_DIR or a DATABASE_URL"
    exit 2
fi
SERVER_PID=
SAMPLER_PID=
cleanup() {
    if [[ -n $SAMPLER_PID ]]; then kill "$SAMPLER_PID" 2>/dev/null || true; fi
    if [[ -n $SERVER_PID ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill "$SERVER_PID" || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    # Only a directory this script made: SCALE_MEMORY_DIR (a seeded database) stays.
    if [[ -n $MADE_WORK && ${SCALE_MEMORY_KEEP:-0} != 1 ]]; then rm -rf "$WORK"; fi
}
trap cleanup EXIT

if [[ ${SCALE_MEMORY_SEEDED:-0} != 1 ]]; then
    log "loading $REPORTS reports in bulk into $DATABASE_URL (free disk: $(df -h --output=avail "$WORK" | tail -1))"
    "$BIN" bench --phases seed --seed-reports "$REPORTS" --database-url "$DATABASE_URL" --log warn |
        grep '^|'
fi
if [[ $DATABASE_URL == sqlite://* ]]; then
    echo "database file: $(du -h "$WORK"/reports.db* | tr '\n' ' ')"
fi

start_server

# "<VmRSS MiB> (VmHWM <MiB>, anonymous <MiB>)"
sample() {
    awk '$1 == "VmRSS:" { rss = $2 } $1 == "VmHWM:" { hwm = $2 } $1 == "RssAnon:" { anon = $2 }
        END { printf "%.1f MiB (VmHWM %.1f MiB, anonymous %.1f MiB)\n", rss / 1024, hwm / 1024, anon / 1024 }' \
        "/proc/$SERVER_PID/status"
}
bench() {
    "$BIN" bench --kubeconfig "$WORK/kubeconfig" --reports 0 --repeat 1 \
        --server-pid "server=$SERVER_PID" --log warn "$@"
}

sleep "$IDLE_SECONDS"
echo "server started on $REPORTS stored, idle $IDLE_SECONDS s: $(sample)"

# The most the server held while two clients paged through everything at once.
(while awk '$1 == "VmRSS:" { print $2 }' "/proc/$SERVER_PID/status"; do sleep 0.5; done) \
    >"$WORK/rss.samples" &
SAMPLER_PID=$!
started=$SECONDS
bench --phases raw-list --target client-1 >"$WORK/client-1.txt" &
first=$!
bench --phases raw-list --target client-2 >"$WORK/client-2.txt" &
second=$!
wait "$first"
wait "$second"
kill "$SAMPLER_PID" 2>/dev/null || true
SAMPLER_PID=
grep -h 'paginated list\|CPU of server' "$WORK/client-1.txt" "$WORK/client-2.txt" || true
echo "two clients paging through all $REPORTS at once: both done in $((SECONDS - started)) s; server VmRSS at most $(sort -n "$WORK/rss.samples" | tail -1 | awk '{ printf "%.1f", $1 / 1024 }') MiB in $(wc -l <"$WORK/rss.samples") samples; now $(sample)"

log "one client: list, raw-list, metadata-list, watcher-sync"
bench --phases raw-list,list,metadata-list,watcher-sync --target one-client | grep '^|'
sleep "$IDLE_SECONDS"
echo "idle $IDLE_SECONDS s after the lists: $(sample)"
