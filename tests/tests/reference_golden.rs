//! The graph reference interpreter against the Hugging Face golden outputs:
//! tiny-llama and tiny-qwen2 (safetensors), SmolLM2-135M-Instruct (Q4_1 GGUF)
//! and the mixture-of-experts fixtures (the `moe` op's reference semantics,
//! gpt-oss's sinks and biases).

use maxc::driver::frontend;
use maxc::interp::{greedy, run_tokens, Interpreter};
use maxc::manifest::LoadedManifest;
use maxc::passes::PipelineOptions;
use maxc_tests::*;

fn check_model(fixture_name: &str, model_path: &std::path::Path, case_limit: usize) {
    let manifest = LoadedManifest::from_model_path(model_path, &[]).unwrap();
    let fe = frontend(manifest, &PipelineOptions { verify_each: true, ..Default::default() }).unwrap();
    let tokenizer: tokenizers::Tokenizer = fe.model.tokenizer_json.parse().unwrap();
    let golden = golden(fixture_name);
    for (i, case) in cases(&golden).iter().enumerate().take(case_limit) {
        let what = format!("{fixture_name} case {i}");
        let input = ids(&case["input_ids"]);
        let prompt = case["prompt"].as_str().unwrap();
        let encoded = tokenizer.encode(prompt, false).unwrap().get_ids().to_vec();
        assert_eq!(encoded, input, "{what}: tokenizer disagrees with the golden input_ids");

        let mut interp = Interpreter::new(&fe.graph, &fe.model.weights);
        let logits = run_tokens(&mut interp, &input, 0).unwrap();
        let (shape, data) = golden_logits(fixture_name, case);
        assert_eq!(logits.shape, shape, "{what}: logits shape");
        assert_logits_close(&what, logits.as_f32(), &data);

        interp.reset();
        let expected = ids(&case["greedy_ids"]);
        let ours = greedy(&mut interp, &input, expected.len()).unwrap();
        assert_greedy_prefix(&what, &ours, &expected);
        if ours == expected {
            assert_eq!(tokenizer.decode(&ours, false).unwrap(), case["greedy_text"].as_str().unwrap(), "{what}: text");
        }
    }
}

#[test]
fn tiny_llama_matches_golden() {
    check_model("tiny-llama", &fixture("tiny-llama"), usize::MAX);
}

#[test]
fn tiny_qwen2_matches_golden() {
    check_model("tiny-qwen2", &fixture("tiny-qwen2"), usize::MAX);
}

#[test]
fn qwen3_moe_matches_golden() {
    check_model("arch-qwen3-moe", &fixture("arch-qwen3-moe"), usize::MAX);
}

#[test]
fn mixtral_matches_golden() {
    check_model("arch-mixtral", &fixture("arch-mixtral"), usize::MAX);
}

/// gpt-oss: attention sinks, alternating sliding and full layers, YaRN, q/k/v/o
/// biases, the biased router and experts with the clamped SwiGLU, and its
/// transposed, interleaved expert tensors read through views.
#[test]
fn gpt_oss_matches_golden() {
    check_model("arch-gpt-oss", &fixture("arch-gpt-oss"), usize::MAX);
}

/// Qwen3 with YaRN over an original context of 16 positions: every case runs
/// past it (tests/fixtures/arch-qwen3-yarn/make.py, transformers' golden).
#[test]
fn qwen3_yarn_matches_golden() {
    check_model("arch-qwen3-yarn", &fixture("arch-qwen3-yarn"), usize::MAX);
}

/// OLMoE (tests/fixtures/arch-olmoe/make.py, transformers' golden): q/k norms
/// over the whole projections, 8 experts, top 2 of the softmax, not renormalized.
#[test]
fn olmoe_matches_golden() {
    check_model("arch-olmoe", &fixture("arch-olmoe"), usize::MAX);
}

/// Qwen2-MoE (tests/fixtures/arch-qwen2-moe/make.py, transformers' golden):
/// a dense middle layer, 6 experts, top 3 of the softmax, not renormalized,
/// and a shared expert behind a sigmoid gate.
#[test]
fn qwen2_moe_matches_golden() {
    check_model("arch-qwen2-moe", &fixture("arch-qwen2-moe"), usize::MAX);
}

#[test]
fn smollm2_gguf_matches_golden() {
    check_model("smollm2-135m", &smollm2_gguf(), usize::MAX);
}

