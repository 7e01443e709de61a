#!/usr/bin/env bash
# `make bench`: install what is missing, build, run every scenario on
# throwaway servers, write target/bench/report.{md,json} and chart.svg.
# Environment knobs: see bench/README.md (BENCH_EVENTS, BENCH_SECONDS, ...).
# Exits 0 when the run completes, whether or not the targets were met.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
t0=$SECONDS
log() { echo "bench: $*" >&2; }

integration/servers.sh install

# Node's amqplib publisher is one of the broker-ceiling publishers; without
# node the report says it was not run.
if command -v node >/dev/null && command -v npm >/dev/null; then
    if [[ ! -f bench/amqplib/node_modules/amqplib/package.json ]]; then
        log "npm ci in bench/amqplib"
        (cd bench/amqplib && npm ci --no-audit --no-fund --loglevel=error) ||
            log "warning: npm ci failed; the amqplib publisher will be skipped"
    fi
else
    log "node/npm not found: the amqplib publisher will be skipped"
fi

log "building the relay (cargo build --release)"
cargo build --release
log "building the harness (bench/, target dir target/bench-build)"
CARGO_TARGET_DIR=target/bench-build cargo build --release --locked --manifest-path bench/Cargo.toml
build_s=$((SECONDS - t0))
log "install + builds took ${build_s} s"

# Always on servers of its own, even when TEST_PG_URL/TEST_AMQP_URL point
# at a developer's servers: the run creates large tables and queues.
env -u TEST_PG_URL -u TEST_AMQP_URL \
    integration/servers.sh with target/bench-build/release/relay-bench run
log "make bench took $((SECONDS - t0)) s (install + builds ${build_s} s)"
