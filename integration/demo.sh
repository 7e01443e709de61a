#!/usr/bin/env bash
# End-to-end demo of outbox-relay: events committed to the outbox table come
# out of RabbitMQ, events whose transaction rolled back do not.
#
# Run it through the harness, which provides the servers:
#   make demo                      (or: integration/servers.sh with integration/demo.sh)
# or against servers of your own by exporting TEST_PG_URL (a superuser) and
# TEST_AMQP_URL first; the demo then leaves the outbox table, publication
# outbox_pub and slot outbox_relay behind, so that it can run again: drop the
# slot when done (SELECT pg_drop_replication_slot('outbox_relay')), or it
# keeps WAL forever.
#
# Relies on this contract of the binary (OUTBOX_RELAY_BIN overrides which):
#   outbox-relay setup --config FILE   creates the publication and the slot
#   outbox-relay run --config FILE     relays until SIGTERM, then exits 0
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

: "${TEST_PG_URL:?not set: run me via make demo, or integration/servers.sh with $0}"
: "${TEST_AMQP_URL:?not set: run me via make demo, or integration/servers.sh with $0}"

# OUTBOX_RELAY_BIN runs another build (e.g. target/release/outbox-relay)
# instead of building the debug one.
RELAY=${OUTBOX_RELAY_BIN:-target/debug/outbox-relay}
TIMEOUT=30 # seconds for the committed events to arrive

step() { printf '\n==> %s\n' "$*"; }
die() {
    echo "demo: error: $*" >&2
    exit 1
}

# The newest server's psql, as servers.sh uses; Debian's /usr/bin/psql
# wrapper can pick an older client when several versions are installed.
# shellcheck disable=SC2012 # the paths are plain version numbers
PSQL=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)/psql
[[ -x $PSQL ]] || PSQL=$(command -v psql) || die "psql not found (run integration/servers.sh install)"
psql_() { "$PSQL" "$TEST_PG_URL" -X -q -v ON_ERROR_STOP=1 "$@"; }

# Scratch files live with the servers when the harness made them, so that
# `servers.sh down` removes them too.
if [[ -n ${OUTBOX_IT_DIR:-} ]]; then
    WORK=$OUTBOX_IT_DIR/demo
    mkdir -p "$WORK"
else
    WORK=$(mktemp -d)
fi

RELAY_PID=""
CONSUMER_PID=""
cleanup() {
    local pid
    for pid in $RELAY_PID $CONSUMER_PID; do
        kill "$pid" 2>/dev/null || true
    done
    [[ -n ${OUTBOX_IT_DIR:-} ]] || rm -rf "$WORK"
}
trap cleanup EXIT

if [[ -z ${OUTBOX_RELAY_BIN:-} ]]; then
    step "building outbox-relay"
    cargo build
fi
[[ -x $RELAY ]] || die "$RELAY not found"

step "creating the outbox table"
if [[ -n $(psql_ -Atc "SELECT to_regclass('public.outbox')") ]]; then
    echo "public.outbox already exists, keeping it"
else
    psql_ -f sql/outbox.sql
fi

step "declaring exchange 'outbox' (topic) and queue 'demo' bound with '#'"
# pika is the stdlib-free part of the demo; install it on first use.
if ! python3 -c 'import pika' 2>/dev/null; then
    python3 -m pip install --quiet pika
fi
# The consumer declares and binds first, then listens; it exits once every
# committed event arrived (0), or on timeout or a rolled-back event (1).
python3 integration/demo_consumer.py \
    --url "$TEST_AMQP_URL" --exchange outbox --queue demo \
    --ready "$WORK/consumer.ready" \
    --expect order.created,order.paid,customer.registered \
    --forbid order.cancelled \
    --timeout "$TIMEOUT" &
CONSUMER_PID=$!
for _ in $(seq 100); do
    [[ -e $WORK/consumer.ready ]] && break
    kill -0 "$CONSUMER_PID" 2>/dev/null || die "the consumer could not set up the queue"
    sleep 0.1
done
[[ -e $WORK/consumer.ready ]] || die "the consumer did not set up the queue within 10s"

CONFIG=$WORK/outbox-relay.toml
cat >"$CONFIG" <<EOF
[postgres]
url = "$TEST_PG_URL"
slot = "outbox_relay"
publication = "outbox_pub"

[outbox]
table = "public.outbox"

[rabbitmq]
url = "$TEST_AMQP_URL"
exchange = "outbox"
routing_key = "{aggregate_type}.{event_type}"

[http]
# Any free port (logged at start), so the demo never clashes with a relay
# already listening on the default 127.0.0.1:9187.
listen = "127.0.0.1:0"
EOF
echo "config: $CONFIG"
sed 's/^/    /' "$CONFIG"

step "outbox-relay setup"
"$RELAY" setup --config "$CONFIG"

step "starting outbox-relay run"
# Prefixed so that its log lines stand apart from the consumer's output.
RUST_LOG=${RUST_LOG:-info} "$RELAY" run --config "$CONFIG" > >(sed -u 's/^/[relay] /') 2>&1 &
RELAY_PID=$!

step "inserting events (3 committed in 2 transactions, 1 rolled back)"
psql_ <<'SQL'
BEGIN;
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
VALUES ('order', '1001', 'created', '{"order_id": 1001, "total": "42.50", "currency": "EUR"}');
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
VALUES ('order', '1001', 'paid', '{"order_id": 1001, "method": "card"}');
COMMIT;

-- Never happened as far as the outside world is concerned.
BEGIN;
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
VALUES ('order', '1002', 'cancelled', '{"order_id": 1002}');
ROLLBACK;

BEGIN;
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
VALUES ('customer', '42', 'registered', '{"customer_id": 42, "name": "Ada"}',
        '{"tenant": "acme", "trace_id": "demo-trace-1"}');
COMMIT;
SQL
psql_ -c 'SELECT id, aggregate_type, aggregate_id, event_type, created_at FROM outbox ORDER BY created_at'

step "waiting up to ${TIMEOUT}s for the committed events in queue 'demo'"
# A relay that dies would otherwise only show as a consumer timeout.
while kill -0 "$CONSUMER_PID" 2>/dev/null; do
    if ! kill -0 "$RELAY_PID" 2>/dev/null; then
        rc=0
        wait "$RELAY_PID" || rc=$?
        RELAY_PID=""
        die "outbox-relay run exited early with status $rc"
    fi
    sleep 0.2
done
rc=0
wait "$CONSUMER_PID" || rc=$?
CONSUMER_PID=""

step "stopping outbox-relay (SIGTERM)"
kill -TERM "$RELAY_PID" 2>/dev/null || true
for _ in $(seq 150); do
    kill -0 "$RELAY_PID" 2>/dev/null || break
    sleep 0.1
done
if kill -0 "$RELAY_PID" 2>/dev/null; then
    kill -KILL "$RELAY_PID" 2>/dev/null || true
    die "outbox-relay did not stop within 15s of SIGTERM"
fi
relay_rc=0
wait "$RELAY_PID" || relay_rc=$?
RELAY_PID=""
echo "outbox-relay exited with status $relay_rc"

((rc == 0)) || die "not all committed events arrived (or a rolled-back one did)"
((relay_rc == 0)) || die "outbox-relay did not shut down cleanly"
step "demo OK"
