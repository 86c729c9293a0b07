#!/usr/bin/env python3
"""GGUF files of the `arch-*` golden fixtures, made by llama.cpp's own converter
(`convert_hf_to_gguf.py` with its `gguf-py`, from the llama.cpp source that
scripts/build-llama-cpp.sh unpacks) and quantized by its `llama-quantize`:

    arch-X.f32.gguf      --outtype f32 (exact: the fixture's weights as stored)
    arch-X.q8_0.gguf     llama-quantize ... Q8_0
    arch-X.q4_k_m.gguf   llama-quantize ... Q4_K_M (on these 64-wide tensors
                         llama.cpp falls back to Q5_0 / Q5_1 / Q8_0 blocks)

The mixture-of-experts fixtures (qwen3-moe, mixtral, gpt-oss, olmoe, qwen2-moe) are converted to F32 and
to Q8_0 by the converter itself (`--outtype q8_0`, gguf-py's quantizer, which
keeps the routers `ffn_gate_inp` in F32 as llama-quantize does), so they need
no llama.cpp build. Qwen3-MoE's is tests/fixtures/arch-qwen3-moe-gguf (its
make.py says why: the converter cannot name the shared fixture's dense layer),
Qwen2-MoE's tests/fixtures/arch-qwen2-moe-gguf for the same reason. OLMoE's
converter reads the experts one tensor each (`mlp.experts.E.gate_proj.weight`,
as transformers 4 saved them), so arch-olmoe's fused ones (transformers 5:
`mlp.experts.gate_up_proj`, gate rows then up rows, and `down_proj`) are split
so in a copy first, the same values.

tests/tests/gguf_architectures.rs compiles each with maxc and compares the
logits with the fixture's goldens (made by transformers from the same weights).
vocab/ holds llama.cpp's own tokenizer tests (ggml-vocab-*.gguf with .inp
texts and the .out ids transformers gives them), copied from its `models/`.

The converter identifies a BPE tokenizer's pre-tokenizer by hashing how it
splits a test text, and knows only published tokenizers; the fixtures' small
test vocabulary (1024 tokens, GPT-2's byte-level regex, as their tokenizer.json
says) is declared here as llama.cpp's `gpt-2` pre-tokenizer instead. Nothing
else of the converter is changed.

Needs torch (the converter imports it), transformers and sentencepiece:
tests/golden/gguf/make.sh installs them into a virtual environment first.
"""
import os
import runpy
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
LLAMA = os.path.join(ROOT, ".cache/llama.cpp/src")
QUANTIZE = os.path.join(ROOT, ".cache/llama.cpp/build/bin/llama-quantize")
FIXTURES = os.environ.get("MAXC_FIXTURES", os.path.join(ROOT, "../shared/fixtures"))
OUT = os.path.dirname(os.path.abspath(__file__))
# `--outtype T ARCH`: one converter run (the mixture-of-experts fixtures' files, below).
OUTTYPE = sys.argv[2] if sys.argv[1:2] == ["--outtype"] else None
ARCHS = (sys.argv[3:] if OUTTYPE else sys.argv[1:]) or ["qwen3", "olmo2", "granite", "phi3", "gemma2", "gemma3", "gpt2", "bert", "qwen3-moe", "mixtral", "gpt-oss", "gpt-oss-mxfp4", "olmoe", "qwen2-moe"]
QUANTS = [("q8_0", "Q8_0"), ("q4_k_m", "Q4_K_M")]
# Converted by the converter alone, to these types (`--outtype`).
CONVERTER_TYPES = {"qwen3-moe": ["q8_0"], "mixtral": ["q8_0"], "gpt-oss": ["q8_0"], "olmoe": ["q8_0"], "qwen2-moe": ["q8_0"]}


# gpt-oss with its experts in MXFP4 (tests/fixtures/arch-gpt-oss-mxfp4, the
# released checkpoints' layout): the converter keeps them MXFP4 (type 39) and
# writes the rest as --outtype says: arch-gpt-oss.mxfp4.gguf.
MXFP4 = {"gpt-oss-mxfp4": "arch-gpt-oss.mxfp4.gguf"}


