#!/usr/bin/env bash
# Throwaway PostgreSQL + RabbitMQ servers for the integration tests and the demo.
#
#   servers.sh install              apt-get install postgresql/rabbitmq-server (and
#                                   prometheus, for promtool, and python3-yaml:
#                                   tests/it/deploy.rs) if missing
#   servers.sh up DIR               start both servers under DIR, write DIR/env
#   servers.sh down DIR             stop both servers, delete DIR
#   servers.sh with CMD [ARGS...]   install + up + run CMD with DIR/env loaded + down
#   servers.sh pg stop|start|restart|kill|status       } act on the servers of
#   servers.sh rabbitmq stop|start|status|freeze|thaw|ctl ARGS... } $OUTBOX_IT_DIR
#     pg stop/restart shut down "fast", pg kill "immediate" (a crash); start
#     and stop are no-ops when already started/stopped; start returns once
#     the server accepts connections; rabbitmq ctl runs rabbitmqctl ARGS.
#
# Made on demand by the failover tests, also under $OUTBOX_IT_DIR and also
# deleted by `down` (env files and details: integration/cluster.sh, pgha.sh):
#   servers.sh cluster up|down|restart|status      a 3-node RabbitMQ cluster;
#   servers.sh cluster stop|start|stop_app|start_app N...   up writes
#   servers.sh cluster ctl N ARGS...               DIR/cluster/env
#     up is idempotent (and starts nodes left stopped); start, start_app and
#     restart return once the nodes have (re)joined the others; status exits
#     0 only if all three nodes run.
#   servers.sh pgha up NAME                        a PostgreSQL primary and a
#   servers.sh pgha NAME stop|start|kill primary|standby   streaming standby;
#   servers.sh pgha NAME catchup|promote|status|down       up writes
#     DIR/pgha-NAME/env; up and start return once the standby streams (if it
#     can), catchup once it has replayed all the primary wrote, promote once
#     it accepts writes.
#
# The servers are private: their own data directories, free ports picked at
# run time, their own epmd, a random Erlang cookie. The system PostgreSQL
# cluster and the system RabbitMQ node are never started or touched, so
# several harnesses (and a developer's own servers) can run side by side.
#
# DIR/env exports what the tests read:
#   TEST_PG_URL, TEST_AMQP_URL   connection URLs (superuser postgres, guest)
#   OUTBOX_IT_DIR                DIR, so that the `pg`/`rabbitmq` subcommands
#                                know which servers to act on
#   TEST_PG_CTL, TEST_RABBITMQ_CTL
#                                "<this script> pg" / "<this script> rabbitmq":
#                                failure tests append stop/start/restart/ctl ...
#
# Environment knobs:
#   OUTBOX_IT_TMP   parent of the directory made by `with` (default /tmp); it
#                   must be reachable by the `postgres` OS user.
#   OUTBOX_IT_RABBITMQ_TLS_DIR
#                   for `up`: a directory holding ca.pem, server.pem and
#                   server.key (PEM). RabbitMQ then also accepts AMQPS on a
#                   port of its own with that certificate, and DIR/env also
#                   exports TEST_AMQPS_URL (amqps://guest:guest@127.0.0.1:PORT/%2f).
set -euo pipefail

SELF=$(readlink -f "${BASH_SOURCE[0]}")
RMQ_BIN=/usr/lib/rabbitmq/bin
# Port reservations shared by all harnesses on this machine (see pick_ports).
PORT_REGISTRY=/tmp/outbox-it-ports
# How long a server may take to come up before we give up.
START_TIMEOUT=60

log() { echo "servers.sh: $*" >&2; }
die() {
    log "error: $*"
    exit 1
}

# shellcheck disable=SC2012 # the paths are plain version numbers
debian_pg_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1; }

