# shellcheck shell=bash
# PostgreSQL primary/standby pairs for the failover tests: sourced by
# servers.sh (whose header lists the `pgha` commands), never run alone.
#
# `servers.sh pgha up NAME` makes a fresh pair under $OUTBOX_IT_DIR/pgha-NAME
# (a test stops and promotes its servers, so each test makes its own):
#   env       TEST_PGHA_PRIMARY_URL, TEST_PGHA_STANDBY_URL
#                 postgres://postgres:postgres@127.0.0.1:PORT/postgres
#             TEST_PGHA_URL
#                 postgres://postgres:postgres@127.0.0.1:P1,127.0.0.1:P2/postgres
#                 (primary first; add target_session_attrs=read-write to
#                 connect to whichever of the two accepts writes)
#             TEST_PGHA_CTL   "<servers.sh> pgha NAME"
#   primary/  a server set up as the shared one (pg_init: wal_level=logical,
#             the same pg_hba.conf...), its port in primary/port
#   standby/  a base backup of the primary (pg_backup_start, a copy,
#             pg_backup_stop): a hot standby streaming over TCP through the
#             physical slot pgha_standby (so the primary keeps the WAL a
#             stopped standby has yet to receive); on PostgreSQL 17+ it
#             synchronizes failover slots (sync_replication_slots)
# The standby is a physical copy: what the primary has (tables, the
# publication, roles) it has too once replayed (`catchup` waits for that:
# replication is asynchronous), except replication slots, which a test must
# create again after promoting it. "primary" and "standby" name the two
# servers as made; after `promote`, both accept writes if the old primary is
# started again (nothing rewinds it).

PGHA_SLOT=pgha_standby

# psql on ROLE (primary or standby) of pair H, over its private socket.
pgha_psql() {
    local h=$1 role=$2
    shift 2
    as_postgres "$(psql_bin)" -h "$h/$role/pgsock" -p "$(cat "$h/$role/port")" \
        -U postgres -d postgres -X -A -t -q -v ON_ERROR_STOP=1 "$@"
}

# Wait until ROLE answers SQL with "t".
pgha_wait_for() {
    local h=$1 role=$2 sql=$3 what=$4 deadline=$((SECONDS + START_TIMEOUT))
    until [[ $(pgha_psql "$h" "$role" -c "$sql" 2>/dev/null) == t ]]; do
        ((SECONDS < deadline)) || die "pgha $h: the $role is not $what after ${START_TIMEOUT}s"
        sleep 0.2
    done
}

pgha_wait_streaming() {
    pgha_wait_for "$1" primary "SELECT EXISTS (SELECT FROM pg_stat_replication r
        JOIN pg_replication_slots s ON s.active_pid = r.pid
        WHERE s.slot_name = '$PGHA_SLOT' AND r.state = 'streaming')" "streaming to the standby"
}

pgha_in_recovery() { [[ $(pgha_psql "$1" "$2" -c 'SELECT pg_is_in_recovery()' 2>/dev/null) == t ]]; }

