#!/usr/bin/env bash
# Container images for the end-to-end node (tests/src/node.rs), built without a registry, a
# container engine or network access: each image is one layer assembled from a directory and
# written as a docker-archive (the `docker save` format, which `ctr images import` reads).
#
#   bash tests/node/image.sh binary                       # static, stripped reports-server; prints its path
#                                                          # (REPORTS_SERVER_IMAGE_PROFILE=dev: a dev build)
#   bash tests/node/image.sh build reports-server OUT.tar [BINARY]
#   bash tests/node/image.sh build pause OUT.tar
#   bash tests/node/image.sh build postgres OUT.tar
#   bash tests/node/image.sh rootfs reports-server DIR BINARY   # the file tree only (the Dockerfile uses it)
#   bash tests/node/image.sh config reports-server        # the image config (entrypoint, user, env) as JSON
#   bash tests/node/image.sh ref reports-server|pause|postgres
#
# The repository's Dockerfile builds the same reports-server image for users; its final stage
# copies the tree that `rootfs reports-server` makes, and tests/tests/e2e_node.rs checks that its
# ENTRYPOINT, CMD, USER and ENV equal `config reports-server`.
#
# Needs: bash, tar, sha256sum, gcc (pause), binutils (objcopy/strip/readelf), cargo (binary),
# Debian's ca-certificates, and root (the layer stores per-file ownership as it is on disk).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)

# ---- image contract ----------------------------------------------------------------------------
REPORTS_SERVER_REF=localhost/reports-server:e2e
# The sandbox image containerd's CRI plugin is configured with (tests/src/node.rs); the tag must
# not be `latest`, or the kubelet would try to pull it.
PAUSE_REF=registry.k8s.io/pause:3.10
POSTGRES_REF=localhost/postgres:e2e
# A fixed non-root user (the "nonroot" uid of distroless images), so a Pod can say
# runAsNonRoot without naming a uid and a volume can be prepared for it.
NONROOT_UID=65532
BIN_PATH=/usr/bin/reports-server
DATA_DIR=/var/lib/reports-server
CA_FILE=/etc/ssl/certs/ca-certificates.crt
POSTGRES_UID=999
# ------------------------------------------------------------------------------------------------

log() { printf '[node/image] %s\n' "$*" >&2; }
die() {
    printf '[node/image] ERROR: %s\n' "$*" >&2
    exit 1
}
need() {
    command -v "$1" >/dev/null 2>&1 || die "'$1' not found: install $2"
}

# JSON image config (the part of the OCI/Docker image config a runtime reads).
config_json() {
    case $1 in
    reports-server)
        # REPORTS_SERVER_DATA_DIR: without HOME the server would fall back to a relative
        # directory; a fixed path lets a read-only root filesystem mount a volume there.
        printf '{"User":"%s:%s","Env":["PATH=/usr/bin","SSL_CERT_FILE=%s","REPORTS_SERVER_DATA_DIR=%s"],"Entrypoint":["%s"],"Cmd":["serve"],"WorkingDir":"/"}' \
            "$NONROOT_UID" "$NONROOT_UID" "$CA_FILE" "$DATA_DIR" "$BIN_PATH"
        ;;
    pause)
        printf '{"User":"65535:65535","Env":["PATH=/"],"Entrypoint":["/pause"],"WorkingDir":"/"}'
        ;;
    postgres)
        printf '{"User":"0:0","Env":["PATH=/usr/lib/postgresql/bin:/bin","PGDATA=/var/lib/postgresql/data","LANG=C.UTF-8"],"Entrypoint":["/bin/docker-entrypoint.sh"],"Cmd":["postgres"],"WorkingDir":"/","StopSignal":"SIGINT","ExposedPorts":{"5432/tcp":{}}}'
        ;;
    *) die "unknown image $1" ;;
    esac
}

ref_of() {
    case $1 in
    reports-server) echo "$REPORTS_SERVER_REF" ;;
    pause) echo "$PAUSE_REF" ;;
    postgres) echo "$POSTGRES_REF" ;;
    *) die "unknown image $1" ;;
    esac
}

