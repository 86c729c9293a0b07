#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, llama-server, llama-quantize,
# llama-perplexity, llama-lookup and llama-speculative (its prompt-lookup and
# draft-model speculative decoding, docs/performance.md) from the source bundled in the PyPI sdist of llama-cpp-python
# (the peer we benchmark against, docs/performance.md, and whose perplexity
# `maxrun perplexity` reproduces, docs/quantization.md). CPU only, native ISA,
# AMX off (it is advertised on some VMs but faults): both ggml's AMX backend and
# the AMX instructions that -march=native would let the compiler enable (an
# Intel VM that advertises AMX otherwise builds the AMX backend anyway and dies
# in `tileloadd`).
#   scripts/build-llama-cpp.sh            -> .cache/llama.cpp/build/bin/llama-bench (and llama-server, llama-quantize, llama-perplexity, llama-lookup, llama-speculative)
#   scripts/build-llama-cpp.sh --avx2     -> .cache/llama.cpp/build-avx2/bin/llama-bench (and the rest): AVX2 / FMA / F16C / BMI2
#                                            only, no AVX-512 or AVX-VNNI, the x86-64-v3 level that maxc's
#                                            `--target cpu:x86-64-v3` builds for (an AVX2-only CPU's llama.cpp, docs/performance.md)
#   scripts/build-llama-cpp.sh --source   -> .cache/llama.cpp/src only (the converter, for tests/golden/gguf/make.sh)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="$root/.cache/llama.cpp"
version=0.3.36
mkdir -p "$cache"
unpack() {
  if [ ! -d "$cache/src" ]; then
    tarball="$cache/llama_cpp_python-$version.tar.gz"
    if [ ! -f "$tarball" ]; then
      # The sdist through pip's own configured index (pip checks its hash);
      # only llama-cpp-python itself as source: its build requirements (fetched
      # to read the sdist's metadata) come as wheels.
      python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$cache"
    fi
    mkdir -p "$cache/src"
    tar -xzf "$cache"/llama_cpp_python-$version.tar.gz -C "$cache/src" --strip-components=3 "llama_cpp_python-$version/vendor/llama.cpp"
  fi
}
if [ "${1:-}" = "--source" ]; then
  unpack
  echo "$cache/src"
  exit 0
fi
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [ "${1:-}" = "--avx2" ]; then
  build="$cache/build-avx2"
  isa="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF"
  flags="avx2 fma f16c bmi2 $no_amx"
else
  build="$cache/build"
  isa="-DGGML_NATIVE=ON"
  flags="native $no_amx"
fi
# The flags the binaries were built with; a build with others is redone.
stamp="$build/maxc-build-flags"
binaries="llama-bench llama-quantize llama-server llama-perplexity llama-lookup llama-speculative"
missing=0
for b in $binaries; do
  [ -x "$build/bin/$b" ] || missing=1
done
if [ "$missing" = 1 ] || [ "$(cat "$stamp" 2>/dev/null)" != "$flags" ]; then
  command -v cmake >/dev/null || { apt-get update -qq && apt-get install -y -qq cmake >/dev/null; }
  unpack
  # shellcheck disable=SC2086 # $isa is a list of -D options
  cmake -S "$cache/src" -B "$build" -DCMAKE_BUILD_TYPE=Release $isa \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_OPENMP=ON \
    -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON >/dev/null
  # shellcheck disable=SC2086 # $binaries is a list of targets
  cmake --build "$build" --target $binaries -j2 >/dev/null
  echo "$flags" > "$stamp"
fi
echo "$build/bin/llama-bench"