# The server's binaries (initdb, pg_ctl, postgres): PostgreSQL
# $OUTBOX_IT_PG_MAJOR, Debian's if it has that major, else from npm
# (integration/pgdist.sh: 16, 17, 18); unset, Debian's newest.
pg_bin() {
    local m=${OUTBOX_IT_PG_MAJOR:-}
    if [[ -z $m ]]; then
        debian_pg_bin
    elif [[ -d /usr/lib/postgresql/$m/bin ]]; then
        echo "/usr/lib/postgresql/$m/bin"
    else
        pgdist_bin "$m"
    fi
}

# psql is always Debian's (the npm servers come without one); it speaks
# to newer servers for plain SQL.
psql_bin() { echo "$(debian_pg_bin)/psql"; }

have_debian_pg() {
    local bin
    bin=$(debian_pg_bin)
    [[ -n $bin && -x $bin/initdb && -x $bin/pg_ctl && -x $bin/postgres && -x $bin/psql ]]
}

have_pg() {
    local bin
    bin=$(pg_bin)
    have_debian_pg && [[ -x $bin/initdb && -x $bin/pg_ctl && -x $bin/postgres ]]
}

have_rabbitmq() {
    [[ -x $RMQ_BIN/rabbitmq-server && -x $RMQ_BIN/rabbitmqctl ]] && command -v epmd >/dev/null
}

# Run a command as the postgres OS user: PostgreSQL refuses to run as root.
as_postgres() { runuser -u postgres -- "$@"; }

# ---------------------------------------------------------------- install

