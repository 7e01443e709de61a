#!/usr/bin/env bash
# The whole test suite, as `make test` runs it: built once, then run in two
# lanes at the same time, each against servers of its own (servers.sh with),
# so that one lane's faults (a broker stopped, PostgreSQL restarted) never
# reach the other's tests. Most of the suite waits on servers, not on the
# CPU, so two lanes take about half the time of one.
#
#   integration/suite.sh            build, run both lanes, print both logs
#
# The integration tests are one test binary (tests/it/main.rs), a module
# per concern. Within a lane its modules run one after another (`cargo test
# --test it -- <module>::`), each with four test threads, as separate
# binaries did: a module serializes its own disruptive tests, and no other
# module's tests run meanwhile. Lane A takes the modules named below (the
# longest ones, balanced against the rest by their measured times); lane B
# the library's and the binaries' unit tests, the examples, the checker,
# and every other module of tests/it/, so that a new module runs without
# being listed here. Each lane's output goes to target/suite/lane-{a,b}.log
# and is printed whole when both have finished.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

LANE_A=(large_tx broker_alarm tls takeover package observability kill9 commands poison)

# The compatibility subset, run again on every other PostgreSQL major
# (15 is Debian's, 16-18 come from npm: integration/pgdist.sh) after lane
# A, each on servers of its own. The whole suite runs on
# OUTBOX_IT_PG_MAJOR (unset: Debian's newest). OUTBOX_IT_COMPAT_MAJORS
# names the others (`make test-matrix` sets it empty: it runs the whole
# suite on each).
COMPAT=(relay_e2e kill9 recover unusual_tables outboxes tls failover_slots idle_slot)

log() { echo "suite.sh: $*" >&2; }

# A module of lane A that no longer exists is a stale list, not a pass.
for t in "${LANE_A[@]}"; do
    [[ -f tests/it/$t.rs ]] || { log "error: LANE_A names tests/it/$t.rs, which does not exist"; exit 1; }
done

lane_b=()
for f in tests/it/*.rs; do
    t=${f#tests/it/}
    t=${t%.rs}
    [[ $t == main ]] && continue
    [[ " ${LANE_A[*]} " == *" $t "* ]] || lane_b+=("$t")
done

# Runs the named modules of tests/it one after another (each one's tests
# with four threads); fails if any failed, after running them all.
run_modules() {
    local rc=0 m
    for m in "$@"; do
        cargo test --no-fail-fast --test it -- --test-threads=4 "$m::" || rc=1
    done
    return $rc
}
export -f run_modules

# Lane A: its modules, then the compatibility subset ($COMPAT) on each of
# $COMPAT_MAJORS, each with servers of its own. A TERM stops the servers.sh
# running (which tears its servers down) before the lane exits.
lane_a() {
    local rc=0 v
    # Every job of this shell: a TERM between starting one and noting its
    # pid still reaches it.
    trap 'kill -TERM $(jobs -p) 2>/dev/null; wait; exit 143' INT TERM
    integration/servers.sh with bash -c 'run_modules "$@"' lane-a "$@" &
    wait $! || rc=1
    for v in $COMPAT_MAJORS; do
        echo "suite.sh: PostgreSQL $v: $COMPAT"
        # shellcheck disable=SC2086 # a list of module names
        OUTBOX_IT_PG_MAJOR=$v integration/servers.sh with bash -c 'run_modules "$@"' "compat-$v" $COMPAT &
        wait $! || rc=1
    done
    return $rc
}
export -f lane_a

# Build everything first, in the foreground, so that compile errors show
# at once and the lanes only run. The example consumer also as a program
# (tests/it/crash_windows.rs runs it), so that no test builds it mid-run.
integration/servers.sh install
# The majors: Debian's and the ones pinned in pgdist.sh; the whole suite
# runs on OUTBOX_IT_PG_MAJOR (unset: Debian's newest), the subset on
# each other one (OUTBOX_IT_COMPAT_MAJORS names them instead; empty: none,
# for a machine without the npm registry).
debian_majors=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sed -E 's|.*/([0-9]+)/bin|\1|' | sort -n || true)
main_major=${OUTBOX_IT_PG_MAJOR:-$(tail -n 1 <<<"$debian_majors")}
if [[ -v OUTBOX_IT_COMPAT_MAJORS ]]; then
    read -r -a compat_majors <<<"$OUTBOX_IT_COMPAT_MAJORS"
else
    compat_majors=()
    for v in $(printf '%s\n' $debian_majors 16 17 18 | sort -nu); do
        [[ $v == "$main_major" ]] || compat_majors+=("$v")
    done
fi
for v in "${compat_majors[@]}"; do
    OUTBOX_IT_PG_MAJOR=$v integration/servers.sh install
done
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
    rc=0
    cargo test --no-fail-fast --lib --bins --examples --test checker -- --test-threads=4 || rc=1
    run_modules "${LANE_A[@]}" "${lane_b[@]}" || rc=1
    exit $rc
fi

mkdir -p target/suite
# The checker (checker/main.rs, not under tests/) runs in lane B.
lane_b_cmd='rc=0
cargo test --no-fail-fast --lib --bins --examples --test checker -- --test-threads=4 || rc=1
run_modules "$@" || rc=1
exit $rc'

started=$SECONDS
pid_a="" pid_b=""
# Ctrl-C or a TERM stops both lanes (each tears its servers down), and
# waits for them to have done so.
trap 'kill -TERM $pid_a $pid_b 2>/dev/null || true; wait || true; exit 143' INT TERM
COMPAT_MAJORS="${compat_majors[*]}" COMPAT="${COMPAT[*]}" \
    bash -c 'lane_a "$@"' lane-a "${LANE_A[@]}" \
    >target/suite/lane-a.log 2>&1 </dev/null &
pid_a=$!
integration/servers.sh with bash -c "$lane_b_cmd" lane-b "${lane_b[@]}" \
    >target/suite/lane-b.log 2>&1 </dev/null &
pid_b=$!
log "lane A: ${LANE_A[*]}; then on PostgreSQL ${compat_majors[*]:-(none)}: ${COMPAT[*]}"
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
# A test run that crashed (an abort, a stack overflow) prints no result
# line of its own: name it, so the count below is not taken for the whole.
grep -h -E '^error: test failed|process didn.t exit successfully' \
    target/suite/lane-a.log target/suite/lane-b.log || true
echo "$passed passed, $failed failed"
((rc_a == 0 && rc_b == 0))