# The static reports-server: glibc linked statically (+crt-static works on the stable toolchain; no
# musl target is needed), debug info split into reports-server.debug next to it.
# REPORTS_SERVER_IMAGE_PROFILE (default release) picks the cargo profile: CI builds with `dev`,
# whose optimized dependencies are cached and whose own crates rebuild incrementally in minutes
# where a release build of them takes a quarter of an hour on 2 cores.
build_binary() {
    need cargo "Rust (https://rustup.rs)"
    need objcopy "binutils (apt-get install binutils)"
    need readelf "binutils (apt-get install binutils)"
    local target_dir=${CARGO_TARGET_DIR:-$ROOT/target}
    local triple=x86_64-unknown-linux-gnu
    local profile=${REPORTS_SERVER_IMAGE_PROFILE:-release} profile_dir
    case $profile in
    dev) profile_dir=debug ;;
    *) profile_dir=$profile ;;
    esac
    log "cargo build --profile $profile --target $triple --bin reports-server (static)"
    (cd "$ROOT" && RUSTFLAGS='-C target-feature=+crt-static' cargo build --profile "$profile" --locked \
        --target "$triple" --bin reports-server >&2) || die "cargo build of the static reports-server failed"
    local built=$target_dir/$triple/$profile_dir/reports-server
    local out=$target_dir/$triple/$profile_dir/image
    mkdir -p "$out"
    if [[ ! -f $out/reports-server || $built -nt $out/reports-server ]]; then
        readelf -l "$built" | grep -q 'Requesting program interpreter' &&
            die "$built is dynamically linked (RUSTFLAGS=-C target-feature=+crt-static was not applied)"
        objcopy --only-keep-debug "$built" "$out/reports-server.debug"
        objcopy --strip-all --add-gnu-debuglink="$out/reports-server.debug" "$built" "$out/reports-server.tmp"
        mv "$out/reports-server.tmp" "$out/reports-server"
        log "stripped: $(du -h "$out/reports-server" | cut -f1), debug info: $(du -h "$out/reports-server.debug" | cut -f1)"
    fi
    echo "$out/reports-server"
}

# /etc/passwd and /etc/group with root and one service user, so that tools and libraries that
# look the user up (and `kubectl exec … id`) see a name.
write_users() { # dir name uid
    mkdir -p "$1/etc"
    printf 'root:x:0:0:root:/root:/sbin/nologin\n%s:x:%s:%s:%s:/nonexistent:/sbin/nologin\n' "$2" "$3" "$3" "$2" >"$1/etc/passwd"
    printf 'root:x:0:\n%s:x:%s:\n' "$2" "$3" >"$1/etc/group"
}

rootfs_reports_server() { # dir binary
    local dir=$1 bin=$2
    mkdir -p "$dir"
    chmod 0755 "$dir"
    [[ -f $CA_FILE ]] || die "$CA_FILE not found: install ca-certificates"
    readelf -l "$bin" | grep -q 'Requesting program interpreter' &&
        die "$bin is dynamically linked; the image is FROM scratch and needs a static binary"
    mkdir -p "$dir/usr/bin" "$dir/etc/ssl/certs" "$dir$DATA_DIR" "$dir/tmp"
    install -m 0755 "$bin" "$dir$BIN_PATH"
    install -m 0644 "$CA_FILE" "$dir$CA_FILE"
    write_users "$dir" nonroot "$NONROOT_UID"
    chown "$NONROOT_UID:$NONROOT_UID" "$dir$DATA_DIR"
    chmod 0750 "$dir$DATA_DIR"
    chmod 1777 "$dir/tmp"
}

rootfs_pause() { # dir
    need gcc "gcc (apt-get install gcc libc6-dev)"
    mkdir -p "$1"
    gcc -static -Os -s -Wall -Wextra -o "$1/pause" "$HERE/pause.c" || die "building pause.c failed"
}

# Debian's PostgreSQL server binaries with the shared libraries they load, a static busybox for
# the entrypoint script, and the entrypoint that honours the official image's environment.
rootfs_postgres() { # dir
    local dir=$1 pgbin
    pgbin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)
    [[ -n $pgbin ]] || die "no /usr/lib/postgresql/*/bin: install postgresql"
    [[ -x /bin/busybox && $(readelf -l /bin/busybox | grep -c 'program interpreter') == 0 ]] ||
        die "no static /bin/busybox: install busybox-static"
    local pgroot=${pgbin%/bin} v
    v=${pgroot##*/}
    mkdir -p "$dir/bin" "$dir/usr/lib/postgresql" "$dir/usr/share/postgresql" "$dir/var/run/postgresql" \
        "$dir/var/lib/postgresql/data" "$dir/tmp" "$dir/etc"
    cp -a "$pgroot" "$dir/usr/lib/postgresql/$v"
    ln -s "$v/bin" "$dir/usr/lib/postgresql/bin"
    cp -a "/usr/share/postgresql/$v" "$dir/usr/share/postgresql/$v"
    [[ -d /usr/share/zoneinfo ]] && mkdir -p "$dir/usr/share" && cp -a /usr/share/zoneinfo "$dir/usr/share/zoneinfo"
    # LANG=C.UTF-8 (initdb's default locale) needs glibc's compiled C.utf8 locale.
    [[ -d /usr/lib/locale/C.utf8 ]] || die "no /usr/lib/locale/C.utf8 (Debian's libc-bin ships it)"
    mkdir -p "$dir/usr/lib/locale" && cp -a /usr/lib/locale/C.utf8 "$dir/usr/lib/locale/"
    cp /bin/busybox "$dir/bin/busybox"
    for a in sh cat chmod chown env id ls mkdir rm su; do ln -s busybox "$dir/bin/$a"; done
    # Shared libraries of every server binary, with the dynamic loader, at their Debian paths.
    local f lib
    for f in "$dir/usr/lib/postgresql/$v/bin/"* "$dir/usr/lib/postgresql/$v/lib/"*.so; do
        [[ -f $f ]] || continue
        ldd "$f" 2>/dev/null | awk '/=> \//{print $3} /^\t\/lib/{print $1}' || true
    done | sort -u | while read -r lib; do
        mkdir -p "$dir$(dirname "$lib")"
        cp -L "$lib" "$dir$lib"
    done
    # The loader path the binaries ask for (/lib64/ld-linux-x86-64.so.2 on amd64).
    lib=$(readelf -l "$pgbin/postgres" | sed -n 's/.*program interpreter: \(.*\)]/\1/p')
    mkdir -p "$dir$(dirname "$lib")" && cp -L "$lib" "$dir$lib"
    write_users "$dir" postgres "$POSTGRES_UID"
    install -m 0755 "$HERE/postgres-entrypoint.sh" "$dir/bin/docker-entrypoint.sh"
    chown -R "$POSTGRES_UID:$POSTGRES_UID" "$dir/var/run/postgresql" "$dir/var/lib/postgresql"
    chmod 1777 "$dir/tmp"
    chmod 2777 "$dir/var/run/postgresql"
}