cmd_install() {
    local pkgs=()
    have_debian_pg || pkgs+=(postgresql)
    have_rabbitmq || pkgs+=(rabbitmq-server)
    command -v python3 >/dev/null || pkgs+=(python3)
    # tests/it/deploy.rs reads the Kubernetes manifest with PyYAML.
    python3 -c 'import yaml' 2>/dev/null || pkgs+=(python3-yaml)
    # tests/it/package.rs: building (objdump) and checking (systemd-analyze)
    # the Debian package.
    command -v objdump >/dev/null || pkgs+=(binutils)
    command -v systemd-analyze >/dev/null || pkgs+=(systemd)
    # promtool checks and unit-tests deploy/prometheus (tests/it/deploy.rs).
    command -v promtool >/dev/null || pkgs+=(prometheus)
    ((${#pkgs[@]})) || {
        install_pg_major
        return 0
    }

    log "installing ${pkgs[*]} ..."
    export DEBIAN_FRONTEND=noninteractive
    local out
    out=$(mktemp)
    # The packages' postinst scripts would start the *system* PostgreSQL
    # cluster, RabbitMQ node and Prometheus server. A policy-rc.d that answers 101 ("action
    # forbidden") stops that; only add one if the machine has none already.
    local own_policy=""
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        own_policy=1
    fi
    local rc=0
    {
        # Only refresh the package lists when they don't know the packages,
        # or when an install from the current lists fails (stale mirrors).
        if ! apt-cache show "${pkgs[@]}" >/dev/null 2>&1; then
            apt-get update -q
        fi
        apt-get install -y -q --no-install-recommends "${pkgs[@]}" ||
            { apt-get update -q && apt-get install -y -q --no-install-recommends "${pkgs[@]}"; }
    } >"$out" 2>&1 || rc=$?
    [[ -z $own_policy ]] || rm -f /usr/sbin/policy-rc.d
    if ((rc != 0)); then
        tail -n 40 "$out" >&2
        rm -f "$out"
        die "apt-get install ${pkgs[*]} failed"
    fi
    rm -f "$out"
    have_debian_pg || die "PostgreSQL binaries still missing after install"
    install_pg_major
    have_rabbitmq || die "RabbitMQ binaries still missing after install"
    command -v promtool >/dev/null || die "promtool still missing after installing prometheus"
    # Only promtool is wanted: the Prometheus server (port 9090) the package
    # enables must not start at boot either, where systemd runs.
    if [[ " ${pkgs[*]} " == *" prometheus "* && -d /run/systemd/system ]]; then
        systemctl disable --now prometheus.service >/dev/null 2>&1 ||
            log "warning: could not disable prometheus.service"
    fi
}

# OUTBOX_IT_PG_MAJOR's server, if Debian does not have it.
install_pg_major() {
    local m=${OUTBOX_IT_PG_MAJOR:-}
    [[ -z $m || -d /usr/lib/postgresql/$m/bin ]] || pgdist_fetch "$m"
}

# pgdist_bin, pgdist_fetch
# shellcheck source=integration/pgdist.sh
source "${SELF%/*}/pgdist.sh"

# ---------------------------------------------------------------- ports

# pick_ports, release_ports, wait_for_port
# shellcheck source=integration/ports.sh
source "${SELF%/*}/ports.sh"

# ---------------------------------------------------------------- PostgreSQL

pg_init() {
    local dir=$1 port=$2 bin
    bin=$(pg_bin)
    install -d -o postgres -g postgres -m 700 "$dir/pg"
    install -d -o postgres -g postgres -m 755 "$dir/pgsock"
    install -o postgres -g postgres -m 644 /dev/null "$dir/pg.log"
    install -o postgres -g postgres -m 600 /dev/null "$dir/pg.pw"
    echo postgres >"$dir/pg.pw"

    # C locale + no fsync: fast and identical on every machine.
    if ! as_postgres "$bin/initdb" -D "$dir/pg" -U postgres --pwfile="$dir/pg.pw" \
        --auth-local=trust --auth-host=scram-sha-256 \
        -E UTF8 --no-locale --no-sync >"$dir/initdb.log" 2>&1; then
        cat "$dir/initdb.log" >&2
        die "initdb failed"
    fi
    rm -f "$dir/pg.pw"

    # Appended last, so these win over initdb's defaults.
    cat >>"$dir/pg/postgresql.conf" <<EOF

# ---- outbox-relay integration harness (integration/servers.sh) ----
port = $port
listen_addresses = '127.0.0.1'
unix_socket_directories = '$dir/pgsock'
# pgoutput logical replication; every test may create its own slot.
wal_level = logical
max_replication_slots = 40
max_wal_senders = 40
wal_sender_timeout = 60s
# Tests run 4 at a time, each with a few connections plus a walsender.
max_connections = 200
# The checker's workload commits and rolls back prepared transactions.
max_prepared_transactions = 20
# Durability is pointless for a throwaway cluster; speed is not.
fsync = off
synchronous_commit = off
full_page_writes = off
shared_buffers = 128MB
max_wal_size = 1GB
# Enough context in DIR/pg.log to debug a failing test.
log_line_prefix = '%m [%p] %q%u@%d/%a '
log_replication_commands = on
EOF

    # Passwords over TCP (as the relay connects in production); trust on
    # the private socket. The relay's logical replication connections are
    # admitted by the database line, as sql/role.sql advises; physical
    # replication (pg_basebackup) over TCP only for the superuser, so that
    # tests can show the relay's own role refused it.
    cat >"$dir/pg/pg_hba.conf" <<'EOF'
# TYPE  DATABASE     USER      ADDRESS       METHOD
local   all          all                     trust
local   replication  all                     trust
host    all          all       127.0.0.1/32  scram-sha-256
host    replication  postgres  127.0.0.1/32  scram-sha-256
EOF
}

pg_ctl_() {
    local dir=$1
    shift
    as_postgres "$(pg_bin)/pg_ctl" -D "$dir/pg" "$@"
}

pg_running() { pg_ctl_ "$1" status >/dev/null 2>&1; }

pg_start() {
    local dir=$1
    pg_running "$dir" && return 0
    if ! pg_ctl_ "$dir" -l "$dir/pg.log" -w -t "$START_TIMEOUT" -s start; then
        tail -n 30 "$dir/pg.log" >&2
        die "PostgreSQL did not start"
    fi
}

# MODE fast: what an operator does (clients are disconnected, clean
# shutdown checkpoint); immediate: a crash (recovery on the next start).
pg_stop() {
    local dir=$1 mode=${2:-fast}
    pg_running "$dir" || return 0
    # A fast shutdown waits for walsenders to flush WAL to their clients, so
    # a stuck replication client can hold it up: fall back to immediate,
    # which also takes every backend down (a bare kill -9 of the postmaster
    # would leave backends holding the shared memory and block the restart).
    pg_ctl_ "$dir" -m "$mode" -w -t 30 -s stop 2>/dev/null ||
        pg_ctl_ "$dir" -m immediate -w -t 30 -s stop || true
    if pg_running "$dir"; then
        local pid
        pid=$(head -n 1 "$dir/pg/postmaster.pid" 2>/dev/null) || return 0
        if [[ -n $pid ]]; then kill -9 "$pid" 2>/dev/null || true; fi
    fi
}

cmd_pg() {
    local dir=${OUTBOX_IT_DIR:?OUTBOX_IT_DIR is not set (source DIR/env first)}
    [[ -d $dir/pg ]] || die "no PostgreSQL under $dir"
    case ${1:-} in
        start) pg_start "$dir" ;;
        stop) pg_stop "$dir" fast ;;
        restart)
            pg_stop "$dir" fast
            pg_start "$dir"
            ;;
        kill) pg_stop "$dir" immediate ;;
        status) pg_ctl_ "$dir" status ;;
        *) die "usage: servers.sh pg stop|start|restart|kill|status" ;;
    esac
}