pgha_create() {
    local h=$1 name=$2 ports pport sport major
    ports=$(pick_ports "$h" 2)
    read -r pport sport <<<"$ports"
    mkdir "$h/primary" "$h/standby"
    echo "$pport" >"$h/primary/port"
    echo "$sport" >"$h/standby/port"
    major=$("$(pg_bin)/postgres" --version | sed -E 's/^[^0-9]*([0-9]+).*/\1/')

    pg_init "$h/primary" "$pport"
    pg_start "$h/primary" 9>&-

    local s=$h/standby
    install -d -o postgres -g postgres -m 700 "$s/pg"
    install -d -o postgres -g postgres -m 755 "$s/pgsock"
    install -o postgres -g postgres -m 644 /dev/null "$s/pg.log"
    # A base backup with the low-level API (the npm servers have no
    # pg_basebackup, and Debian's refuses newer servers): the slot first,
    # so the primary keeps the WAL from the backup's start on; then, in
    # one session, pg_backup_start, a file copy, pg_backup_stop, whose
    # label file goes into the copy as backup_label.
    pgha_psql "$h" primary -c "SELECT pg_create_physical_replication_slot('$PGHA_SLOT', true)" >/dev/null
    # psql's \! fails only when the shell cannot run: cp's status and
    # words go to files (of the postgres user, who runs them).
    local b=$s/backup
    install -d -o postgres -g postgres -m 755 "$b"
    if ! pgha_psql "$h" primary >"$s/basebackup.log" 2>&1 <<EOF; then
SELECT pg_backup_start('pgha', true) \g /dev/null
\! cp -a "$h/primary/pg/." "$s/pg/" 2>"$b/cp.err"; echo \$? >"$b/cp.rc"
SELECT labelfile FROM pg_backup_stop(false) \g $b/label.out
EOF
        cat "$s/basebackup.log" >&2
        die "the base backup of the primary failed"
    fi
    # A file the primary removed while it was copied is no loss (its
    # removal is in the WAL the standby replays); anything else is.
    [[ -s $b/cp.rc ]] || die "the copy of the primary's data directory did not run"
    if [[ $(cat "$b/cp.rc") != 0 ]] &&
        grep -v -e 'No such file or directory' "$b/cp.err" | grep -q .; then
        cat "$b/cp.err" >&2
        die "copying the primary's data directory failed"
    fi
    [[ -s $b/label.out ]] || die "pg_backup_stop returned no label file"
    # psql ends the value with a newline of its own.
    head -c -1 "$b/label.out" >"$s/pg/backup_label"
    chown postgres:postgres "$s/pg/backup_label"
    rm -rf "$s/pg"/{postmaster.pid,postmaster.opts} \
        "$s/pg/pg_replslot/"* "$s/pg/pg_wal/"* "$s/pg/pg_stat_tmp/"*
    install -o postgres -g postgres -m 600 /dev/null "$s/pg/standby.signal"
    # Over TCP with a password, as a standby of a real primary.
    cat >>"$s/pg/postgresql.conf" <<EOF

# ---- pgha standby (integration/pgha.sh) ----
primary_conninfo = 'host=127.0.0.1 port=$pport user=postgres password=postgres dbname=postgres application_name=$PGHA_SLOT'
primary_slot_name = '$PGHA_SLOT'
EOF
    if ((major >= 17)); then
        # Failover slots: the standby keeps a copy of every logical slot
        # made with failover = true (`pgha NAME synced SLOT` waits for it).
        # The primary names no standby slot in synchronized_standby_slots
        # unless a test sets it: a stopped standby would hold its relay.
        cat >>"$s/pg/postgresql.conf" <<EOF
sync_replication_slots = on
hot_standby_feedback = on
synchronized_standby_slots = ''
EOF
    fi
    # The copied postgresql.conf is the primary's: appended last, these win.
    cat >>"$s/pg/postgresql.conf" <<EOF

# ---- pgha standby (integration/pgha.sh) ----
port = $sport
unix_socket_directories = '$s/pgsock'
hot_standby = on
# Reconnect soon after the primary is back.
wal_retrieve_retry_interval = 1s
EOF
    pg_start "$s" 9>&-
    pgha_wait_streaming "$h"

    local url=postgres://postgres:postgres@127.0.0.1
    {
        emit TEST_PGHA_PRIMARY_URL "$url:$pport/postgres"
        emit TEST_PGHA_STANDBY_URL "$url:$sport/postgres"
        emit TEST_PGHA_URL "$url:$pport,127.0.0.1:$sport/postgres"
        emit TEST_PGHA_CTL "$SELF pgha $name"
    } >"$h/env"
}

# Stop both servers and delete the pair (a no-op without one).
pgha_down() {
    local h=$1 role
    [[ -d $h ]] || return 0
    for role in standby primary; do
        if [[ -d $h/$role/pg ]]; then pg_stop "$h/$role" immediate; fi
    done
    release_ports "$h"
    rm -rf "$h"
}

# For `servers.sh down`: once no command is at work on it (an `up` being
# interrupted undoes itself first), stop and delete each pair of DIR.
pgha_teardown() {
    local dir=$1 h
    for h in "$dir"/pgha-*/; do
        [[ -d $h ]] || continue
        h=${h%/}
        (
            flock -w 60 9 || log "warning: a pgha command still holds $h.lock"
            pgha_down "$h"
        ) 9>>"$h.lock"
    done
}

PGHA_ABORT=""
pgha_abort() {
    [[ -z $PGHA_ABORT ]] || pgha_down "$PGHA_ABORT"
}

pgha_up() {
    local h=$1 name=$2 started=$SECONDS
    mkdir "$h" 2>/dev/null || die "$h exists: each test makes a pair of its own (or: pgha $name down)"
    PGHA_ABORT=$h
    trap pgha_abort EXIT
    pgha_create "$h" "$name"
    trap - EXIT
    PGHA_ABORT=""
    log "pgha $name up in $((SECONDS - started))s ($h)"
}

