#!/usr/bin/env python3
"""Builds the seed corpora of the fuzz targets (docs/fuzzing.md).

artifact_reader: the start of a real artifact (raw mode, first byte 0) and its
header body (header mode, first byte 1). gguf_reader / safetensors_reader: small
but complete files in the layouts the real readers see.
Usage: fuzz/make_seeds.py REAL.mef   (run from the repository root)
"""
import json
import os
import struct
import sys

root = "fuzz/corpus"


def put(target, name, data):
    os.makedirs(f"{root}/{target}", exist_ok=True)
    with open(f"{root}/{target}/{name}", "wb") as f:
        f.write(data)


mef = open(sys.argv[1], "rb").read()
header_len = struct.unpack_from("<Q", mef, 16)[0]
put("artifact_reader", "raw-start", b"\x00" + mef[:65536])
put("artifact_reader", "header-body", b"\x01" + mef[32:32 + header_len])


def gguf_string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf(tensors, kv):
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
    for key, (ty, payload) in kv.items():
        out += gguf_string(key) + struct.pack("<I", ty) + payload
    offset = 0
    blobs = []
    for name, dims, ty, data in tensors:
        out += gguf_string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ty, offset)
        blobs.append(data)
        offset += (len(data) + 31) // 32 * 32
    out += b"\x00" * (-len(out) % 32)
    for data in blobs:
        out += data + b"\x00" * (-len(data) % 32)
    return out


tokens = [b"a", b"b", b"ab"]
kv = {
    "general.architecture": (8, gguf_string("llama")),
    "llama.block_count": (4, struct.pack("<I", 1)),
    "llama.rope.freq_base": (6, struct.pack("<f", 10000.0)),
    "tokenizer.ggml.tokens": (9, struct.pack("<IQ", 8, len(tokens)) + b"".join(gguf_string(t.decode()) for t in tokens)),
}
q8 = struct.pack("<e", 0.5) + bytes(range(32))
put("gguf_reader", "small", gguf([("token_embd.weight", [32, 1], 8, q8), ("output_norm.weight", [4], 0, struct.pack("<4f", 1, 2, 3, 4))], kv))

header = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}, "b": {"dtype": "BF16", "shape": [2], "data_offsets": [16, 20]}}
h = json.dumps(header).encode()
put("safetensors_reader", "small", struct.pack("<Q", len(h)) + h + bytes(20))