# ---------------------------------------------------------------- RabbitMQ

# NAME and EPMD_DIR (where epmd.pid is) default to those of the single node.
rabbitmq_init() {
    local dir=$1 amqp_port=$2 dist_port=$3 epmd_port=$4
    local r=$dir/rabbitmq name=${5:-outbox-it-$$@localhost} epmd_dir=${6:-$dir/rabbitmq}
    mkdir -p "$r/home" "$r/mnesia" "$r/log" "$r/plugins-expand"

    # Anything under /etc/rabbitmq is for the system node: point every
    # config path at files of our own, some of them empty or absent.
    : >"$r/rabbitmq-env.conf"
    # The consistent-hash exchange (shipped with the server): the example
    # consumer's partitions (README, "Consuming in parallel").
    echo '[rabbitmq_consistent_hash_exchange].' >"$r/enabled_plugins"
    cat >"$r/rabbitmq.conf" <<EOF
listeners.tcp.default = 127.0.0.1:$amqp_port
# Let guest/guest log in over 127.0.0.1 TCP like any other client.
loopback_users = none
log.file.level = info
log.console = false
EOF
    # Random cookie: nobody but this harness can control the node.
    head -c 32 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' >"$r/home/.erlang.cookie"
    chmod 600 "$r/home/.erlang.cookie"

    # Everything that rabbitmq-server and rabbitmqctl need to find this node
    # and nothing else; sourced by every later command.
    {
        emit HOME "$r/home"
        emit RABBITMQ_NODENAME "$name"
        emit RABBITMQ_NODE_IP_ADDRESS 127.0.0.1
        emit RABBITMQ_NODE_PORT "$amqp_port"
        emit RABBITMQ_DIST_PORT "$dist_port"
        # A private epmd: another epmd (system node, other harnesses) can
        # neither see this node nor be killed along with it.
        emit ERL_EPMD_PORT "$epmd_port"
        emit ERL_EPMD_ADDRESS 127.0.0.1
        emit OUTBOX_IT_EPMD_DIR "$epmd_dir"
        emit RABBITMQ_CONF_ENV_FILE "$r/rabbitmq-env.conf"
        emit RABBITMQ_CONFIG_FILE "$r/rabbitmq.conf"
        emit RABBITMQ_ADVANCED_CONFIG_FILE "$r/advanced.config"
        emit RABBITMQ_ENABLED_PLUGINS_FILE "$r/enabled_plugins"
        emit RABBITMQ_PLUGINS_EXPAND_DIR "$r/plugins-expand"
        emit RABBITMQ_MNESIA_BASE "$r/mnesia"
        emit RABBITMQ_LOG_BASE "$r/log"
        emit RABBITMQ_LOGS "$r/log/rabbit.log"
        emit RABBITMQ_PID_FILE "$r/rabbitmq.pid"
        emit ERL_CRASH_DUMP "$r/erl_crash.dump"
        # The node and the CLI use only the private epmd started below; the
        # distribution listener stays on loopback.
        emit RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS "-start_epmd false -kernel inet_dist_use_interface {127,0,0,1}"
        emit RABBITMQ_CTL_ERL_ARGS "-start_epmd false"
        # CLI tools listen on an ephemeral port rather than the shared
        # 35672-35682 range, so concurrent rabbitmqctl calls never run out.
        emit RABBITMQ_CTL_DIST_PORT_MIN 0
        emit RABBITMQ_CTL_DIST_PORT_MAX 0
        emit OUTBOX_IT_RABBITMQ_DIR "$r"
    } >"$r/rabbitmq.env"
}

