#!/usr/bin/env bash
# The whole test suite, as `make test` runs it: built once, then run in
# three lanes at the same time, each against servers of its own (servers.sh
# with), so that one lane's faults (a broker stopped, PostgreSQL restarted)
# never reach another's tests. Most of the suite waits on servers, not on
# the CPU, so three lanes take about a third of the time of one.
#
#   integration/suite.sh            build, run the three lanes, print their logs
#
# The integration tests are one test binary (tests/it/main.rs), a module
# per concern. Within a lane its modules run one after another (`cargo test
# --test it -- <module>::`), each with four test threads, as separate
# binaries did: a module serializes its own disruptive tests, and no other
# module's tests run meanwhile. Lane A takes the modules named below (the
# longest ones, balanced against the rest by their measured times); lane B
# the library's and the binaries' unit tests, the examples, and every other
# module of tests/it/, so that a new module runs without
# being listed here; lane C the whole-system checker (checker/main.rs: its
# fixed seeds and regressions, the longest single part). Each lane's output
# goes to target/suite/lane-{a,b,c}.log and is printed whole when all have
# finished.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

LANE_A=(large_tx broker_alarm tls takeover package observability kill9 commands poison)

# The compatibility subset, run again on every other PostgreSQL major
# (15 is Debian's, 16-18 come from npm: integration/pgdist.sh) after the
# modules of lanes A and B, each on servers of its own. The whole suite runs on
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

# A lane: $LANE_FIRST when set (a command that needs no servers), its
# modules, then the compatibility subset ($COMPAT) on each of
# $COMPAT_MAJORS, each with servers of its own. A TERM stops the servers.sh
# running (which tears its servers down) before the lane exits.
lane() {
    local rc=0 v name=$1
    shift
    # Every job of this shell: a TERM between starting one and noting its
    # pid still reaches it.
    trap 'kill -TERM $(jobs -p) 2>/dev/null; wait; exit 143' INT TERM
    if [[ -n ${LANE_FIRST:-} ]]; then
        $LANE_FIRST &
        wait $! || rc=1
    fi
    integration/servers.sh with bash -c 'run_modules "$@"' "$name" "$@" &
    wait $! || rc=1
    for v in $COMPAT_MAJORS; do
        echo "suite.sh: PostgreSQL $v: $COMPAT"
        # shellcheck disable=SC2086 # a list of module names
        OUTBOX_IT_PG_MAJOR=$v integration/servers.sh with bash -c 'run_modules "$@"' "compat-$v" $COMPAT &
        wait $! || rc=1
    done
    return $rc
}
export -f lane

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

# The unit tests (library, binaries, examples): no servers needed.
unit='cargo test --no-fail-fast --lib --bins --examples -- --test-threads=4'
# The whole-system checker (checker/main.rs, not under tests/).
checker='cargo test --no-fail-fast --test checker'

# Servers of the caller's own (TEST_PG_URL, TEST_AMQP_URL): one set, so one
# lane, or one lane's faults would reach another's tests.
if [[ -n ${TEST_PG_URL:-} && -n ${TEST_AMQP_URL:-} ]]; then
    log "TEST_PG_URL and TEST_AMQP_URL are set: one lane, on those servers"
    rc=0
    $unit || rc=1
    $checker || rc=1
    run_modules "${LANE_A[@]}" "${lane_b[@]}" || rc=1
    exit $rc
fi

mkdir -p target/suite
# The compatibility majors, shared between lanes A and B: A takes the
# larger half (B also runs the unit tests; measured, with 16 17 18: A 899 s,
# B 1036 s, C 1254 s).
half=$(((${#compat_majors[@]} + 1) / 2))
compat_a="${compat_majors[*]:0:half}"
compat_b="${compat_majors[*]:half}"

started=$SECONDS
# Ctrl-C or a TERM stops every lane (each tears its servers down), and
# waits for them to have done so.
# Every job of this shell: a TERM between starting a lane and noting its
# pid still reaches it.
trap 'kill -TERM $(jobs -p) 2>/dev/null || true; wait || true; exit 143' INT TERM
COMPAT_MAJORS="$compat_a" COMPAT="${COMPAT[*]}" \
    bash -c 'lane "$@"' lane-a lane-a "${LANE_A[@]}" \
    >target/suite/lane-a.log 2>&1 </dev/null &
pid_a=$!
LANE_FIRST="$unit" COMPAT_MAJORS="$compat_b" COMPAT="${COMPAT[*]}" \
    bash -c 'lane "$@"' lane-b lane-b "${lane_b[@]}" \
    >target/suite/lane-b.log 2>&1 </dev/null &
pid_b=$!
integration/servers.sh with $checker >target/suite/lane-c.log 2>&1 </dev/null &
pid_c=$!
log "lane A: ${LANE_A[*]}; then on PostgreSQL ${compat_a:-(none)}: ${COMPAT[*]}"
log "lane B: unit tests, examples, ${lane_b[*]}; then on PostgreSQL ${compat_b:-(none)}: ${COMPAT[*]}"
log "lane C: the checker (checker/main.rs)"
rc_a=0 rc_b=0 rc_c=0
wait "$pid_a" || rc_a=$?
log "lane A finished (exit $rc_a) after $((SECONDS - started))s"
wait "$pid_b" || rc_b=$?
log "lane B finished (exit $rc_b) after $((SECONDS - started))s"
wait "$pid_c" || rc_c=$?
log "lane C finished (exit $rc_c) after $((SECONDS - started))s"

logs=(target/suite/lane-a.log target/suite/lane-b.log target/suite/lane-c.log)
for f in "${logs[@]}"; do
    echo "================ $f"
    cat "$f"
done

# One closing line for the whole run, counted from the lanes' libtest lines.
read -r passed failed < <(
    grep -h '^test result:' "${logs[@]}" |
        awk '{for (i = 1; i <= NF; i++) {if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i}} END {print p + 0, f + 0}'
)
echo "suite: lane A exit $rc_a, lane B exit $rc_b, lane C exit $rc_c, $((SECONDS - started))s"
# A test run that crashed (an abort, a stack overflow) prints no result
# line of its own: name it, so the count below is not taken for the whole.
grep -h -E '^error: test failed|process didn.t exit successfully' "${logs[@]}" || true
echo "$passed passed, $failed failed"
((rc_a == 0 && rc_b == 0 && rc_c == 0))
