# syntax=docker/dockerfile:1
#
# Tollgate: one binary (`tollgate`) for every role: serve, project, migrate, ...
#
# The builder is pinned to the bookworm variant of rust:1.95 (plain rust:1.95 is
# Debian trixie) so the binary links against the same glibc as the runtime.

FROM rust:1.95-bookworm AS builder
WORKDIR /src

# librdkafka is built from source by rdkafka-sys (./configure && make).
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake pkg-config zlib1g-dev \
 && rm -rf /var/lib/apt/lists/*

# Only the sources (the build context's target/ is never copied).
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY meter ./meter
COPY schemas ./schemas
COPY store ./store
COPY gateway ./gateway
COPY projector ./projector
COPY migrations ./migrations
COPY tests ./tests

RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    cargo build --release --locked --bin tollgate

FROM debian:bookworm-slim AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates zlib1g \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home-dir /var/lib/tollgate --create-home tollgate
COPY --from=builder /src/target/release/tollgate /usr/local/bin/tollgate
USER tollgate
WORKDIR /var/lib/tollgate
ENV TOLLGATE_LISTEN=0.0.0.0:8080
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/tollgate"]
CMD ["serve"]