pgha_status() {
    local h=$1 role rc=0 state
    for role in primary standby; do
        if ! pg_running "$h/$role"; then
            state=stopped rc=1
        elif pgha_in_recovery "$h" "$role"; then
            state="running, in recovery (a standby)"
        else
            state="running, accepts writes"
        fi
        printf '%-8s 127.0.0.1:%s  %s\n' "$role" "$(cat "$h/$role/port")" "$state"
    done
    if pg_running "$h/primary" && ! pgha_in_recovery "$h" primary; then
        pgha_psql "$h" primary -c "SELECT 'standby ' || r.state || ', replay lag '
            || coalesce((pg_current_wal_lsn() - r.replay_lsn)::text, '?') || ' bytes'
            FROM pg_stat_replication r JOIN pg_replication_slots s ON s.active_pid = r.pid
            WHERE s.slot_name = '$PGHA_SLOT'" 2>/dev/null || true
    fi
    return "$rc"
}

cmd_pgha() {
    local dir=${OUTBOX_IT_DIR:?OUTBOX_IT_DIR is not set (source DIR/env first)}
    local name sub
    # `pgha up NAME`, as well as `pgha NAME up` like the other commands.
    if [[ ${1:-} == up ]]; then
        name=${2:-} sub=up
        shift 2 || true
    else
        name=${1:-} sub=${2:-}
        shift 2 || true
    fi
    local usage="usage: servers.sh pgha up NAME | pgha NAME stop|start|kill primary|standby | pgha NAME synced SLOT | pgha NAME catchup|promote|status|down"
    [[ $name =~ ^[A-Za-z0-9_.-]+$ && $name != up ]] || die "$usage"
    local h=$dir/pgha-$name role=${1:-}
    case $sub in
        stop | start | kill) [[ $role == primary || $role == standby ]] || die "$usage" ;;
        synced) [[ $role =~ ^[A-Za-z0-9_]+$ ]] || die "$usage" ;;
        up | catchup | promote | status | down) ;;
        *) die "$usage" ;;
    esac
    [[ $sub == up || $sub == down || -f $h/env ]] || die "no pgha pair $name under $dir (servers.sh pgha up $name)"
    # One command at a time on a pair. Servers started while the lock is
    # held must not inherit fd 9 (they would hold it as long as they run).
    exec 9>>"$h.lock"
    flock -w 600 9 || die "timed out waiting for $h.lock"
    case $sub in
        up) pgha_up "$h" "$name" ;;
        down) pgha_down "$h" ;;
        stop) pg_stop "$h/$role" fast ;;
        kill) pg_stop "$h/$role" immediate ;;
        start)
            pg_start "$h/$role" 9>&-
            # The pair is whole again once the standby streams (if it can).
            if pg_running "$h/primary" && pg_running "$h/standby" && pgha_in_recovery "$h" standby; then
                pgha_wait_streaming "$h"
            fi
            ;;
        catchup)
            { pg_running "$h/primary" && pg_running "$h/standby"; } ||
                die "pgha $name: catchup needs both servers running"
            pgha_in_recovery "$h" standby || die "pgha $name: the standby was promoted"
            local lsn
            lsn=$(pgha_psql "$h" primary -c 'SELECT pg_current_wal_insert_lsn()')
            pgha_wait_for "$h" standby "SELECT pg_last_wal_replay_lsn() >= '$lsn'" "caught up with the primary"
            ;;
        promote)
            pg_running "$h/standby" || die "pgha $name: the standby is not running"
            if pgha_in_recovery "$h" standby; then
                pg_ctl_ "$h/standby" promote -w -t "$START_TIMEOUT" -s ||
                    die "pgha $name: pg_ctl promote failed (see $h/standby/pg.log)"
            fi
            pgha_wait_for "$h" standby 'SELECT NOT pg_is_in_recovery()' "accepting writes"
            ;;
        synced)
            # PostgreSQL 17+: until the standby's copy of logical slot
            # $role is ready to take over (synchronized, persistent, valid).
            # A standby snapshot on the primary now and then moves it on.
            local slot=$role deadline=$((SECONDS + START_TIMEOUT))
            until [[ $(pgha_psql "$h" standby -c "SELECT EXISTS (SELECT FROM pg_replication_slots
                    WHERE slot_name = '$slot' AND synced AND NOT temporary
                    AND invalidation_reason IS NULL)" 2>/dev/null) == t ]]; do
                ((SECONDS < deadline)) || die "pgha $name: slot $slot not synchronized to the standby after ${START_TIMEOUT}s"
                pgha_psql "$h" primary -c 'SELECT pg_log_standby_snapshot()' >/dev/null 2>&1 || true
                sleep 0.5
            done
            ;;
        status) pgha_status "$h" ;;
    esac
}
