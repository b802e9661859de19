#!/usr/bin/env bash
# Idle memory of a standalone reports-server that has received REPORTS policy reports through
# its API (issue 14: "idle RSS < 100 MB with 100k stored"). The server runs in its own process
# and the load comes from `reports-server bench --kubeconfig` in another, so the figure is the
# server's alone (the bench's in-process `rss` phase also counts its loader). Afterwards the
# server's VmRSS is sampled while idle, then the server is restarted on the same database and
# sampled again, idle and after a full paged list. Not part of CI; see docs/benchmarks.md.
#
#   bash bench/idle-rss.sh [REPORTS] [DATABASE_URL]
#
# REPORTS defaults to 100000. DATABASE_URL defaults to a SQLite file in a temporary directory;
# give postgres://USER@HOST:PORT/DB for an (empty) PostgreSQL database. Needs the release
# build with `--features bench` (built here) and kubectl.
set -euo pipefail

REPORTS=${1:-100000}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/reports-server/target}
BIN=$CARGO_TARGET_DIR/release/reports-server
PORT=${IDLE_RSS_PORT:-18643}
IDLE_SECONDS=${IDLE_RSS_SECONDS:-30}

log() { printf '[idle-rss] %s\n' "$*" >&2; }
# shellcheck source=bench/standalone-server.sh
source "$ROOT/bench/standalone-server.sh"

WORK=$(mktemp -d /tmp/idle-rss.XXXXXX)
DATABASE_URL=${2:-sqlite://$WORK/reports.db?mode=rwc}
SERVER_PID=
stop_server() {
    if [[ -n $SERVER_PID ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill "$SERVER_PID"
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=
}
trap 'stop_server; rm -rf "$WORK"' EXIT

log "building reports-server (release, --features bench)"
(cd "$ROOT" && cargo build --release --features bench --bin reports-server)


# "<VmRSS MiB> (VmHWM <MiB>, anonymous <MiB>), change feed buffer <bytes> bytes"
sample() {
    local status buffered
    status=$(cat "/proc/$SERVER_PID/status")
    buffered=$(KUBECONFIG=$WORK/kubeconfig kubectl get --raw /metrics |
        awk '$1 == "reports_server_watch_buffer_bytes" { print $2 }')
    awk -v buffered="$buffered" '
        $1 == "VmRSS:" { rss = $2 } $1 == "VmHWM:" { hwm = $2 } $1 == "RssAnon:" { anon = $2 }
        END { printf "%.1f MiB (VmHWM %.1f MiB, anonymous %.1f MiB), change feed buffer %s bytes\n",
              rss / 1024, hwm / 1024, anon / 1024, buffered }' <<<"$status"
}

mkdir -p "$WORK/data"
log "server on $DATABASE_URL; creating $REPORTS reports through its API (16 clients)"
start_server
"$BIN" bench --kubeconfig "$WORK/kubeconfig" --phases create --reports "$REPORTS" \
    --namespaces 30 --concurrency 16 --server-pid "server=$SERVER_PID" --log warn |
    grep '^|'
for i in 1 2 3; do
    sleep "$IDLE_SECONDS"
    echo "idle $((i * IDLE_SECONDS)) s after the creates: $(sample)"
done
stop_server

start_server
sleep "$IDLE_SECONDS"
echo "restarted on $REPORTS stored, idle $IDLE_SECONDS s: $(sample)"
listed=$(KUBECONFIG=$WORK/kubeconfig kubectl get policyreports -A --chunk-size=500 -o name | wc -l)
echo "after a full paged list of $listed: $(sample)"