emit() { printf 'export %s=%q\n' "$1" "$2"; }

# An AMQPS listener on PORT with the certificate in TLS_DIR. A client may
# present a certificate (verified against TLS_DIR/ca.pem) and, with SASL
# EXTERNAL, log in as the user its common name names; without one it logs
# in with a password as before.
rabbitmq_tls() {
    local dir=$1 tls_dir=$2 port=$3
    cat >>"$dir/rabbitmq/rabbitmq.conf" <<EOF
listeners.ssl.default = 127.0.0.1:$port
ssl_options.cacertfile = $tls_dir/ca.pem
ssl_options.certfile = $tls_dir/server.pem
ssl_options.keyfile = $tls_dir/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = false
auth_mechanisms.1 = PLAIN
auth_mechanisms.2 = AMQPLAIN
auth_mechanisms.3 = EXTERNAL
ssl_cert_login_from = common_name
EOF
    echo '[rabbitmq_consistent_hash_exchange,rabbitmq_auth_mechanism_ssl].' \
        >"$dir/rabbitmq/enabled_plugins"
}

# rabbitmqctl against our node (call inside a subshell that sourced rabbitmq.env).
rmqctl() { "$RMQ_BIN/rabbitmqctl" -q -n "$RABBITMQ_NODENAME" "$@"; }

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Start an epmd on PORT unless the one recorded in DIR/epmd.pid runs.
epmd_start() {
    local e=$1 port=$2 i
    pid_alive "$e/epmd.pid" && return 0
    setsid epmd -port "$port" -address 127.0.0.1 </dev/null >>"$e/epmd.log" 2>&1 &
    echo $! >"$e/epmd.pid"
    for i in $(seq 50); do
        epmd -port "$port" -names >/dev/null 2>&1 && break
        ((i < 50)) || die "epmd did not start (see $e/epmd.log)"
        sleep 0.1
    done
}

