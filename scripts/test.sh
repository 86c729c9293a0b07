#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh
export LLVM_SYS_191_PREFIX=/usr/lib/llvm-19
# Tests write compiled artifacts (up to ~0.5 GB each) to temporary directories:
# keep them in one scratch folder that is emptied before and after the run.
export TMPDIR="$root/target/test-tmp"
rm -rf "$TMPDIR"
mkdir -p "$TMPDIR"
trap 'rm -rf "$TMPDIR"' EXIT
cargo build --workspace --bins -j2
# The runtime for 64-bit ARM, which tests/tests/aarch64.rs runs under qemu-aarch64
# (docs/aarch64.md): the maxrun binary alone, release (what would ship), linked by
# the cross gcc that .cargo/config.toml names.
cargo build --release --target aarch64-unknown-linux-gnu -p maxrun --bin maxrun -j2
cargo test --workspace -j2 "$@"
# The runtime without the `cuda` feature (what a CPU-only deployment builds): its
# own unit tests, e.g. the message a GPU mesh gets there; and the maxrun command
# line without CUDA and without the server (a minimal embedded build) compiles.
if [ "$#" -eq 0 ]; then
    cargo test -p maxrun-runtime --no-default-features --lib -j2
    cargo check -p maxrun --no-default-features --bins -j2
    # The GPU check's dry run (docs/gpu.md): every fixture at every encoding,
    # fat artifacts run on the CPU against the goldens, GPU-only ones compiled
    # and assembled by ptxas.
    GPU_CHECK_BIN="$root/target/debug" GPU_CHECK_OUT="$TMPDIR/gpu-check" scripts/gpu-check.sh --device cpu
fi
