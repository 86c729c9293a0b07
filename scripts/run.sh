#!/usr/bin/env bash
# Sets up and runs the default model, SmolLM2-135M-Instruct, on a prompt.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh
export LLVM_SYS_191_PREFIX=/usr/lib/llvm-19
cargo build --release -j2 --bins
prompt="${1:-Once upon a time, there was a little robot}"
target/release/maxc eval manifests/smollm2-135m.toml --prompt "$prompt" -n "${2:-48}"
