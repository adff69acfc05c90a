# Sourced by the benchmark wrappers scripts/bench_replicas.sh and scripts/bench_smg.sh
# (after `cd` to the repository root): their argument parsing, the kvroute build and
# the run of the Python driver with a trap that ends every process it started.

# The load generator's client libraries (the drivers import them through scripts/benchlib.py).
BENCH_CLIENT_PACKAGES=("aiohttp>=3.9,<4" "uvloop>=0.19")

# bench_parse_args HELP_LAST "$@": sets JSON_OUT from --json FILE / --json=FILE (default:
# $OUT); -h/--help prints lines 2..HELP_LAST of the calling script (its header comment).
bench_parse_args() {
    local help_last=$1
    shift
    JSON_OUT=${OUT:-}
    while [ $# -gt 0 ]; do
        case "$1" in
            --json) JSON_OUT=$2; shift 2 ;;
            --json=*) JSON_OUT=${1#--json=}; shift ;;
            -h|--help) sed -n "2,${help_last}p" "$0"; exit 0 ;;
            *) echo "unknown argument: $1" >&2; exit 2 ;;
        esac
    done
}

# bench_kvroute DEFAULT PACKAGE...: sets KVROUTE, the gateway binary (also the mock
# engine). A KVROUTE given in the environment is used as it is (SKIP_BUILD=1); else
# DEFAULT, built first with `cargo build --release -p PACKAGE...` unless SKIP_BUILD=1.
bench_kvroute() {
    local default=$1
    shift
    if [ -n "${KVROUTE:-}" ]; then
        SKIP_BUILD=1
    else
        KVROUTE=$default
    fi
    if [ "${SKIP_BUILD:-0}" != 1 ]; then
        local packages=() p
        for p in "$@"; do packages+=(-p "$p"); done
        timeout 1800 cargo build --release "${packages[@]}" >&2
    fi
    [ -x "$KVROUTE" ] || { echo "no $KVROUTE: build it first" >&2; exit 1; }
}

# bench_run NAME PIDFILE_VAR SECONDS COMMAND...: runs the driver COMMAND under
# `timeout SECONDS` and waits for it (its exit status is this one's). The driver
# leads its own process group (setsid) and lists the process groups it starts
# (engines, gateways, nats-server) in the file named by $PIDFILE_VAR; on exit,
# whatever the cause, both are killed whole.
bench_run() {
    local name=$1 pidfile_var=$2 seconds=$3
    shift 3
    PY_PID=
    PIDFILE=$(mktemp -t "$name.pids.XXXXXX")
    export "$pidfile_var=$PIDFILE"
    trap bench_cleanup EXIT
    trap 'exit 130' INT TERM
    setsid timeout "$seconds" "$@" &
    PY_PID=$!
    wait "$PY_PID"
}

bench_cleanup() {
    if [ -n "$PY_PID" ] && kill -0 "$PY_PID" 2>/dev/null; then
        kill -TERM -- "-$PY_PID" 2>/dev/null || kill -TERM "$PY_PID" 2>/dev/null || true
        for _ in $(seq 1 50); do kill -0 "$PY_PID" 2>/dev/null || break; sleep 0.2; done
        kill -KILL -- "-$PY_PID" 2>/dev/null || true
    fi
    # The engines, gateways and nats-server lead their own process groups; end those the driver started.
    while read -r pid; do
        [ -n "$pid" ] && kill -KILL -- "-$pid" 2>/dev/null || true
    done < "$PIDFILE"
    rm -f "$PIDFILE"
}
