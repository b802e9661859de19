#!/bin/sh
# Entrypoint of the locally built PostgreSQL image (tests/node/image.sh build postgres). It follows
# the environment contract of the official `postgres` image, which is what users run with the
# operator's managed-database mode:
#   POSTGRES_PASSWORD  superuser password; required on first start unless
#                      POSTGRES_HOST_AUTH_METHOD=trust
#   POSTGRES_USER      superuser name (default postgres)
#   POSTGRES_DB        database created on first start (default: $POSTGRES_USER)
#   PGDATA             data directory (default /var/lib/postgresql/data); initdb runs when it
#                      holds no cluster yet (an empty volume)
#   POSTGRES_INITDB_ARGS, POSTGRES_HOST_AUTH_METHOD (default scram-sha-256)
# Started as root it prepares PGDATA for uid 999 and re-executes itself as `postgres`; started
# as another uid (runAsUser) it needs PGDATA writable by that uid (fsGroup).
set -eu

if [ "${1#-}" != "$1" ]; then
    set -- postgres "$@"
fi
if [ "${1:-}" != postgres ]; then
    exec "$@"
fi

: "${PGDATA:=/var/lib/postgresql/data}"
export PGDATA

if [ "$(id -u)" = 0 ]; then
    mkdir -p "$PGDATA"
    chown postgres:postgres "$PGDATA" /var/run/postgresql
    chmod 0700 "$PGDATA"
    # Options before the user name and `--` after it: otherwise busybox su would parse the
    # server's own `-c name=value` arguments as its -c.
    exec su -s /bin/sh -c 'exec /bin/docker-entrypoint.sh "$@"' postgres -- sh "$@"
fi

POSTGRES_USER=${POSTGRES_USER:-postgres}
POSTGRES_DB=${POSTGRES_DB:-$POSTGRES_USER}
AUTH=${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    if [ -z "${POSTGRES_PASSWORD:-}" ] && [ "$AUTH" != trust ]; then
        echo "error: the database is uninitialized and POSTGRES_PASSWORD is not set" >&2
        echo "  set POSTGRES_PASSWORD (or POSTGRES_HOST_AUTH_METHOD=trust to allow all connections without a password)" >&2
        exit 1
    fi
    mkdir -p "$PGDATA"
    chmod 0700 "$PGDATA"
    pwfile=/tmp/pwfile.$$
    printf '%s\n' "${POSTGRES_PASSWORD:-}" >"$pwfile"
    # shellcheck disable=SC2086
    initdb --username="$POSTGRES_USER" --pwfile="$pwfile" --auth-local=trust --auth-host="$AUTH" \
        ${POSTGRES_INITDB_ARGS:-} >&2
    rm -f "$pwfile"
    {
        echo "listen_addresses = '*'"
    } >>"$PGDATA/postgresql.conf"
    echo "host all all all $AUTH" >>"$PGDATA/pg_hba.conf"
    if [ "$POSTGRES_DB" != postgres ]; then
        # Single-user mode needs no socket and no client binary (the image has no psql).
        echo "CREATE DATABASE \"$POSTGRES_DB\";" | postgres --single -D "$PGDATA" -j postgres >&2
    fi
    echo "PostgreSQL init process complete; ready for start up." >&2
fi

exec "$@"
