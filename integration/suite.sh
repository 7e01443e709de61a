#!/usr/bin/env bash
# The whole test suite, as `make test` runs it: built once, then run in two
# lanes at the same time, each against servers of its own (servers.sh with),
# so that one lane's faults (a broker stopped, PostgreSQL restarted) never
# reach the other's tests. Most of the suite waits on servers, not on the
# CPU, so two lanes take about half the time of one.
#
#   integration/suite.sh            build, run both lanes, print both logs
#
# Lane A takes the test binaries named below (the longest ones, balanced
# against the rest by their measured times); lane B the library's and the
# binaries' unit tests, the examples, and every other tests/*.rs, so that a
# new test binary runs without being listed here. Each lane's output goes to
# target/suite/lane-{a,b}.log and is printed whole when both have finished.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

LANE_A=(large_tx broker_alarm tls takeover package observability kill9 commands poison)

log() { echo "suite.sh: $*" >&2; }

# A test binary of lane A that no longer exists is a stale list, not a pass.
for t in "${LANE_A[@]}"; do
    [[ -f tests/$t.rs ]] || { log "error: LANE_A names tests/$t.rs, which does not exist"; exit 1; }
done

lane_b=()
for f in tests/*.rs; do
    t=${f#tests/}
    t=${t%.rs}
    [[ " ${LANE_A[*]} " == *" $t "* ]] || lane_b+=("$t")
done

# Build everything first, in the foreground, so that compile errors show
# at once and the lanes only run. The example consumer also as a program
# (tests/crash_windows.rs runs it), so that no test builds it mid-run.
integration/servers.sh install
cargo test --all-targets --no-run
cargo build --example consumer
# Where cargo put it: CARGO_TARGET_DIR or build.target-dir when set (as
# the Makefile asks), else target/.
target_dir=$(cargo metadata --format-version 1 --no-deps |
    sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
export TEST_CONSUMER_BIN=${target_dir:-$PWD/target}/debug/examples/consumer

# Servers of the caller's own (TEST_PG_URL, TEST_AMQP_URL): one set, so one
# lane, or one lane's faults would reach the other's tests.
if [[ -n ${TEST_PG_URL:-} && -n ${TEST_AMQP_URL:-} ]]; then
    log "TEST_PG_URL and TEST_AMQP_URL are set: one lane, on those servers"
    exec cargo test --all-targets --no-fail-fast -- --test-threads=4
fi

mkdir -p target/suite
# The checker (checker/main.rs, not under tests/) runs in lane B.
args_a=() args_b=(--lib --bins --examples --test checker)
for t in "${LANE_A[@]}"; do args_a+=(--test "$t"); done
for t in "${lane_b[@]}"; do args_b+=(--test "$t"); done

started=$SECONDS
pid_a="" pid_b=""
# Ctrl-C or a TERM stops both lanes (each tears its servers down), and
# waits for them to have done so.
trap 'kill -TERM $pid_a $pid_b 2>/dev/null || true; wait || true; exit 143' INT TERM
integration/servers.sh with cargo test --no-fail-fast "${args_a[@]}" -- --test-threads=4 \
    >target/suite/lane-a.log 2>&1 </dev/null &
pid_a=$!
integration/servers.sh with cargo test --no-fail-fast "${args_b[@]}" -- --test-threads=4 \
    >target/suite/lane-b.log 2>&1 </dev/null &
pid_b=$!
log "lane A: ${LANE_A[*]}"
log "lane B: unit tests, examples, ${lane_b[*]}"
rc_a=0 rc_b=0
wait "$pid_a" || rc_a=$?
log "lane A finished (exit $rc_a) after $((SECONDS - started))s"
wait "$pid_b" || rc_b=$?
log "lane B finished (exit $rc_b) after $((SECONDS - started))s"

for lane in a b; do
    echo "================ lane ${lane^^} (target/suite/lane-$lane.log)"
    cat "target/suite/lane-$lane.log"
done

# One closing line for the whole run, counted from both lanes' libtest lines.
read -r passed failed < <(
    grep -h '^test result:' target/suite/lane-a.log target/suite/lane-b.log |
        awk '{for (i = 1; i <= NF; i++) {if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i}} END {print p + 0, f + 0}'
)
echo "suite: lane A exit $rc_a, lane B exit $rc_b, $((SECONDS - started))s"
# A test binary that crashed (an abort, a stack overflow) prints no result
# line of its own: name it, so the count below is not taken for the whole.
grep -h -E '^error: test failed|process didn.t exit successfully' \
    target/suite/lane-a.log target/suite/lane-b.log || true
echo "$passed passed, $failed failed"
((rc_a == 0 && rc_b == 0))
