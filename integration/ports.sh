# shellcheck shell=bash
# Free ports for the private servers and waiting for them to listen:
# sourced by servers.sh (and used by cluster.sh, pgha.sh), never run alone.

# Print N free TCP ports and record them as taken by DIR.
#
# Ports come from below the kernel's ephemeral range, so that the many
# outgoing connections a test run makes can never be handed one of them as
# a local port (which matters when a test stops a server and starts it again
# on the same port). A registry of reservations, under an exclusive lock,
# keeps two harnesses that start at the same time from picking the same
# port before either server has bound it; a reservation dies with its DIR.
pick_ports() {
    python3 - "$PORT_REGISTRY" "$1" "$2" <<'EOF'
import fcntl, os, random, socket, sys

registry, owner, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.makedirs(registry, exist_ok=True)
with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
    ephemeral_low = int(f.read().split()[0])
low, high = 20000, ephemeral_low - 1
if high - low < 1000:
    low, high = 10000, 19999
# Default ports of the system PostgreSQL/RabbitMQ/epmd and RabbitMQ's CLI
# range: free now, but those services could be started later.
well_known = {4369, 5432, 5672, 15672, 25672} | set(range(35672, 35683))

def bindable(port):
    # 0.0.0.0 clashes with a listener on any IPv4 address, 127.0.0.1 included.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True

with open(os.path.join(registry, ".lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    candidates = [p for p in range(low, high + 1) if p not in well_known]
    random.shuffle(candidates)
    picked = []
    for port in candidates:
        if len(picked) == count:
            break
        entry = os.path.join(registry, str(port))
        try:
            with open(entry) as f:
                if os.path.isdir(f.read().strip()):
                    continue  # reserved by a harness that is still up
        except FileNotFoundError:
            pass
        if bindable(port):
            picked.append(port)
    if len(picked) < count:
        sys.exit("no free ports")
    for port in picked:
        with open(os.path.join(registry, str(port)), "w") as f:
            f.write(owner + "\n")
    print(*picked)
EOF
}

release_ports() {
    local dir=$1 entry
    [[ -d $PORT_REGISTRY ]] || return 0
    for entry in "$PORT_REGISTRY"/[0-9]*; do
        [[ -f $entry && $(cat "$entry" 2>/dev/null) == "$dir" ]] && rm -f "$entry"
    done
    return 0
}

# Wait until something accepts TCP connections on 127.0.0.1:PORT.
wait_for_port() {
    local port=$1 deadline=$((SECONDS + $2))
    until (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do
        ((SECONDS < deadline)) || return 1
        sleep 0.2
    done
}
