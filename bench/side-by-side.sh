#!/usr/bin/env bash
# The side-by-side benchmark of issue 14 in one command: the report CRDs in etcd, the peer
# (kyverno/reports-server) on PostgreSQL and reports-server on PostgreSQL and SQLite, each on a
# fresh control plane and database, driven by `reports-server bench` through kube-apiserver.
# Not part of CI (1,000 and 10,000 reports, all six targets: about 20 minutes on a 2-core
# machine with warm caches). See docs/benchmarks.md.
#
#   bash bench/side-by-side.sh PEER_SOURCE [orchestrator flags...]
#
# PEER_SOURCE is the peer's source: a git directory (e.g. what `git clone --bare
# https://github.com/kyverno/reports-server` makes) or a checkout; bench/peer/build.sh builds it
# outside this tree. Flags after it go to the orchestrator (`--sizes 1000,10000`, `--targets
# crds,peer,postgres,sqlite,postgres-direct,sqlite-direct`, `--out DIR`; see its --help).
# Set DATABASE_URL=postgres://user@host:port/db to benchmark on a durable PostgreSQL; without it
# the targets use the tests' throw-away cluster (fsync=off).
set -euo pipefail

(($# >= 1)) || {
    echo "usage: $0 PEER_SOURCE [--sizes 1000,10000] [--targets ...] [--out DIR]" >&2
    exit 2
}
PEER_SOURCE=$1
shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/reports-server/target}

echo "[side-by-side] building the peer from $PEER_SOURCE" >&2
PEER_BIN=$(bash "$ROOT/bench/peer/build.sh" "$PEER_SOURCE" | tail -n1)
echo "[side-by-side] building reports-server (release, --features bench)" >&2
(cd "$ROOT" && cargo build --release --features bench --bin reports-server)
(cd "$ROOT" && cargo build -p reports-server-tests --bin side-by-side)
cd "$ROOT"
exec "$CARGO_TARGET_DIR/debug/side-by-side" \
    --server-bin "$CARGO_TARGET_DIR/release/reports-server" \
    --peer-bin "$PEER_BIN" "$@"
