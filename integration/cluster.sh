# shellcheck shell=bash
# A three-node RabbitMQ cluster on loopback, for the failover tests: sourced
# by servers.sh (whose header lists the `cluster` commands), never run alone.
#
# `servers.sh cluster up` makes it on demand under $OUTBOX_IT_DIR/cluster:
#   env             TEST_CLUSTER_AMQP_URLS   the nodes' AMQP URLs, 1,2,3 in
#                                            order, comma-separated
#                   TEST_CLUSTER_AMQP_URL_1 .. TEST_CLUSTER_AMQP_URL_3
#                   TEST_CLUSTER_NODES       the Erlang node names, 1,2,3 in
#                                            order (as rabbitmqctl prints them)
#                   TEST_CLUSTER_CTL         "<servers.sh> cluster"
#   epmd.pid        the private epmd all three nodes register with
#   nodeN/rabbitmq  node N, laid out like the single node (rabbitmq_init),
#                   with a name of its own and the Erlang cookie of node 1
# Nodes 2 and 3 join node 1 with rabbitmqctl join_cluster. Nothing is
# declared: tests declare their own exchanges and (quorum) queues; a quorum
# queue gets a member on each of the three nodes.
#
# The commands that change the cluster hold $OUTBOX_IT_DIR/cluster.lock, so
# that tests running side by side may all call `cluster up` first (the first
# one makes the cluster, the others find it up). `up` also heals: nodes that
# a previous test left stopped are started again.

# Node N's setting VAR (from its rabbitmq.env).
cluster_var() (
    # shellcheck disable=SC1090
    source "$1/node$2/rabbitmq/rabbitmq.env"
    printf '%s\n' "${!3}"
)

# rabbitmqctl ARGS on node N.
cluster_ctl() (
    local c=$1 n=$2
    shift 2
    # shellcheck disable=SC1090
    source "$c/node$n/rabbitmq/rabbitmq.env"
    rmqctl "$@"
)

# The same, its output in C/ctl.log (shown if it fails).
cluster_ctl_logged() {
    local c=$1
    if ! cluster_ctl "$@" >>"$c/ctl.log" 2>&1; then
        tail -n 20 "$c/ctl.log" >&2
        die "rabbitmqctl ${*:3} failed on cluster node $2"
    fi
}

# rabbitmqctl CMD on nodes N... at the same time.
cluster_parallel() {
    local c=$1 cmd=$2 n pids=()
    shift 2
    for n in "$@"; do
        cluster_ctl_logged "$c" "$n" "$cmd" &
        pids+=("$!")
    done
    wait_all "${pids[@]}" || die "rabbitmqctl $cmd failed on cluster node(s) $*"
}

# Wait for the background jobs PID...; fail if one of them failed.
wait_all() {
    local pid rc=0
    for pid in "$@"; do wait "$pid" || rc=1; done
    return "$rc"
}

cluster_vm_alive() { pid_alive "$1/node$2/rabbitmq/server.pid"; }

cluster_app_running() {
    cluster_vm_alive "$1" "$2" &&
        [[ $(cluster_ctl "$1" "$2" eval 'rabbit:is_running().' 2>/dev/null) == true ]]
}

# The nodes that node N sees running, space-separated (none if it is down).
cluster_running() {
    cluster_ctl "$1" "$2" cluster_status --formatter json 2>/dev/null |
        python3 -c 'import json, sys; print(*json.load(sys.stdin)["running_nodes"])' 2>/dev/null ||
        true
}

# Wait until node N runs and sees every node whose app runs, i.e. it has
# (re)joined the cluster.
cluster_wait_joined() {
    local c=$1 n=$2 deadline=$((SECONDS + START_TIMEOUT)) running m ok
    while :; do
        running=" $(cluster_running "$c" "$n") "
        ok=0
        if [[ $running == *" $(cluster_var "$c" "$n" RABBITMQ_NODENAME) "* ]]; then
            ok=1
            for m in 1 2 3; do
                [[ $running != *" $(cluster_var "$c" "$m" RABBITMQ_NODENAME) "* ]] || continue
                if cluster_app_running "$c" "$m"; then ok=0; fi
            done
        fi
        ((ok == 0)) || return 0
        ((SECONDS < deadline)) || die "cluster node $n did not join the others (it sees:$running)"
        sleep 0.5
    done
}

