#!/usr/bin/env bash
# The container's build steps, as a script: deploy/Containerfile RUNs it, and
# tests/tests/deploy.rs runs the same steps on the host (CI has no container
# engine). Steps: scripts/setup.sh (LLVM 19, the SmolLM2 GGUF, ...), the release
# build of maxc and maxrun, then the artifact: compiled from
# manifests/smollm2-135m.toml into $MAXC_ARTIFACT_OUT unless MAXC_BAKE_ARTIFACT=0
# (the artifact is then mounted at run time; docs/serving.md, Several replicas).
#
# Environment:
#   MAXC_BAKE_ARTIFACT  1 (default): compile the artifact; 0: skip it
#   MAXC_ARTIFACT_OUT   where the artifact goes (default: out/model.mef)
#   MAXC_PROFILE        release (default) or debug: the test uses debug, the
#                       binaries it already has, so nothing LLVM-heavy is rebuilt
#   MAXC_SKIP_SETUP     1: skip scripts/setup.sh (a host that already ran it)
#   MAXC_SKIP_BUILD     1: skip cargo build (binaries already built, as in the
#                       test, which runs inside cargo test)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
profile="${MAXC_PROFILE:-release}"
out="${MAXC_ARTIFACT_OUT:-out/model.mef}"

if [ "${MAXC_SKIP_SETUP:-0}" != 1 ]; then
  scripts/setup.sh
fi
export LLVM_SYS_191_PREFIX="${LLVM_SYS_191_PREFIX:-/usr/lib/llvm-19}"
if [ "${MAXC_SKIP_BUILD:-0}" = 1 ]; then
  :
elif [ "$profile" = release ]; then
  cargo build --release --locked -p maxc -p maxrun
else
  cargo build --locked -p maxc -p maxrun
fi
bindir="${CARGO_TARGET_DIR:-target}/$profile"
if [ "${MAXC_BAKE_ARTIFACT:-1}" = 1 ]; then
  mkdir -p "$(dirname "$out")"
  "$bindir/maxc" compile manifests/smollm2-135m.toml -o "$out"
  "$bindir/maxrun" inspect "$out" > /dev/null
fi
echo "build-steps: done ($bindir/maxrun; artifact: $([ "${MAXC_BAKE_ARTIFACT:-1}" = 1 ] && echo "$out" || echo mounted at run time))" >&2