# Start epmd (if needed) and the node, return once AMQP connections are accepted.
rabbitmq_start() (
    local dir=$1 r=$1/rabbitmq
    # shellcheck disable=SC1091
    source "$r/rabbitmq.env"
    cd "$r"
    # Cluster nodes share their cluster's epmd; the single node has its own.
    epmd_start "${OUTBOX_IT_EPMD_DIR:-$r}" "$ERL_EPMD_PORT"

    if pid_alive "$r/server.pid"; then
        # The VM is up: at most the app was stopped (`ctl stop_app`).
        rmqctl start_app >/dev/null
        wait_for_port "$RABBITMQ_NODE_PORT" 10 || die "RabbitMQ is up but not listening on $RABBITMQ_NODE_PORT"
        return 0
    fi
    # Own session: a Ctrl-C aimed at the test run must not reach the broker
    # before `down` stops it in order.
    setsid "$RMQ_BIN/rabbitmq-server" </dev/null >>"$r/startup.log" 2>&1 &
    echo $! >"$r/server.pid"

    # await_startup fails at once while the node is not yet registered with
    # epmd, so retry it until the deadline.
    local deadline=$((SECONDS + START_TIMEOUT))
    until rmqctl await_startup --timeout 10 >/dev/null 2>&1; do
        if ! pid_alive "$r/server.pid" || ((SECONDS >= deadline)); then
            tail -n 30 "$r/startup.log" "$r/log/rabbit.log" >&2 2>/dev/null || true
            die "RabbitMQ did not start"
        fi
        sleep 0.5
    done
    wait_for_port "$RABBITMQ_NODE_PORT" 10 || die "RabbitMQ is up but not listening on $RABBITMQ_NODE_PORT"
)

rabbitmq_stop() (
    local dir=$1 r=$1/rabbitmq
    [[ -f $r/rabbitmq.env ]] || return 0
    # shellcheck disable=SC1091
    source "$r/rabbitmq.env"
    pid_alive "$r/server.pid" || return 0
    # SIGTERM makes the rabbitmq-server wrapper stop the node gracefully (the
    # same shutdown as `rabbitmqctl stop`: connections closed, queues
    # synced), without depending on the CLI reaching the node, and faster.
    local wrapper i
    wrapper=$(cat "$r/server.pid")
    kill -TERM "$wrapper" 2>/dev/null || true
    for i in $(seq 300); do
        pid_alive "$r/server.pid" || pid_alive "$RABBITMQ_PID_FILE" || break
        sleep 0.1
    done
    # Whatever survived 30 s is killed. The wrapper was started with
    # setsid, so its process group holds the VM and its helper processes,
    # also when the VM has not written its pid file yet.
    if pid_alive "$r/server.pid" || pid_alive "$RABBITMQ_PID_FILE"; then
        log "RabbitMQ did not stop within 30s; killing it"
        kill -9 -- "-$wrapper" 2>/dev/null || true
        if pid_alive "$RABBITMQ_PID_FILE"; then
            kill -9 "$(cat "$RABBITMQ_PID_FILE")" 2>/dev/null || true
        fi
    fi
    rm -f "$r/server.pid" "$RABBITMQ_PID_FILE"
)

epmd_stop() {
    local e=$1
    pid_alive "$e/epmd.pid" && kill "$(cat "$e/epmd.pid")" 2>/dev/null
    rm -f "$e/epmd.pid"
}

cmd_rabbitmq() {
    local dir=${OUTBOX_IT_DIR:?OUTBOX_IT_DIR is not set (source DIR/env first)}
    [[ -f $dir/rabbitmq/rabbitmq.env ]] || die "no RabbitMQ under $dir"
    local sub=${1:-}
    shift || true
    case $sub in
        start) rabbitmq_start "$dir" ;;
        stop) rabbitmq_stop "$dir" ;;
        status) pid_alive "$dir/rabbitmq/server.pid" ;;
        # A hung broker: the VM stops (SIGSTOP) with its sockets open, so
        # clients see silence, not a closed connection. `thaw` resumes it.
        freeze | thaw)
            (
                # shellcheck disable=SC1091
                source "$dir/rabbitmq/rabbitmq.env"
                pid_alive "$RABBITMQ_PID_FILE" || die "RabbitMQ is not running"
                kill "-$([[ $sub == freeze ]] && echo STOP || echo CONT)" "$(cat "$RABBITMQ_PID_FILE")"
            )
            ;;
        ctl)
            (
                # shellcheck disable=SC1091
                source "$dir/rabbitmq/rabbitmq.env"
                rmqctl "$@"
            )
            ;;
        *) die "usage: servers.sh rabbitmq stop|start|status|freeze|thaw|ctl ARGS..." ;;
    esac
}

