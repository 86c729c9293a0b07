#!/usr/bin/env bash
# Remakes the converter-made GGUF files of the arch-* fixtures (make.py says what
# and why): llama.cpp from scripts/build-llama-cpp.sh, and a virtual environment
# with the converter's Python needs (torch for its tensors, transformers for the
# tokenizer, sentencepiece), from pip's configured index. Not part of setup: the
# files are committed, and the tests need none of this.
#   tests/golden/gguf/make.sh [ARCH ...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
cd "$root"
scripts/build-llama-cpp.sh >/dev/null
venv="$root/.cache/python-convert"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet "torch==2.5.1" "transformers==5.24.0" "sentencepiece==0.2.3" "safetensors==0.8.0" "numpy==2.4.6" "protobuf==7.36.2"
fi
"$venv/bin/python" tests/golden/gguf/make.py "$@"