def convert(arch, outtype="f32"):
    # Gemma 3's and Qwen3-MoE's fixtures are this repository's own, made to
    # what a GGUF can say (tests/fixtures/arch-*-gguf/make.py).
    ours = {"gemma3": "arch-gemma3-gguf", "bert": "arch-bert", "qwen3-moe": "arch-qwen3-moe-gguf", "gpt-oss-mxfp4": "arch-gpt-oss-mxfp4", "olmoe": "arch-olmoe", "qwen2-moe": "arch-qwen2-moe-gguf"}
    src = os.path.join(ROOT, "tests/fixtures", ours[arch]) if arch in ours else os.path.join(FIXTURES, f"arch-{arch}")
    out = os.path.join(OUT, MXFP4.get(arch, f"arch-{arch}.{outtype}.gguf"))
    if arch == "gpt2":
        # The converter reads GPT-2's context from `n_ctx`, which configs saved
        # by current transformers no longer write (they keep `n_positions`, the
        # same number): a copy of the fixture with it added.
        import json
        import tempfile
        copy = os.path.join(tempfile.mkdtemp(), "arch-gpt2")
        shutil.copytree(src, copy)
        with open(os.path.join(copy, "config.json")) as f:
            config = json.load(f)
        config.setdefault("n_ctx", config["n_positions"])
        with open(os.path.join(copy, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        src = copy
    if arch == "olmoe":
        src = per_expert_copy(src)
    sys.path[:0] = [LLAMA, os.path.join(LLAMA, "gguf-py")]
    import conversion.base as base

    def fixture_pre_tokenizer(self, tokenizer):
        # WordPiece ignores the name; BERT's own (`bert-bge`, ...) are hashes of published models.
        return "default" if arch == "bert" else "gpt-2"

    base.TextModel.get_vocab_base_pre = fixture_pre_tokenizer
    # Phi-3's and Gemma 2's converters read a SentencePiece tokenizer.model,
    # which these fixtures do not have: their vocabulary is the byte-level BPE
    # of tokenizer.json, written as the converter writes one (as it does for
    # Phi-4's GPT2Tokenizer).
    if arch in ("phi3", "gemma2"):
        import conversion.phi as phi
        import conversion.gemma as gemma
        cls = {"phi3": phi.Phi3MiniModel, "gemma2": gemma.Gemma2Model}[arch]
        cls.set_vocab = lambda self: self._set_vocab_gpt2()
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", src, "--outtype", outtype, "--outfile", out]
    try:
        runpy.run_path(os.path.join(LLAMA, "convert_hf_to_gguf.py"), run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    finally:
        sys.argv = argv
    return out


def per_expert_copy(src):
    """A copy of fixture folder `src` with its fused experts saved one tensor
    each, as transformers 4 saved them (the values unchanged)."""
    import tempfile
    from safetensors.torch import load_file, save_file
    copy = os.path.join(tempfile.mkdtemp(), os.path.basename(src))
    shutil.copytree(src, copy)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            f = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :f].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, f:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    save_file(out, os.path.join(copy, "model.safetensors"), metadata={"format": "pt"})
    return copy


def main():
    for arch in ARCHS:
        # One process per architecture: the converter's module state is global.
        if len(ARCHS) > 1:
            subprocess.run([sys.executable, __file__, arch], check=True)
            continue
        if OUTTYPE:
            convert(arch, OUTTYPE)
            continue
        if arch in MXFP4:
            convert(arch)
            print(MXFP4[arch], os.path.getsize(os.path.join(OUT, MXFP4[arch])))
            continue
        if arch in CONVERTER_TYPES:
            # One process per file too: the converter's module state is global.
            for outtype in ["f32"] + CONVERTER_TYPES[arch]:
                subprocess.run([sys.executable, __file__, "--outtype", outtype, arch], check=True)
            for f in sorted(os.listdir(OUT)):
                if f.startswith(f"arch-{arch}."):
                    print(f, os.path.getsize(os.path.join(OUT, f)))
            continue
        f32 = convert(arch)
        for name, ty in QUANTS:
            out = os.path.join(OUT, f"arch-{arch}.{name}.gguf")
            subprocess.run([QUANTIZE, f32, out, ty], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for f in sorted(os.listdir(OUT)):
            if f.startswith(f"arch-{arch}."):
                print(f, os.path.getsize(os.path.join(OUT, f)))


if __name__ == "__main__":
    main()