# One layer, one config, one manifest: the docker-archive layout. The tar is made reproducible
# (sorted names, fixed mtimes, numeric owners as on disk) so the same inputs give the same digest.
write_archive() { # rootfs ref config_json out.tar
    local rootfs=$1 ref=$2 cfg=$3 out=$4 w diff cfgsum
    w=$(mktemp -d "${TMPDIR:-/tmp}/reports-server-image.XXXXXX")
    tar --sort=name --mtime=@0 --numeric-owner -C "$rootfs" -cf "$w/layer.tar" .
    diff=$(sha256sum "$w/layer.tar" | cut -d' ' -f1)
    mkdir "$w/$diff"
    mv "$w/layer.tar" "$w/$diff/layer.tar"
    printf '{"architecture":"amd64","os":"linux","created":"1970-01-01T00:00:00Z","config":%s,"rootfs":{"type":"layers","diff_ids":["sha256:%s"]},"history":[{"created":"1970-01-01T00:00:00Z","created_by":"tests/node/image.sh"}]}' \
        "$cfg" "$diff" >"$w/config.json"
    cfgsum=$(sha256sum "$w/config.json" | cut -d' ' -f1)
    mv "$w/config.json" "$w/$cfgsum.json"
    printf '[{"Config":"%s.json","RepoTags":["%s"],"Layers":["%s/layer.tar"]}]' "$cfgsum" "$ref" "$diff" >"$w/manifest.json"
    mkdir -p "$(dirname "$out")"
    tar --sort=name --mtime=@0 --numeric-owner -C "$w" -cf "$out.tmp" manifest.json "$cfgsum.json" "$diff"
    mv "$out.tmp" "$out"
    rm -rf "$w"
    log "$ref -> $out ($(du -h "$out" | cut -f1), config sha256:${cfgsum:0:12})"
}

build_image() { # name out [binary]
    local name=$1 out=$2 bin=${3:-} rootfs
    [[ $(id -u) == 0 ]] || die "building images needs root (the layer keeps per-file ownership)"
    rootfs=$(mktemp -d "${TMPDIR:-/tmp}/reports-server-rootfs.XXXXXX")
    # mktemp makes the directory 0700; it becomes the image's "/", which every user must traverse.
    chmod 0755 "$rootfs"
    # shellcheck disable=SC2064
    trap "rm -rf '$rootfs'" RETURN
    case $name in
    reports-server)
        [[ -n $bin ]] || bin=$(build_binary)
        rootfs_reports_server "$rootfs" "$bin"
        ;;
    pause) rootfs_pause "$rootfs" ;;
    postgres) rootfs_postgres "$rootfs" ;;
    *) die "unknown image $name" ;;
    esac
    write_archive "$rootfs" "$(ref_of "$name")" "$(config_json "$name")" "$out"
}

case ${1:-} in
binary) build_binary ;;
build) build_image "${2:?image name}" "${3:?output tar}" "${4:-}" ;;
rootfs)
    [[ ${2:-} == reports-server ]] || die "rootfs: only reports-server"
    rootfs_reports_server "${3:?directory}" "${4:?binary}"
    ;;
config) config_json "${2:?image name}" ;;
ref) ref_of "${2:?image name}" ;;
*) die "usage: $0 binary | build NAME OUT.tar [BINARY] | rootfs reports-server DIR BINARY | config NAME | ref NAME" ;;
esac
