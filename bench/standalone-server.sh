# Sourced by the bench scripts that run `reports-server serve` in its own process:
# start_server starts it on $DATABASE_URL with its data, log and kubeconfig in $WORK, on $PORT,
# sets SERVER_PID and returns when /readyz answers (up to 60 s), or exits with the server's log.
# Needs BIN, DATABASE_URL, WORK, PORT, a `log` function, and kubectl (checked on sourcing:
# source it before any slow step).
command -v kubectl >/dev/null || {
    log "kubectl is needed (apt-get install kubectl, or any kubectl on PATH)"
    exit 1
}
start_server() {
    "$BIN" serve --database-url "$DATABASE_URL" --data-dir "$WORK/data" \
        --secure-port "$PORT" --write-kubeconfig "$WORK/kubeconfig" --log warn \
        >>"$WORK/server.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 300); do
        KUBECONFIG=$WORK/kubeconfig kubectl get --raw /readyz >/dev/null 2>&1 && return
        kill -0 "$SERVER_PID" 2>/dev/null || {
            cat "$WORK/server.log" >&2
            exit 1
        }
        sleep 0.2
    done
    log "the server did not become ready; its log:"
    cat "$WORK/server.log" >&2
    exit 1
}