/// The tokenizer rebuilt from GGUF metadata encodes exactly as the HF tokenizer.json
/// (the fixtures' tiny-llama uses the SmolLM2 tokenizer), on text that exercises
/// digits, whitespace runs, unicode and special tokens.
#[test]
fn gguf_tokenizer_matches_hf_tokenizer() {
    let gguf = maxc::import::gguf::GgufFile::open(&smollm2_gguf()).unwrap();
    let ours: tokenizers::Tokenizer = maxc::import::gguf_tokenizer::tokenizer_json(&gguf, 49152).unwrap().parse().unwrap();
    let hf = tokenizers::Tokenizer::from_file(fixture("tiny-llama").join("tokenizer.json")).unwrap();
    let texts = [
        "Hello, world! 12345 and 3.14159",
        "  leading spaces\n\n\ttabs\r\nand CRLF   ",
        "naïve café — 東京 🤖 emoji",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
        "def f(x):\n    return x**2  # 1000000",
        "I'm sure they'll've done it, won't they?",
    ];
    for t in texts {
        let a = ours.encode(t, false).unwrap().get_ids().to_vec();
        let b = hf.encode(t, false).unwrap().get_ids().to_vec();
        assert_eq!(a, b, "{t:?}");
        assert_eq!(ours.decode(&a, false).unwrap(), hf.decode(&b, false).unwrap());
    }
    let golden = golden("smollm2-135m");
    let chat_ids = ids(&golden["chat"]["input_ids"]);
    let text = hf.decode(&chat_ids, false).unwrap();
    assert_eq!(ours.encode(text.as_str(), false).unwrap().get_ids(), &chat_ids[..]);
}

/// A GGUF's `tokenizer.ggml.add_bos_token` / `add_eos_token` are honoured as
/// llama.cpp's `llama_tokenize(..., add_special = true)` does: BOS before, EOS
/// after the text; SmolLM2's file says false to both (nothing added); a flag of
/// the wrong type is refused by name.
#[test]
fn gguf_add_bos_and_add_eos_flags_are_honoured() {
    use maxc::import::gguf::MetaValue;
    let mut gguf = maxc::import::gguf::GgufFile::open(&smollm2_gguf()).unwrap();
    let text = "Hello, world!";
    let encode = |g: &maxc::import::gguf::GgufFile| {
        let t: tokenizers::Tokenizer = maxc::import::gguf_tokenizer::tokenizer_json(g, 49152).unwrap().parse().unwrap();
        t.encode(text, true).unwrap().get_ids().to_vec()
    };
    let bare = encode(&gguf);
    assert_eq!(gguf.get("tokenizer.ggml.add_bos_token"), Some(&MetaValue::Bool(false)));
    let hf = tokenizers::Tokenizer::from_file(fixture("tiny-llama").join("tokenizer.json")).unwrap();
    assert_eq!(bare, hf.encode(text, false).unwrap().get_ids(), "nothing added when the file says false");
    let id = |k: &str| gguf.get(k).and_then(MetaValue::as_u64).unwrap() as u32;
    let (bos, eos) = (id("tokenizer.ggml.bos_token_id"), id("tokenizer.ggml.eos_token_id"));
    gguf.metadata.insert("tokenizer.ggml.add_bos_token".into(), MetaValue::Bool(true));
    assert_eq!(encode(&gguf), [&[bos][..], &bare].concat());
    gguf.metadata.insert("tokenizer.ggml.add_eos_token".into(), MetaValue::Bool(true));
    assert_eq!(encode(&gguf), [&[bos][..], &bare, &[eos]].concat());
    gguf.metadata.insert("tokenizer.ggml.add_bos_token".into(), MetaValue::Int(1));
    let err = maxc::import::gguf_tokenizer::tokenizer_json(&gguf, 49152).unwrap_err().to_string();
    assert!(err.contains("tokenizer.ggml.add_bos_token") && err.contains("expected a bool"), "{err}");
    // Without the key, llama.cpp's defaults (llama-vocab.cpp): BOS for the
    // Llama 3 pre-tokenizer's vocabularies (Llama 3 files from older
    // converters lack the key), nothing for the others (SmolLM2's, Qwen2's).
    gguf.metadata.remove("tokenizer.ggml.add_eos_token");
    for (pre, adds_bos) in [("llama-bpe", true), ("llama3", true), ("smollm", false), ("qwen2", false)] {
        gguf.metadata.insert("tokenizer.ggml.pre".into(), MetaValue::Str(pre.into()));
        gguf.metadata.insert("tokenizer.ggml.add_bos_token".into(), MetaValue::Bool(false));
        let bare = encode(&gguf);
        gguf.metadata.remove("tokenizer.ggml.add_bos_token");
        let want = if adds_bos { [&[bos][..], &bare].concat() } else { bare };
        assert_eq!(encode(&gguf), want, "pre-tokenizer {pre} without add_bos_token");
    }
}