# Start nodes N... in parallel, return once their RabbitMQ apps run. In
# parallel, because a node that was stopped before others waits at boot for
# the one that was stopped last to be back (mnesia's tables): starting them
# one by one in the wrong order would hang.
#
# Every server started here must close fd 9 (cmd_cluster's lock): it would
# otherwise hold the lock for as long as it runs.
cluster_boot() {
    local c=$1 n pid pids=() failed=()
    shift
    (
        # shellcheck disable=SC1091
        source "$c/node1/rabbitmq/rabbitmq.env"
        epmd_start "$c" "$ERL_EPMD_PORT"
    ) 9>&-
    for n in "$@"; do
        rabbitmq_start "$c/node$n" 9>&- &
        pids+=("$!:$n")
    done
    for pid in "${pids[@]}"; do
        wait "${pid%:*}" || failed+=("${pid#*:}")
    done
    ((${#failed[@]} == 0)) || die "cluster node(s) ${failed[*]} did not start"
}

# Start nodes N... and wait until they have joined the cluster (seen from
# one of them: the others see the same).
cluster_start() {
    cluster_boot "$@"
    cluster_wait_joined "$1" "$2"
}

# Stop nodes N... one after the other (so that the last one named is the
# last one stopped).
cluster_stop() {
    local c=$1 n
    shift
    for n in "$@"; do rabbitmq_stop "$c/node$n"; done
}

cluster_create() {
    local c=$1 n ports
    mkdir -p "$c"
    # epmd, then an AMQP and a distribution port per node.
    ports=$(pick_ports "$c" 7)
    read -r -a ports <<<"$ports"
    for n in 1 2 3; do
        mkdir -p "$c/node$n"
        rabbitmq_init "$c/node$n" "${ports[2 * n - 1]}" "${ports[2 * n]}" "${ports[0]}" \
            "outbox-it-$$-$n@localhost" "$c"
        ((n == 1)) || cp "$c/node1/rabbitmq/home/.erlang.cookie" "$c/node$n/rabbitmq/home/"
    done
    cluster_boot "$c" 1 2 3
    # Nodes 2 and 3 join node 1, one at a time (both change its schema).
    local first
    first=$(cluster_var "$c" 1 RABBITMQ_NODENAME)
    cluster_parallel "$c" stop_app 2 3
    for n in 2 3; do cluster_ctl_logged "$c" "$n" join_cluster "$first"; done
    cluster_parallel "$c" start_app 2 3
    cluster_wait_joined "$c" 1

    local urls=() names=()
    for n in 1 2 3; do
        urls+=("amqp://guest:guest@127.0.0.1:$(cluster_var "$c" "$n" RABBITMQ_NODE_PORT)/%2f")
        names+=("$(cluster_var "$c" "$n" RABBITMQ_NODENAME)")
    done
    {
        emit TEST_CLUSTER_AMQP_URLS "$(IFS=,; echo "${urls[*]}")"
        for n in 1 2 3; do emit "TEST_CLUSTER_AMQP_URL_$n" "${urls[n - 1]}"; done
        emit TEST_CLUSTER_NODES "$(IFS=,; echo "${names[*]}")"
        emit TEST_CLUSTER_CTL "$SELF cluster"
    } >"$c/env.tmp"
    mv "$c/env.tmp" "$c/env"
}

# Stop every node and delete the cluster (a no-op without one).
cluster_down() {
    local c=$1 n pids=()
    [[ -d $c ]] || return 0
    for n in 1 2 3; do
        rabbitmq_stop "$c/node$n" &
        pids+=("$!")
    done
    wait "${pids[@]}" || true
    epmd_stop "$c"
    release_ports "$c"
    rm -rf "$c"
}

# For `servers.sh down`: once no cluster command is at work (an `up` being
# interrupted undoes itself first), stop and delete DIR's cluster.
cluster_teardown() {
    local dir=$1
    [[ -d $dir/cluster ]] || return 0
    (
        flock -w 60 9 || log "warning: a cluster command still holds $dir/cluster.lock"
        cluster_down "$dir/cluster"
    ) 9>>"$dir/cluster.lock"
}

CLUSTER_ABORT=""
cluster_abort() {
    [[ -z $CLUSTER_ABORT ]] || cluster_down "$CLUSTER_ABORT"
}

cluster_up() {
    local c=$1 n started=$SECONDS
    if [[ -f $c/env ]]; then
        # One CLI call when all is well (tests call `up` first, every time).
        [[ $(wc -w <<<"$(cluster_running "$c" 1)") != 3 ]] || return 0
        local stopped=()
        for n in 1 2 3; do
            cluster_app_running "$c" "$n" || stopped+=("$n")
        done
        ((${#stopped[@]})) || return 0
        log "cluster: starting node(s) ${stopped[*]} again"
        cluster_start "$c" "${stopped[@]}"
        return 0
    fi
    # A cluster whose `up` was killed half-way: start afresh.
    cluster_down "$c"
    CLUSTER_ABORT=$c
    trap cluster_abort EXIT
    cluster_create "$c"
    trap - EXIT
    CLUSTER_ABORT=""
    log "cluster up in $((SECONDS - started))s ($c)"
}

cluster_status() {
    local c=$1 n state rc=0 shown=""
    for n in 1 2 3; do
        if ! cluster_vm_alive "$c" "$n"; then
            state=stopped rc=1
        elif cluster_app_running "$c" "$n"; then
            state=running
            [[ -n $shown ]] || shown=$n
        else
            state="app stopped" rc=1
        fi
        printf 'node %s  %-11s  %s  amqp 127.0.0.1:%s\n' "$n" "$state" \
            "$(cluster_var "$c" "$n" RABBITMQ_NODENAME)" "$(cluster_var "$c" "$n" RABBITMQ_NODE_PORT)"
    done
    if [[ -n $shown ]]; then cluster_ctl "$c" "$shown" cluster_status || true; fi
    return "$rc"
}

cmd_cluster() {
    local dir=${OUTBOX_IT_DIR:?OUTBOX_IT_DIR is not set (source DIR/env first)}
    local c=$dir/cluster sub=${1:-} n
    shift || true
    local usage="usage: servers.sh cluster up|down|restart|status | stop|start|stop_app|start_app N... | ctl N ARGS..."
    case $sub in
        stop | start | stop_app | start_app | ctl)
            (($#)) || die "$usage"
            for n in "$@"; do
                [[ $n == [123] ]] || die "$usage"
                [[ $sub != ctl ]] || break
            done
            ;;
        up | down | restart | status) (($# == 0)) || die "$usage" ;;
        *) die "$usage" ;;
    esac
    [[ $sub == up || $sub == down || -f $c/env ]] || die "no cluster under $dir (servers.sh cluster up)"
    case $sub in
        ctl)
            shift
            cluster_ctl "$c" "$n" "$@"
            return
            ;;
        status)
            cluster_status "$c"
            return
            ;;
    esac

    exec 9>>"$dir/cluster.lock"
    flock -w 600 9 || die "timed out waiting for $dir/cluster.lock"
    case $sub in
        up) cluster_up "$c" ;;
        down) cluster_down "$c" ;;
        stop) cluster_stop "$c" "$@" ;;
        start) cluster_start "$c" "$@" ;;
        stop_app) cluster_parallel "$c" stop_app "$@" ;;
        start_app)
            cluster_parallel "$c" start_app "$@"
            cluster_wait_joined "$c" "$1"
            ;;
        # Node 1 stops last, so that it could also start alone.
        restart)
            local pids=()
            for n in 2 3; do
                rabbitmq_stop "$c/node$n" &
                pids+=("$!")
            done
            wait_all "${pids[@]}"
            cluster_stop "$c" 1
            cluster_start "$c" 1 2 3
            ;;
    esac
}
