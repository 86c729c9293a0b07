#!/usr/bin/env bash
# Remakes the converter-made GGUF files of the arch-* fixtures (make.py says what
# and why): llama.cpp from scripts/build-llama-cpp.sh, and a virtual environment
# with the converter's Python needs (torch for its tensors, transformers for the
# tokenizer, sentencepiece), from pip's configured index. Not part of setup: the
# files are committed, and the tests need none of this.
#   tests/golden/gguf/make.sh [ARCH ...]
# The mixture-of-experts files need only the converter (no llama.cpp build);
# with qwen3-moe its GGUF-shaped fixture (tests/fixtures/arch-qwen3-moe-gguf)
# is made first, by transformers in a second environment (its models need a
# newer torch than the converter's pin: the shared fixtures' versions).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
cd "$root"
moe_only=1
for arch in "${@:-all}"; do
    case "$arch" in qwen3-moe | mixtral | gpt-oss | gpt-oss-mxfp4 | olmoe | qwen2-moe) ;; *) moe_only=0 ;; esac
done
if [ "$moe_only" = 1 ]; then
    scripts/build-llama-cpp.sh --source >/dev/null
else
    scripts/build-llama-cpp.sh >/dev/null
fi
venv="$root/.cache/python-convert"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet "torch==2.5.1" "transformers==5.24.0" "sentencepiece==0.2.3" "safetensors==0.8.0" "numpy==2.4.6" "protobuf==7.36.2"
fi
case " ${*:-all} " in
    *" qwen3-moe "* | " all ")
        fixtures="$root/.cache/python-fixtures"
        if [ ! -x "$fixtures/bin/python" ]; then
            python3 -m venv "$fixtures"
            "$fixtures/bin/pip" install --quiet "torch==2.15.0" "transformers==5.23.0" "numpy==2.4.6"
        fi
        "$fixtures/bin/python" tests/fixtures/arch-qwen3-moe-gguf/make.py
        ;;
esac
"$venv/bin/python" tests/golden/gguf/make.py "$@"
