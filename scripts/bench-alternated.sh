#!/usr/bin/env bash
# Decode (or prefill) of one maxc artifact against llama.cpp on the same GGUF,
# in alternated rounds seconds apart: on a shared VM the memory bandwidth moves
# by tens of percent from one minute to the next (43-65 GB/s within an hour on
# a Zen 5 VM), so two benchmarks run minutes apart compare two machines. Each
# round runs `maxrun bench -r 1` (which measures the read bandwidth just before
# its decode test) and `llama-bench -r 1` back to back, maxc first in odd
# rounds and llama.cpp first in even ones, and the ratio is taken per round.
# llama.cpp runs with and without its CPU weight repacking (`--repack 0,1`)
# and its faster figure counts, as in scripts/bench-scale.sh.
# Prints each round, then the median ratio and its spread, and both engines'
# decode against the round's roofline (maxc's weight and KV bytes per step at
# the bandwidth maxrun measured: llama.cpp's figure is exact where it streams
# the same bytes, as for the float encodings, whose tensors both keep as the
# file has them).
#   scripts/bench-alternated.sh [-k rounds] [-p 0] [-n 64] [-d 0] [-t 2] ARTIFACT.mef MODEL.gguf
# -p 0 (the default) runs decode only; -p N -n 0 prefill only.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
k=7 p=0 n=64 d=0 t=2
while getopts "k:p:n:d:t:" o; do
  case $o in k) k=$OPTARG;; p) p=$OPTARG;; n) n=$OPTARG;; d) d=$OPTARG;; t) t=$OPTARG;; *) exit 2;; esac
done
shift $((OPTIND - 1))
if [ $# -ne 2 ] || [ ! -f "$1" ] || [ ! -f "$2" ]; then
  echo "usage: scripts/bench-alternated.sh [-k rounds] [-p 0] [-n 64] [-d 0] [-t 2] ARTIFACT.mef MODEL.gguf (both files must exist)" >&2
  exit 2
fi
mef=$1 gguf=$2
if [ "$p" = 0 ] && [ "$n" = 0 ]; then
  echo "bench-alternated.sh: -p and -n are both 0: nothing to measure" >&2
  exit 2
fi
scripts/setup.sh >/dev/null
export LLVM_SYS_191_PREFIX=/usr/lib/llvm-19
cargo build --release --bins -q
bin="$(dirname "$(scripts/build-llama-cpp.sh)")"
results=$(mktemp)
trap 'rm -f "$results"' EXIT
ours() { target/release/maxrun bench "$mef" -p "$p" -n "$n" -r 1 -d "$d" --threads "$t" --json | tr -d '\n'; }
theirs() { "$bin/llama-bench" -m "$gguf" -t "$t" -p "$p" -n "$n" -r 1 -d "$d" --repack 0,1 -o json 2>/dev/null | tr -d '\n'; }
for round in $(seq 1 "$k"); do
  if [ $((round % 2)) = 1 ]; then
    o=$(ours); l=$(theirs)
  else
    l=$(theirs); o=$(ours)
  fi
  printf '%s\t%s\n' "$o" "$l" >>"$results"
done
python3 - "$results" "$p" "$n" "$d" <<'PY'
import json, statistics, sys
path, p, n, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
decode = n > 0
key = "decode_tokens_per_s" if decode else "prefill_tokens_per_s"
test = ("tg%d" % n if decode else "pp%d" % p) + (" @ d%d" % d if d else "")
rows = []
for line in open(path):
    ours, theirs = line.rstrip("\n").split("\t")
    j = json.loads(ours)
    l = [x for x in json.loads(theirs) if (x["n_gen"] > 0) == decode]
    rows.append((j, max(x["avg_ts"] for x in l)))
print("| round | maxc %s t/s | llama.cpp t/s | ratio | bandwidth GB/s | maxc %% of roofline | llama.cpp %% of roofline |" % test)
print("|---:|---:|---:|---:|---:|---:|---:|")
ratios = []
for i, (j, theirs) in enumerate(rows, 1):
    ratios.append(j[key] / theirs)
    if decode:
        roof = j["decode_roofline_tokens_per_s"]
        extra = "%.1f | %.0f%% | %.0f%%" % (j["read_bandwidth_gb_s"], 100 * j[key] / roof, 100 * theirs / roof)
    else:
        extra = "- | - | -"
    print("| %d | %.1f | %.1f | %.2fx | %s |" % (i, j[key], theirs, ratios[-1], extra))
print()
print("median ratio %.2fx (rounds %.2f-%.2fx, %d rounds)" % (statistics.median(ratios), min(ratios), max(ratios), len(ratios)))
if decode:
    ours = [100 * j[key] / j["decode_roofline_tokens_per_s"] for j, _ in rows]
    theirs = [100 * t / j["decode_roofline_tokens_per_s"] for j, t in rows]
    print("median of the roofline: maxc %.0f%%, llama.cpp %.0f%%" % (statistics.median(ours), statistics.median(theirs)))
PY
