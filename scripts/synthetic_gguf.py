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

Mixtures of experts (MOE_SHAPES) take a subset of the model's layers so that
a file stays under 6 GB (#64's benchmarks): Qwen3-30B-A3B's (`qwen3moe`: per-head
q/k norms, 128 experts of width 768, top 8) and gpt-oss-20b's (`gpt-oss`:
sinks, q/k/v/o biases, a router with a bias, 32 experts with biases, top 4,
sliding and full layers, YaRN). gpt-oss's experts are written in MXFP4 as its
released files hold them (random codes, a scale byte fitting normal(0, 0.02)
weights), the rest F16; llama-quantize makes the other types of the qwen3moe
file.

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
    # 8 of Llama 3 8B's 32 layers with its whole vocabulary and untied head:
    # 2.8B parameters, 5.6 GB at BF16, of which a token reads 4.5 GB (the
    # layers 1.75B, the head 0.53B), so a BF16 file and its artifact fit in a
    # 24 GB machine's page cache together (issue #69's tables).
    "llama-3-8b-8l": ("llama", 4096, 8, 32, 8, 14336, 128256, False, False, 500000.0, 8192),
}

# name: (architecture, hidden, layers written (of the model's), heads, kv heads,
#        head size, experts, top-k, expert width, vocab, rope base, context).
MOE_SHAPES = {
    "qwen3-30b-a3b-4l": ("qwen3moe", 2048, 4, 32, 4, 128, 128, 8, 768, 151936, 1000000.0, 40960),
    "gpt-oss-20b-4l": ("gpt-oss", 2880, 4, 64, 8, 64, 32, 4, 2880, 201088, 150000.0, 131072),
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


def write_header(writer, tensors):
    """The header, metadata and tensor table of `tensors`, (name, numpy shape,
    kind): "f16" matrices, "f32" norms / biases / routers, "mxfp4" blocks
    (17 bytes per 32 values along the last axis)."""
    for name, dims, kind in tensors:
        if kind == "mxfp4":
            byte_dims = (*dims[:-1], dims[-1] // 32 * 17)
            writer.add_tensor_info(name, byte_dims, np.dtype(np.uint8), int(np.prod(byte_dims)), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            dtype = np.float32 if kind == "f32" else np.float16
            writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()


def float_pool(rng):
    """A pool of seeded normal(0, 0.02) draws; each tensor is a run of it from a
    seeded offset (drawing 8B values one by one would take minutes for no benefit)."""
    return (rng.standard_normal(1 << 24, dtype=np.float32) * 0.02).astype(np.float16)


def moe_parameter_count(shape):
    _, h, layers, heads, kv, d, experts, _, f, vocab, _, _ = shape
    per_layer = h * heads * d * 2 + 2 * h * kv * d + experts * 3 * h * f + experts * h
    return 2 * vocab * h + layers * per_layer


def write_moe(args, name):
    """A mixture-of-experts file: every layer routed, experts stacked per
    projection as llama.cpp's converter writes them."""
    arch, h, layers, heads, kv, d, experts, top_k, f, vocab, rope_base, context = MOE_SHAPES[name]
    oss = arch == "gpt-oss"
    writer = gguf.GGUFWriter(args.out, arch)
    writer.add_name(f"synthetic {name}")
    writer.add_context_length(context)
    writer.add_embedding_length(h)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(f)
    writer.add_expert_feed_forward_length(f)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(top_k)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_key_length(d)
    writer.add_value_length(d)
    writer.add_rope_dimension_count(d)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(1e-5 if oss else 1e-6)
    writer.add_vocab_size(vocab)
    if oss:
        writer.add_sliding_window(128)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(32.0)
        writer.add_rope_scaling_orig_ctx_len(4096)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE if oss else gguf.LlamaFileType.MOSTLY_F16)
    copy_tokenizer(writer, args.tokenizer_from, vocab)

    # (name, numpy shape, kind): "f16" matrices, "f32" norms / biases / the
    # router (llama.cpp keeps ffn_gate_inp F32), "mxfp4" gpt-oss's experts.
    expert = "mxfp4" if oss else "f16"
    tensors = [("token_embd.weight", (vocab, h), "f16")]
    for i in range(layers):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", (h,), "f32"),
                    (b + "attn_q.weight", (heads * d, h), "f16"),
                    (b + "attn_k.weight", (kv * d, h), "f16"),
                    (b + "attn_v.weight", (kv * d, h), "f16"),
                    (b + "attn_output.weight", (h, heads * d), "f16")]
        if oss:
            tensors += [(b + "attn_q.bias", (heads * d,), "f32"), (b + "attn_k.bias", (kv * d,), "f32"),
                        (b + "attn_v.bias", (kv * d,), "f32"), (b + "attn_output.bias", (h,), "f32"),
                        (b + "attn_sinks.weight", (heads,), "f32"),
                        (b + "post_attention_norm.weight", (h,), "f32"),
                        (b + "ffn_gate_inp.bias", (experts,), "f32"),
                        (b + "ffn_gate_exps.bias", (experts, f), "f32"),
                        (b + "ffn_up_exps.bias", (experts, f), "f32"),
                        (b + "ffn_down_exps.bias", (experts, h), "f32")]
        else:
            tensors += [(b + "attn_q_norm.weight", (d,), "f32"), (b + "attn_k_norm.weight", (d,), "f32"),
                        (b + "ffn_norm.weight", (h,), "f32")]
        tensors += [(b + "ffn_gate_inp.weight", (experts, h), "f32"),
                    (b + "ffn_gate_exps.weight", (experts, f, h), expert),
                    (b + "ffn_up_exps.weight", (experts, f, h), expert),
                    (b + "ffn_down_exps.weight", (experts, h, f), expert)]
    tensors += [("output_norm.weight", (h,), "f32"), ("output.weight", (vocab, h), "f16")]

    write_header(writer, tensors)
    rng = np.random.default_rng(args.seed)
    pool = float_pool(rng)
    codes = rng.integers(0, 256, 1 << 24, dtype=np.uint8)
    for tname, dims, kind in tensors:
        count = int(np.prod(dims))
        if tname.endswith("norm.weight"):
            data = np.ones(dims, dtype=np.float32)
        elif kind == "f32":
            data = (rng.standard_normal(count, dtype=np.float32) * 0.02).reshape(dims)
        elif kind == "mxfp4":
            # Random nibbles; scale byte 120 (2^-7: the largest code, 6, at
            # 0.047, about the largest of 32 normal(0, 0.02) draws).
            blocks = count // 32
            start = int(rng.integers(0, codes.size))
            raw = np.resize(np.roll(codes, -start), blocks * 17).reshape(blocks, 17)
            raw[:, 0] = 120
            data = raw.reshape(*dims[:-1], dims[-1] // 32 * 17)
        else:
            start = int(rng.integers(0, pool.size))
            data = np.resize(np.roll(pool, -start), count).reshape(dims)
        writer.write_tensor_data(data)
    writer.close()
    print(f"{args.out}: {name} ({arch}, {moe_parameter_count(MOE_SHAPES[name]) / 1e9:.2f}B parameters)", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", nargs="?", choices=sorted(SHAPES) + sorted(MOE_SHAPES))
    ap.add_argument("out", nargs="?")
    ap.add_argument("--tokenizer-from", help="a GGUF whose tokenizer is copied (SmolLM2's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--list", action="store_true", help="print the shapes and their parameter counts")
    args = ap.parse_args()
    if args.list:
        for name, shape in SHAPES.items():
            print(f"{name}\t{shape[0]}\t{parameter_count(shape) / 1e9:.2f}B")
        for name, shape in MOE_SHAPES.items():
            print(f"{name}\t{shape[0]}\t{moe_parameter_count(shape) / 1e9:.2f}B")
        return
    if not (args.shape and args.out and args.tokenizer_from):
        ap.error("SHAPE, OUT and --tokenizer-from are required")
    if args.shape in MOE_SHAPES:
        write_moe(args, args.shape)
        return
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

    write_header(writer, [(name, dims, "f32" if small else "f16") for name, dims, small in tensors])
    rng = np.random.default_rng(args.seed)
    pool = float_pool(rng)
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
