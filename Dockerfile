# syntax=docker/dockerfile:1
# The reports-server image for users: one static binary FROM scratch, CA certificates, a non-root
# user, nothing else. The end-to-end node tests build the same image without Docker
# (tests/node/image.sh); tests/tests/e2e_node.rs checks that the final stage below and that script
# agree (entrypoint, command, user, environment, file tree).
#
#   docker build -t reports-server .
#   docker run --rm --read-only -p 6443:6443 -v rs-data:/var/lib/reports-server reports-server \
#     serve --bind-address 0.0.0.0
#
# Read-only root filesystem: the server writes only to /var/lib/reports-server (its data
# directory; mount a volume there, or pass --database-url) and /tmp.

# ---- build: a static binary (glibc linked statically), debug info kept separately -------------
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    RUSTFLAGS='-C target-feature=+crt-static' \
    cargo build --release --locked --target x86_64-unknown-linux-gnu --bin reports-server \
 && mkdir -p /out \
 && objcopy --only-keep-debug target/x86_64-unknown-linux-gnu/release/reports-server /out/reports-server.debug \
 && objcopy --strip-all --add-gnu-debuglink=/out/reports-server.debug \
      target/x86_64-unknown-linux-gnu/release/reports-server /out/reports-server

# ---- the file tree of the image, assembled by the same script the tests use --------------------
FROM debian:bookworm-slim AS rootfs
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ca-certificates binutils \
 && rm -rf /var/lib/apt/lists/*
COPY tests/node/image.sh /src/tests/node/image.sh
COPY --from=build /out/reports-server /out/reports-server
RUN bash /src/tests/node/image.sh rootfs reports-server /rootfs /out/reports-server

# The debug info, for `docker build --target debug --output type=local,dest=. .`
FROM scratch AS debug
COPY --from=build /out/reports-server.debug /

# ---- the image -------------------------------------------------------------------------------
FROM scratch
COPY --from=rootfs /rootfs/ /
USER 65532:65532
ENV PATH=/usr/bin SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt REPORTS_SERVER_DATA_DIR=/var/lib/reports-server
WORKDIR /
EXPOSE 6443
ENTRYPOINT ["/usr/bin/reports-server"]
CMD ["serve"]
