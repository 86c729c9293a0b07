# Sourced by the benchmark scripts that start servers on loopback
# (bench-serve.sh, bench-speculation.sh):
#   start LOG PORT COMMAND...   runs COMMAND in the background, its output in LOG,
#                               and waits (at most 120 s) for /health on PORT
#   stop_last                   stops the server started last
# Servers still running are stopped when the script exits.
pids=()
trap 'for p in "${pids[@]:-}"; do kill "$p" 2>/dev/null || true; done' EXIT

start() {
    local log=$1 port=$2; shift 2
    "$@" >"$log" 2>&1 &
    pids+=($!)
    for _ in $(seq 1200); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    echo "$(basename "$0"): the server on port $port did not start" >&2; cat "$log" >&2; exit 1
}

stop_last() {
    kill "${pids[-1]}"; wait "${pids[-1]}" 2>/dev/null || true; unset 'pids[-1]'
}
