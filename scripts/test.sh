#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh
export LLVM_SYS_191_PREFIX=/usr/lib/llvm-19
cargo build --workspace --bins -j2
cargo test --workspace -j2 "$@"