# ---------------------------------------------------------------- up / down

cmd_up() {
    local dir=${1:?usage: servers.sh up DIR}
    mkdir -p "$dir"
    dir=$(readlink -f "$dir")
    [[ -z $(ls -A "$dir") ]] || die "$dir is not empty"
    # Marks DIR as ours, so that `down` may delete it.
    touch "$dir/.outbox-it"
    # The postgres OS user owns DIR/pg and must be able to reach it.
    chmod 755 "$dir"
    as_postgres test -x "$dir" ||
        die "the postgres OS user cannot reach $dir; use a directory under /tmp"

    local tls_dir=${OUTBOX_IT_RABBITMQ_TLS_DIR:-} nports=4 f
    if [[ -n $tls_dir ]]; then
        tls_dir=$(readlink -f "$tls_dir")
        for f in ca.pem server.pem server.key; do
            [[ -r $tls_dir/$f ]] || die "OUTBOX_IT_RABBITMQ_TLS_DIR: no readable $tls_dir/$f"
        done
        nports=5
    fi

    local ports pg_port amqp_port dist_port epmd_port amqps_port
    ports=$(pick_ports "$dir" "$nports")
    read -r pg_port amqp_port dist_port epmd_port amqps_port <<<"$ports"

    have_pg || die "PostgreSQL ${OUTBOX_IT_PG_MAJOR:-} is not installed: run servers.sh install"
    local pg_major
    pg_major=$("$(pg_bin)/postgres" --version | sed -E 's/^[^0-9]*([0-9]+).*/\1/')
    pg_init "$dir" "$pg_port"
    pg_start "$dir"
    rabbitmq_init "$dir" "$amqp_port" "$dist_port" "$epmd_port"
    if [[ -n $tls_dir ]]; then rabbitmq_tls "$dir" "$tls_dir" "$amqps_port"; fi
    rabbitmq_start "$dir"
    if [[ -n $tls_dir ]]; then
        wait_for_port "$amqps_port" 10 || die "RabbitMQ is up but not listening for AMQPS on $amqps_port"
    fi

    {
        emit TEST_PG_URL "postgres://postgres:postgres@127.0.0.1:$pg_port/postgres"
        emit TEST_AMQP_URL "amqp://guest:guest@127.0.0.1:$amqp_port/%2f"
        emit OUTBOX_IT_DIR "$dir"
        emit TEST_PG_CTL "$SELF pg"
        emit TEST_RABBITMQ_CTL "$SELF rabbitmq"
        # The servers' major version, and where the ctl subcommands find
        # its binaries.
        emit TEST_PG_MAJOR "$pg_major"
        emit OUTBOX_IT_PG_MAJOR "${OUTBOX_IT_PG_MAJOR:-}"
        if [[ -n $tls_dir ]]; then
            emit TEST_AMQPS_URL "amqps://guest:guest@127.0.0.1:$amqps_port/%2f"
        fi
    } >"$dir/env"
}

cmd_down() {
    local dir=${1:?usage: servers.sh down DIR}
    [[ -d $dir ]] || return 0
    dir=$(readlink -f "$dir")
    if [[ ! -e $dir/.outbox-it ]]; then
        [[ -z $(ls -A "$dir") ]] || die "$dir was not made by servers.sh up; not deleting it"
    fi
    cluster_teardown "$dir"
    pgha_teardown "$dir"
    if [[ -d $dir/pg ]]; then pg_stop "$dir"; fi
    rabbitmq_stop "$dir"
    epmd_stop "$dir/rabbitmq"
    kill_strays "$dir"
    release_ports "$dir"
    rm -rf "$dir"
}

