#!/usr/bin/env python3
"""Writes an F16 GGUF with the shapes of a real model and seeded random weights.

For benchmarks at sizes whose checkpoints this machine cannot download
(scripts/bench-scale.sh, docs/performance-log.md "At 1B-8B"): the architecture,
vocabulary size, attention heads (GQA ratio), FFN width, QKV biases and tied or
untied output head are the named model's; the weights are normal(0, 0.02) draws
(norm weights 1), so speed is the real model's and the text is nonsense. The
tokenizer is SmolLM2's (byte-level BPE, copied from the GGUF that setup fetches),
padded with normal tokens `<|synthetic_N|>` up to the model's vocabulary (real
vocabularies of that size are normal tokens and a few hundred special ones;
padding with user-defined tokens made every one an added token, and the
tokenizers library's matcher over 79K of them held 370 MB of the compile).
Tensors are written one at a time (the writer's streaming API), so an 8B file
needs no more memory than its largest tensor.

    synthetic_gguf.py SHAPE OUT.gguf --tokenizer-from SmolLM2.gguf
    synthetic_gguf.py --list
"""
import argparse
import sys

import numpy as np
import gguf

# name: (architecture, hidden, layers, heads, kv heads, ffn, vocab, tied head,
#        QKV biases, rope base, context). From each model's config.json.
SHAPES = {
    # The shape issue #33 measured first: Llama 3.2 1B with SmolLM2's
    # vocabulary and an untied head.
    "llama-1.17b": ("llama", 2048, 16, 32, 8, 8192, 49152, False, False, 500000.0, 8192),
    "llama-3.2-1b": ("llama", 2048, 16, 32, 8, 8192, 128256, True, False, 500000.0, 8192),
    "qwen2.5-1.5b": ("qwen2", 1536, 28, 12, 2, 8960, 151936, True, True, 1000000.0, 8192),
    "qwen2.5-3b": ("qwen2", 2048, 36, 16, 2, 11008, 151936, True, True, 1000000.0, 8192),
    "llama-3-8b": ("llama", 4096, 32, 32, 8, 14336, 128256, False, False, 500000.0, 8192),
}

TOKENIZER_KEYS = [
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token", "tokenizer.chat_template",
]


def parameter_count(shape):
    _, h, layers, heads, kv, ffn, vocab, tied, bias, _, _ = shape
    d = h // heads
    per_layer = h * h + 2 * h * kv * d + h * h + 3 * h * ffn + 2 * h + (h + 2 * kv * d if bias else 0)
    return vocab * h * (1 if tied else 2) + layers * per_layer + h


def copy_tokenizer(writer, source, vocab):
    reader = gguf.GGUFReader(source)
    fields = reader.fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    if len(tokens) > vocab:
        sys.exit(f"{source}: its vocabulary has {len(tokens)} tokens, more than the shape's {vocab}")
    extra = vocab - len(tokens)
    writer.add_array("tokenizer.ggml.tokens", list(tokens) + [f"<|synthetic_{i}|>" for i in range(extra)])
    writer.add_array("tokenizer.ggml.token_type", list(types) + [int(gguf.TokenType.NORMAL)] * extra)
    for key in TOKENIZER_KEYS:
        field = fields.get(key)
        if field is None:
            continue
        vtype = field.types[0]
        value = field.contents()
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, vtype)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    ap.add_argument("out", nargs="?")
    ap.add_argument("--tokenizer-from", help="a GGUF whose tokenizer is copied (SmolLM2's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--list", action="store_true", help="print the shapes and their parameter counts")
    args = ap.parse_args()
    if args.list:
        for name, shape in SHAPES.items():
            print(f"{name}\t{shape[0]}\t{parameter_count(shape) / 1e9:.2f}B")
        return
    if not (args.shape and args.out and args.tokenizer_from):
        ap.error("SHAPE, OUT and --tokenizer-from are required")
    shape = SHAPES[args.shape]
    arch, h, layers, heads, kv, ffn, vocab, tied, bias, rope_base, context = shape
    d = h // heads

    writer = gguf.GGUFWriter(args.out, arch)
    writer.add_name(f"synthetic {args.shape}")
    writer.add_context_length(context)
    writer.add_embedding_length(h)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_dimension_count(d)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    copy_tokenizer(writer, args.tokenizer_from, vocab)

    # (name, numpy shape (rows, columns), float32 for norms and biases)
    tensors = [("token_embd.weight", (vocab, h), False)]
    for i in range(layers):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", (h,), True),
                    (b + "attn_q.weight", (heads * d, h), False),
                    (b + "attn_k.weight", (kv * d, h), False),
                    (b + "attn_v.weight", (kv * d, h), False)]
        if bias:
            tensors += [(b + "attn_q.bias", (heads * d,), True),
                        (b + "attn_k.bias", (kv * d,), True),
                        (b + "attn_v.bias", (kv * d,), True)]
        tensors += [(b + "attn_output.weight", (h, heads * d), False),
                    (b + "ffn_norm.weight", (h,), True),
                    (b + "ffn_gate.weight", (ffn, h), False),
                    (b + "ffn_up.weight", (ffn, h), False),
                    (b + "ffn_down.weight", (h, ffn), False)]
    tensors.append(("output_norm.weight", (h,), True))
    if not tied:
        tensors.append(("output.weight", (vocab, h), False))

    for name, dims, small in tensors:
        dtype = np.float32 if small else np.float16
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()

    # A pool of seeded draws; each tensor is a run of it from a seeded offset
    # (drawing 8B values one by one would take minutes for no benefit).
    rng = np.random.default_rng(args.seed)
    pool = (rng.standard_normal(1 << 24, dtype=np.float32) * 0.02).astype(np.float16)
    for name, dims, small in tensors:
        count = int(np.prod(dims))
        if name.endswith("norm.weight"):
            data = np.ones(dims, dtype=np.float32)
        elif small:
            data = (rng.standard_normal(count, dtype=np.float32) * 0.02).reshape(dims)
        else:
            start = int(rng.integers(0, pool.size))
            reps = (start + count + pool.size - 1) // pool.size
            data = np.tile(pool, reps)[start:start + count].reshape(dims) if reps > 1 else pool[start:start + count].reshape(dims)
        writer.write_tensor_data(data)
    writer.close()
    print(f"{args.out}: {args.shape} ({arch}, {parameter_count(shape) / 1e9:.2f}B parameters, F16)", file=sys.stderr)


if __name__ == "__main__":
    main()
