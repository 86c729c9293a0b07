#!/usr/bin/env python3
"""Models of a given shape for the GPU benchmark (docs/gpu.md), and PyTorch's own
decode and prefill speed on them.

    gpu_model.py generate SHAPE OUT_DIR --tokenizer DIR [--seed N]
        A Llama-architecture Hugging Face directory with weights drawn from a
        seeded normal distribution (transformers' own initialisation), stored as
        bfloat16, and the tokenizer files of DIR (SmolLM2's, 49152 tokens).
    gpu_model.py torch-bench DIR [-p 512] [-n 128] [-r 3]
        transformers on PyTorch, bfloat16 on the GPU, static KV cache: prefill
        tokens/s of a P-token prompt and decode tokens/s of N tokens after it.
        Prints one JSON line.

SHAPE is smollm2-135m (SmolLM2-135M's shape) or llama-1.17b (Llama 3.2 1B's
layers with SmolLM2's vocabulary and an untied output: 1.17 B parameters).
The weights are random: the benchmark measures work, not text.
"""
import argparse
import json
import shutil
import sys
import time
from pathlib import Path

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "llama-1.17b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]


def generate(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, max_position_embeddings=4096, rms_norm_eps=1e-5,
                         rope_theta=100000.0, bos_token_id=1, eos_token_id=2,
                         torch_dtype="bfloat16", **SHAPES[args.shape])
    torch.manual_seed(args.seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16)
    out = Path(args.out)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = Path(args.tokenizer) / name
        if src.exists():
            shutil.copy(src, out / name)
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"shape": args.shape, "parameters": params, "dir": str(out)}))


def torch_bench(args):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16).to("cuda").eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (1, args.p), generator=gen).to("cuda")

    def timed(fn):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def prefill():
        with torch.no_grad():
            model(prompt, use_cache=False)

    def generate(n):
        def run():
            with torch.no_grad():
                model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               cache_implementation="static", pad_token_id=0)
        return run

    prefill()
    generate(args.n)()  # warm-up: allocates the static cache
    pp, tg = [], []
    for _ in range(args.r):
        t_prefill = timed(prefill)
        # Decode time: a generation of N tokens minus one of a single token
        # (which is the prefill plus generate's set-up).
        t_one = timed(generate(1))
        t_all = timed(generate(args.n))
        pp.append(args.p / t_prefill)
        tg.append((args.n - 1) / (t_all - t_one))
    print(json.dumps({
        "prefill_tokens_per_s": sum(pp) / len(pp),
        "decode_tokens_per_s": sum(tg) / len(tg),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
    }))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate")
    g.add_argument("shape", choices=sorted(SHAPES))
    g.add_argument("out")
    g.add_argument("--tokenizer", required=True)
    g.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("torch-bench")
    t.add_argument("dir")
    t.add_argument("-p", type=int, default=512)
    t.add_argument("-n", type=int, default=128)
    t.add_argument("-r", type=int, default=3)
    args = parser.parse_args()
    if args.command == "generate":
        generate(args)
    else:
        torch_bench(args)


if __name__ == "__main__":
    sys.exit(main())