# A last resort after the orderly stops: server processes still running
# from under DIR (a pid file lost, a stop that failed) are killed.
kill_strays() {
    local dir=$1 pid
    for pid in $(pgrep -f -- "$dir/" || true); do
        case $(cat "/proc/$pid/comm" 2>/dev/null) in
            beam.smp | postgres | pg_basebackup)
                log "killing stray process $pid: $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)"
                kill -9 "$pid" 2>/dev/null || true
                ;;
        esac
    done
}

# ---------------------------------------------------------------- with

WITH_DIR=""
WITH_CHILD=""
with_cleanup() {
    [[ -n $WITH_DIR ]] || return 0
    cmd_down "$WITH_DIR" || log "warning: could not clean up $WITH_DIR"
}

# On INT/TERM/HUP: stop CMD and everything it started (its process group),
# then exit, which tears the servers down through the EXIT trap.
with_signal() {
    if [[ -n $WITH_CHILD ]]; then
        kill -TERM -- "-$WITH_CHILD" 2>/dev/null || true
        wait "$WITH_CHILD" 2>/dev/null || true
    fi
    exit "$1"
}

cmd_with() {
    (($#)) || die "usage: servers.sh with CMD [ARGS...]"
    # Servers provided by the caller (e.g. a developer's own): just run.
    if [[ -n ${TEST_PG_URL:-} && -n ${TEST_AMQP_URL:-} ]]; then
        exec "$@"
    fi
    cmd_install
    WITH_DIR=$(mktemp -d "${OUTBOX_IT_TMP:-/tmp}/outbox-it.XXXXXX")
    trap with_cleanup EXIT
    trap 'with_signal 130' INT
    trap 'with_signal 143' TERM
    trap 'with_signal 129' HUP
    local started=$SECONDS
    cmd_up "$WITH_DIR"
    log "servers up in $((SECONDS - started))s ($WITH_DIR, PostgreSQL $(sed -n 's/^export TEST_PG_MAJOR=//p' "$WITH_DIR/env"))"
    # shellcheck disable=SC1091
    source "$WITH_DIR/env"

    # CMD runs as a job of its own: bash runs a trap only once the
    # foreground command has finished, but interrupts `wait` at once, so a
    # TERM (e.g. from `timeout`) tears down promptly. Job control (set -m)
    # gives the job its own process group, which with_signal kills whole
    # (cargo and the test binaries), and keeps bash from ignoring SIGINT in
    # it as it does for plain background commands. <&0 keeps stdin.
    set -m
    "$@" <&0 &
    WITH_CHILD=$!
    set +m
    local rc=0
    wait "$WITH_CHILD" || rc=$?
    WITH_CHILD=""
    if ((rc != 0)); then
        log "'$*' exited $rc; last lines of the server logs:"
        tail -n 20 "$WITH_DIR/pg.log" "$WITH_DIR/rabbitmq/log/rabbit.log" \
            "$WITH_DIR"/cluster/node*/rabbitmq/log/rabbit.log "$WITH_DIR"/pgha-*/*/pg.log \
            >&2 2>/dev/null || true
    fi
    exit "$rc"
}

# ---------------------------------------------------------------- cluster, pgha

# shellcheck source=integration/cluster.sh
source "${SELF%/*}/cluster.sh"
# shellcheck source=integration/pgha.sh
source "${SELF%/*}/pgha.sh"

# ---------------------------------------------------------------- main

main() {
    local cmd=${1:-}
    shift || true
    case $cmd in
        install) cmd_install ;;
        up) cmd_up "$@" ;;
        down) cmd_down "$@" ;;
        with) cmd_with "$@" ;;
        pg) cmd_pg "$@" ;;
        rabbitmq) cmd_rabbitmq "$@" ;;
        cluster) cmd_cluster "$@" ;;
        pgha) cmd_pgha "$@" ;;
        *)
            sed -n '2,/^set -euo/p' "$SELF" | sed '$d' | sed 's/^# \{0,1\}//' >&2
            exit 2
            ;;
    esac
}

main "$@"
