#!/usr/bin/env bash
# The checker's soak, as `make soak` runs it: random seeds for SOAK_SECONDS
# in SOAK_LANES lanes at once (default 1), each against servers of its own
# (servers.sh with), each with seeds of its own (lane i starts i million
# seeds after the first) and its own report:
#
#   one lane:   target/checker/soak.md
#   N lanes:    target/checker/lane-<i>/soak.md, the lane's output in
#               target/checker/lane-<i>.log
#
# A run overruns SOAK_SECONDS by at most one run (the one under way).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

lanes=${SOAK_LANES:-1}
[[ $lanes =~ ^[1-9][0-9]*$ ]] || { echo "soak.sh: SOAK_LANES must be a positive integer" >&2; exit 2; }
export SOAK_SECONDS=${SOAK_SECONDS:-3600}
first=${SOAK_FIRST_SEED:-$(date +%s)}

integration/servers.sh install
cargo test --test checker --no-run

if ((lanes == 1)); then
    exec env SOAK_FIRST_SEED="$first" integration/servers.sh with cargo test --test checker
fi

mkdir -p target/checker
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null || true; wait || true; exit 143' INT TERM
for ((i = 1; i <= lanes; i++)); do
    CHECK_OUT=$PWD/target/checker/lane-$i SOAK_FIRST_SEED=$((first + (i - 1) * 1000000)) \
        integration/servers.sh with cargo test --test checker \
        >"target/checker/lane-$i.log" 2>&1 </dev/null &
    pids+=($!)
    echo "soak.sh: lane $i (seeds from $((first + (i - 1) * 1000000))): target/checker/lane-$i.log" >&2
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
for ((i = 1; i <= lanes; i++)); do
    echo "================ lane $i (target/checker/lane-$i/soak.md)"
    cat "target/checker/lane-$i/soak.md" 2>/dev/null || echo "(no report)"
done
exit $rc
