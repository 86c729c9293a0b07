#!/usr/bin/env bash
# The replica benchmark (docs/serving.md, "Several replicas"): chat sessions
# as an application sends them (tests/serve/client.py, scenario_sessions: 24
# sessions of 6 turns sharing a system prompt, each turn resending the
# conversation, 6 at a time, 24-token greedy replies) against one maxrun serve
# (the ideal: its KV pool holds all of it), then against three replicas behind
# sglang-router with each policy; prints the prompt tokens found in the prefix
# caches (summed over the replicas' /metrics) and the time to first token.
#   scripts/bench-routers.sh [ARTIFACT.mef]   (default: out/smollm2-135m.mef)
# Env: POLICIES ("cache_aware round_robin"), THREADS (threads per replica, 1),
#      SESSIONS (24), TURNS (6), OUT (a folder for the logs).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh >/dev/null 2>&1
mef="${1:-out/smollm2-135m.mef}"
out="${OUT:-target/bench-routers}"
mkdir -p "$out"
source scripts/servers.sh
model="$(basename "$mef")"
expected="$out/expected.json"

hits() {  # URLs... -> "found queried"
    for u in "$@"; do curl -s "$u/metrics"; done | awk '/^maxrun_prefix_cache_hit_tokens /{f+=$2} /^maxrun_prefix_cache_queried_tokens /{q+=$2} END{print f+0, q+0}'
}

run_sessions() {  # URL -> the scenario's JSON report
    PYTHONPATH=.cache/python NO_PROXY=127.0.0.1,localhost timeout 1800 python3 tests/serve/client.py sessions "$1" "$expected"
}

printf '| setup | prompt tokens from the caches | of the ideal | TTFT p50 ms | TTFT p99 ms |\n|---|---:|---:|---:|---:|\n'
start "$out/one.log" 8201 target/release/maxrun serve "$mef" --host 127.0.0.1 --port 8201 --threads 2
# The id maxrun serve lists: asked of the replica.
served="$(curl -s http://127.0.0.1:8201/v1/models | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')"
echo "{\"model\": \"$served\", \"sessions\": ${SESSIONS:-24}, \"turns\": ${TURNS:-6}, \"concurrency\": 6, \"reply_tokens\": 24}" > "$expected"
report="$(run_sessions http://127.0.0.1:8201)"
read -r ideal queried <<<"$(hits http://127.0.0.1:8201)"
stop_last
python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print(f"| one replica ({sys.argv[4]}) | {sys.argv[2]} of {sys.argv[3]} | 100% | {r[\"ttft_p50_ms\"]} | {r[\"ttft_p99_ms\"]} |")' "$report" "$ideal" "$queried" "$model"
for policy in ${POLICIES:-cache_aware round_robin}; do
    urls=()
    for port in 8211 8212 8213; do
        start "$out/$policy-$port.log" "$port" target/release/maxrun serve "$mef" --host 127.0.0.1 --port "$port" --threads "${THREADS:-1}"
        urls+=("http://127.0.0.1:$port")
    done
    PYTHONPATH=.cache/sglang-router python3 -m sglang_router.launch_router --host 127.0.0.1 --port 8210 --prometheus-port 8219 \
        --policy "$policy" --worker-urls "${urls[@]}" >"$out/$policy-router.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 600); do curl -sf http://127.0.0.1:8210/v1/models >/dev/null 2>&1 && break; sleep 0.1; done
    report="$(run_sessions http://127.0.0.1:8210)"
    read -r found asked <<<"$(hits "${urls[@]}")"
    for _ in 0 1 2 3; do stop_last; done
    python3 -c 'import json,sys; r=json.loads(sys.argv[1]); f,i=float(sys.argv[2]),float(sys.argv[4]); print(f"| sglang-router {sys.argv[5]} | {sys.argv[2]} of {sys.argv[3]} | {100*f/i:.1f}% | {r[\"ttft_p50_ms\"]} | {r[\"ttft_p99_ms\"]} |")' "$report" "$found" "$asked" "$ideal" "$policy"
done
