# etcd-cache-server: build in release mode, run as a non-root user.
#
#   docker build -t etcd-cache-server .
#   docker run --rm -p 23790:23790 -p 23791:23791 etcd-cache-server \
#     --endpoints http://etcd:2379 --prefix /registry/ \
#     --listen-addr 0.0.0.0:23790 --metrics-addr 0.0.0.0:23791
FROM rust:1-bookworm AS build
# etcd-client's build needs protoc and its well-known types.
RUN apt-get update \
    && apt-get install -y --no-install-recommends protobuf-compiler=3.21.* libprotobuf-dev=3.21.* \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# What the build needs (the crate's docs include README.md and the guide), not target/ or .git.
COPY Cargo.toml Cargo.lock build.rs README.md CHANGELOG.md ./
COPY src src
COPY proto proto
COPY docs docs
# h2 with a lenient :authority (vendor/h2/PATCHED.md), patched in through Cargo.toml.
COPY vendor vendor
# Cargo reads the manifest's targets: the examples, benches and tests must exist to build.
COPY examples examples
COPY benches benches
COPY tests tests
RUN cargo build --release --locked --features cli --bin etcd-cache-server

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin cache
COPY --from=build /src/target/release/etcd-cache-server /usr/local/bin/etcd-cache-server
USER 10001
EXPOSE 23790 23791
ENTRYPOINT ["/usr/local/bin/etcd-cache-server"]
