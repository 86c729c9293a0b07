#!/usr/bin/env bash
# What one command of the device tool runs on the GPU machine (docs/gpu.md), within
# a time budget, leaving one archive in $OUT (the tool brings back at most 8 files):
#
#   scripts/gpu-remote.sh check SECONDS [FIXTURES]
#       unpacks the carried parts, starts llama.cpp's CUDA build in the background
#       (for a `bench` command that follows while the machine is held), runs the GPU
#       check of FIXTURES (default: those that arrived) and compute-sanitizer's
#       memcheck and racecheck; $OUT/check.tar.xz holds report.json, report.md, the
#       row lines and the sanitizer logs.
#   scripts/gpu-remote.sh bench SECONDS
#       the benchmark (scripts/gpu-check.sh bench, the 1.17B shape first);
#       $OUT/bench.tar.xz holds its JSON, logs and bench.md.
#   scripts/gpu-remote.sh profile SECONDS
#       Nsight Compute's per-kernel times of the 1.17B shape's decode at bf16 and
#       q4_k (the artifacts bench compiled; CUDA graphs off, so each launch is a
#       kernel of its own); $OUT/profile.tar.xz holds the summaries.
#   scripts/gpu-remote.sh all SECONDS
#       check (the small fixtures), bench and profile in one command, each stopped
#       at its share of SECONDS: the whole GPU session in one device call
#       (BENCH_PEERS=0: without llama.cpp and PyTorch, see gpu-check.sh bench).
#
# Each step gets a share of SECONDS and is stopped at its end, so the archive is
# always written before the command's own limit.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
: "${OUT:?run by the device tool, which sets OUT}"
report=/tmp/gpu-remote/report
mkdir -p "$report"
export GPU_CHECK_OUT="$report"
budget="${2:?give the seconds this command may take}"
deadline=$((SECONDS + budget))
# Seconds left before the deadline, less a reserve for packing the results.
left() { local l=$((deadline - SECONDS - ${1:-20})); [ "$l" -gt 1 ] && echo "$l" || echo 1; }

case "${1:-}" in
check)
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader || true
    scripts/gpu-check.sh unpack
    if [ "${BENCH_PEERS:-1}" = 1 ] && [ -d .gpu-check/root/llama.cpp ] && [ ! -f .gpu-check/root/llama.cpp/build/.done ]; then
        # In a session of its own, so it outlives this command while the machine is held.
        setsid nohup nice -n 10 scripts/gpu-check.sh bench-build > /tmp/gpu-remote/llama-build.log 2>&1 < /dev/null &
    fi
    present=()
    for f in tiny-llama tiny-qwen2 arch-qwen3 arch-gemma2 arch-phi3 arch-granite arch-olmo2 arch-gpt2 smollm2-135m all-minilm-l6-v2; do
        case "$f" in
        smollm2-135m) [ -f .gpu-check/root/SmolLM2-135M-Instruct.Q4_1.gguf ] && present+=("$f") ;;
        all-minilm-l6-v2) [ -f .gpu-check/root/all-minilm-l6-v2/model.safetensors ] && present+=("$f") ;;
        *) [ -f ".gpu-check/root/fixtures/$f/golden.json" ] && present+=("$f") ;;
        esac
    done
    fixtures="${3:-$(IFS=,; echo "${present[*]}")}"
    echo "fixtures: $fixtures"
    # Two thirds of the time to the check, the rest to the sanitizer.
    check_s=$(( $(left 40) * 2 / 3 ))
    timeout "$check_s" scripts/gpu-check.sh --device gpu --only "$fixtures" > "$report/check.log" 2>&1
    echo "gpu-check: exit $? after $SECONDS s"
    grep -E '^\|' "$report/check.log" | head -150 || true
    grep -vE '^\|' "$report/check.log" | grep -iE 'error|fail|panic' | head -20 || true
    # Each tool gets its share, so a slow memcheck leaves racecheck its time.
    SANITIZE_TOOLS=memcheck timeout "$(( $(left 25) / 2 ))" scripts/gpu-check.sh sanitize
    echo "memcheck: exit $? after $SECONDS s"
    SANITIZE_TOOLS=racecheck timeout "$(left 25)" scripts/gpu-check.sh sanitize
    echo "racecheck: exit $? after $SECONDS s"
    for t in memcheck racecheck; do
        [ -f "$report/sanitize-$t.log" ] && grep -E '=========' "$report/sanitize-$t.log" | head -15
    done
    cp /tmp/gpu-remote/llama-build.log "$report/" 2>/dev/null || true
    tar -cJf "$OUT/check.tar.xz" -C "$report" --exclude artifacts --exclude sanitize .
    ;;
bench)
    scripts/gpu-check.sh unpack > /dev/null
    BENCH_SHAPES="${BENCH_SHAPES:-llama-1.17b smollm2-135m}" timeout "$(left 30)" scripts/gpu-check.sh bench
    status=$?
    echo "bench: exit $status after $SECONDS s"
    # A finished bench printed its table; a stopped one gets the table of what it measured.
    [ "$status" = 124 ] && scripts/gpu-check.sh bench-table
    cp /tmp/gpu-remote/llama-build.log "$report/bench/" 2>/dev/null || true
    tar -cJf "$OUT/bench.tar.xz" -C "$report" bench
    ;;
profile)
    work=.gpu-check/bench
    mkdir -p "$report/profile"
    for enc in ${PROFILE_ENCODINGS:-bf16 q4_k}; do
        mef="$work/llama-1.17b-$enc.mef"
        [ -f "$mef" ] || { echo "no $mef: run bench first"; continue; }
        # A short prompt and 8 tokens: decode's kernels dominate the summary.
        # At least a second: `timeout 0` would not limit the run at all.
        share=$(( $(left 15) / 2 )); [ "$share" -ge 1 ] || share=1
        MAXRUN_CUDA_GRAPHS=0 timeout "$share" ncu --metrics gpu__time_duration.sum --print-summary per-kernel \
            .gpu-check/root/bin/maxrun "$mef" --device gpu --prompt "The capital of France is" -n 8 \
            > "$report/profile/llama-1.17b-$enc.txt" 2>&1
        echo "ncu $enc: exit $? after $SECONDS s"
    done
    tar -cJf "$OUT/profile.tar.xz" -C "$report" profile
    ;;
all)
    # Shares: the check (with its sanitizer runs) ALL_CHECK% (default 36), the
    # benchmark ALL_BENCH% (default 52), the profile the rest. With BENCH_PEERS=0
    # the benchmark times maxrun alone (scripts/gpu-check.sh bench).
    "$0" check "$(( budget * ${ALL_CHECK:-36} / 100 ))"
    "$0" bench "$(( budget * ${ALL_BENCH:-52} / 100 ))"
    "$0" profile "$(left 5)"
    ;;
*)
    sed -n '2,22p' "$0" >&2
    exit 2
    ;;
esac
