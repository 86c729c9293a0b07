//! Sentence encoders' batch plans end to end: all-MiniLM-L6-v2 compiled by
//! maxc, many inputs embedded per step by the engine's embedder over the CPU
//! encode executor (`maxrun_engine::embed::Embedder`, `CpuEncoder`),
//! judged against the golden embeddings (Hugging Face transformers, through
//! sentence-transformers' pooling) and against each input run alone through the
//! single-sequence plan (a different attention kernel over the KV cache, and a
//! step of one input); the step counts the limits imply; the limits in `maxrun
//! inspect`; and corrupt encoder batch plans refused at open.

use std::path::Path;
use std::sync::OnceLock;
use std::time::Instant;

use maxc_tests::*;
use maxrun_runtime::artifact::Artifact;
use maxrun_engine::embed::{EmbedError, Embedder, EncoderFacts};
use maxrun_runtime::executor::cpu_encoder::CpuEncoder;
use maxrun_runtime::format::{BufferRef, Header};
use maxrun_runtime::session::Session;

/// all-MiniLM-L6-v2 with the encoder defaults (32 inputs, 2048 rows per step).
fn minilm() -> &'static Path {
    static A: OnceLock<TempPath> = OnceLock::new();
    A.get_or_init(|| compile_model("encoder-batch-minilm", &minilm_dir(), &[]))
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    (dot / (norm(a) * norm(b))) as f32
}

fn tokenizer() -> tokenizers::Tokenizer {
    let mut t = tokenizers::Tokenizer::from_file(minilm_dir().join("tokenizer.json")).unwrap();
    t.with_padding(None);
    t
}

/// The 8 golden sentences, each repeated 1 to 4 times in one input (8 to 50
/// tokens): 64 inputs, in an order that mixes the lengths.
fn sixty_four_inputs() -> (Vec<String>, Vec<Vec<u32>>) {
    let golden = golden("all-minilm-l6-v2");
    let sentences: Vec<&str> = golden["sentences"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
    let texts: Vec<String> = (0..64).map(|k| vec![sentences[k % 8]; k / 8 % 4 + 1].join(" ")).collect();
    let t = tokenizer();
    let ids = texts.iter().map(|s| t.encode(s.as_str(), true).unwrap().get_ids().to_vec()).collect();
    (texts, ids)
}

/// The embedder over `a`'s encoder batch plan on the CPU.
fn embedder(a: &Artifact, threads: usize) -> Embedder<'_> {
    Embedder::new(Box::new(CpuEncoder::new(a, threads).unwrap()), EncoderFacts::of(a).unwrap())
}

/// Each input alone through the single-sequence prefill plan.
fn alone(a: &Artifact, inputs: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let mut s = Session::new(a, 2).unwrap();
    inputs
        .iter()
        .map(|ids| {
            s.reset();
            s.forward(ids).unwrap().to_vec()
        })
        .collect()
}

/// The 8 golden sentences in one step: each embedding within the fixtures'
/// tolerance of transformers' (cosine >= 0.9999), and of the same sentence
/// embedded alone by the single-sequence plan; a step of fewer sentences, or
/// of them in another order, gives each the same vector. A wrong row range
/// (a sentence attending to or pooling another's rows) moves the embeddings
/// far below these cosines.
#[test]
fn golden_sentences_in_one_step_match_the_golden_and_each_alone() {
    let a = Artifact::open(minilm()).unwrap();
    let golden = golden("all-minilm-l6-v2");
    let inputs: Vec<Vec<u32>> = golden["input_ids"].as_array().unwrap().iter().map(ids).collect();
    let (shape, want) = maxrun_runtime::npy::read_f32(&fixture("all-minilm-l6-v2").join("embeddings.npy")).unwrap();
    let width = shape[1];
    let mut batch = embedder(&a, 2);
    let refs: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
    let out = batch.step(&refs).unwrap().to_vec();
    assert_eq!((out.len(), batch.steps()), (8 * width, 1));
    let single = alone(&a, &inputs);
    for (i, got) in out.chunks_exact(width).enumerate() {
        let gold = cosine(got, &want[i * width..(i + 1) * width]);
        let own = cosine(got, &single[i]);
        let diff = got.iter().zip(&single[i]).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        eprintln!("sentence {i}: cosine {gold} with the golden, {own} with itself alone (max |difference| {diff:.2e})");
        assert!(gold >= 0.9999, "sentence {i}: cosine {gold} with the golden embedding");
        assert!(own >= 0.9999, "sentence {i}: cosine {own} with the sentence alone");
    }
    // The last three, reversed, in a step of their own.
    let few: Vec<&[u32]> = refs[5..].iter().rev().copied().collect();
    let some = batch.step(&few).unwrap().to_vec();
    for (j, got) in some.chunks_exact(width).enumerate() {
        let i = 7 - j;
        let c = cosine(got, &out[i * width..(i + 1) * width]);
        assert!(c >= 0.99999, "sentence {i} in a step of three: cosine {c} with itself in the step of eight");
    }
}

/// 64 inputs of 8 to 50 tokens through `embed_all`: ceil(64 / 32) = 2 steps
/// with the default limits (the rows fit: 32 inputs of at most 50 tokens are
/// under 2048), each embedding within cosine 0.9999 of the input alone, in
/// input order. With 48 inputs but only 512 rows per step the rows bind:
/// at least ceil(rows / 512) steps and at most one more (first-fit decreasing),
/// never more inputs or rows than the plan takes. Prints the wall time of the
/// batched steps against the inputs one at a time.
#[test]
fn sixty_four_inputs_take_the_fewest_steps_the_limits_allow() {
    let (_, inputs) = sixty_four_inputs();
    let rows: usize = inputs.iter().map(Vec::len).sum();
    let a = Artifact::open(minilm()).unwrap();
    let started = Instant::now();
    let single = alone(&a, &inputs);
    let one_at_a_time = started.elapsed();
    let mut batch = embedder(&a, 2);
    assert_eq!((batch.limits().max_sequences, batch.limits().max_rows), (32, 2048));
    let longest = inputs.iter().map(Vec::len).max().unwrap();
    assert!(32 * longest <= 2048, "the rows fit: {longest} tokens at most");
    let started = Instant::now();
    let out = batch.embed_all(&inputs).unwrap();
    let batched = started.elapsed();
    assert_eq!(batch.steps(), 64u64.div_ceil(32));
    eprintln!(
        "64 inputs ({rows} tokens, 2 threads): {:.1} ms in {} batched steps, {:.1} ms one at a time ({:.2}x)",
        batched.as_secs_f64() * 1e3,
        batch.steps(),
        one_at_a_time.as_secs_f64() * 1e3,
        one_at_a_time.as_secs_f64() / batched.as_secs_f64()
    );
    assert_eq!(out.len(), 64);
    for (i, (got, want)) in out.iter().zip(&single).enumerate() {
        let c = cosine(got, want);
        assert!(c >= 0.9999, "input {i}: cosine {c} with the input alone");
    }

    // Rows bind: 48 inputs but 512 rows (the artifact's max_length) per step.
    let mef = compile_model("encoder-batch-rows", &minilm_dir(), &["--max-sequences", "48", "--max-batch-tokens", "512"]);
    let a = Artifact::open(&mef).unwrap();
    let mut batch = embedder(&a, 2);
    assert_eq!((batch.limits().max_sequences, batch.limits().max_rows), (48, 512));
    let out = batch.embed_all(&inputs).unwrap();
    let fewest = rows.div_ceil(512) as u64;
    assert!((fewest..=fewest + 1).contains(&batch.steps()), "{} steps for {rows} rows in steps of 512", batch.steps());
    assert!(batch.steps() > 64u64.div_ceil(48), "the rows, not the inputs, bound the steps");
    for (i, (got, want)) in out.iter().zip(&single).enumerate() {
        let c = cosine(got, want);
        assert!(c >= 0.9999, "input {i} (steps of 512 rows): cosine {c} with the input alone");
    }
}

/// Inputs a step cannot take are refused with what is wrong and which input,
/// before any work: empty, longer than the artifact's maximum length, a token
/// outside the vocabulary; and a step over the plan's limits (`embed_all`
/// splits those).
#[test]
fn bad_inputs_and_oversized_steps_are_refused_by_name() {
    let a = Artifact::open(minilm()).unwrap();
    let max = a.header.max_length as usize;
    let mut batch = embedder(&a, 1);
    let ok = vec![101u32, 2000, 102];
    let long = vec![2000u32; max + 1];
    let bad_token = vec![101u32, 4_000_000, 102];
    for (inputs, want) in [
        (vec![ok.clone(), vec![]], vec!["input 1 is empty"]),
        (vec![ok.clone(), ok.clone(), long.clone()], vec!["input 2", &format!("{} tokens", max + 1), &format!("maximum length of {max}")]),
        (vec![bad_token.clone()], vec!["input 0", "4000000", "vocabulary"]),
    ] {
        let e = batch.embed_all(&inputs).unwrap_err().to_string();
        for w in want {
            assert!(e.contains(w), "`{e}` lacks `{w}`");
        }
    }
    assert_eq!(batch.steps(), 0, "nothing ran");
    let many: Vec<&[u32]> = vec![ok.as_slice(); 33];
    let e = batch.step(&many).unwrap_err();
    assert!(matches!(e, EmbedError::StepTooLarge { sequences: 33, max_sequences: 32, .. }), "{e}");
    assert!(e.to_string().contains("embed_all"), "{e}");
    // A decoder has no encoder batch plan.
    let mef = compile_model("encoder-batch-decoder", &fixture("tiny-llama"), &[]);
    let decoder = Artifact::open(&mef).unwrap();
    let e = CpuEncoder::new(&decoder, 1).unwrap_err().to_string();
    assert!(e.contains("no encoder batch plan") && e.contains("recompile"), "{e}");
    // `maxrun inspect` shows the encoder's limits, and none for the decoder.
    let v = inspect_json(minilm());
    assert_eq!((v["encode_batch"]["max_sequences"].as_u64(), v["encode_batch"]["max_batch_tokens"].as_u64()), (Some(32), Some(2048)));
    let plan = &v["sub_models"][0]["plans"]["encode_batch"];
    assert_eq!(plan["outputs"][0]["shape"], serde_json::json!(["sequences", 384]));
    assert!(inspect_json(&mef)["encode_batch"].is_null());
    let (code, text, err) = run_bin("maxrun", &["inspect".as_ref(), minilm().as_os_str()]);
    assert_eq!(code, 0, "{err}");
    assert!(text.lines().any(|l| l.starts_with("encoder batch") && l.contains("32 sequences, 2048 rows per step")), "{text}");
}

/// An encoder whose step could not hold a whole input is refused at compile
/// time, naming the setting and the length it needs.
#[test]
fn compile_refuses_encoder_steps_shorter_than_an_input() {
    let out = temp_file("encoder-batch-short", "m.mef");
    let r = run_bin("maxc", &["compile".as_ref(), "--model".as_ref(), minilm_dir().as_os_str(), "-o".as_ref(), out.as_os_str(), "--max-batch-tokens".as_ref(), "100".as_ref()]);
    assert_clean_error(&r, 1, &["--max-batch-tokens", "100 rows", "at least 512", "BertModel"]);
    assert!(!out.exists());
}

/// `mef` with its header changed by `edit`, written to a new file (the
/// header re-encoded in place: it must still end before the first section).
fn with_header(mef: &Path, tag: &str, edit: impl FnOnce(&mut Header)) -> TempPath {
    let bytes = std::fs::read(mef).unwrap();
    let mut header = Artifact::from_bytes(mef, bytes.clone()).unwrap().header;
    // Read back as written (the first CPU variant is the header's own).
    edit(&mut header);
    let first = header.sections.iter().map(|s| s.offset).min().unwrap() as usize;
    let prelude = maxrun_runtime::format::encode_header(&header);
    assert!(prelude.len() <= first, "the edited header runs into the first section");
    let mut out = bytes;
    out[..first].fill(0);
    out[..prelude.len()].copy_from_slice(&prelude);
    let p = temp_file(tag, "m.mef");
    std::fs::write(&p, out).unwrap();
    p
}

/// A corruption: its name, the header edit, and what the refusal must name.
type Corruption = (&'static str, Box<dyn FnOnce(&mut Header)>, &'static str);

/// The loader checks the encoder batch plan as it checks the others: its
/// limits against the context and the plan, its output inside the arena,
/// `SequenceStarts` only in it, and no KV cache read by it. Each corruption
/// is refused at open, naming what is wrong.
#[test]
fn corrupt_encoder_batch_plans_are_refused_at_open() {
    let mef = minilm();
    assert!(Artifact::open(&with_header(mef, "enc-same", |_| {})).is_ok(), "an unchanged header opens");
    let cases: Vec<Corruption> = vec![
        ("rows", Box::new(|h| h.sub_models[0].encode_batch.as_mut().unwrap().max_rows = 100), "encoder batch plan"),
        ("sequences", Box::new(|h| h.sub_models[0].encode_batch.as_mut().unwrap().max_sequences = 0), "encoder batch plan"),
        ("plan-rows", Box::new(|h| h.sub_models[0].encode_batch.as_mut().unwrap().plan.max_seq = 4096), "encoder batch plan"),
        (
            "output",
            Box::new(|h| {
                let e = h.sub_models[0].encode_batch.as_mut().unwrap();
                e.plan.logits = BufferRef::Arena { offset: e.plan.arena_bytes - 64 };
            }),
            "encoder batch plan",
        ),
        (
            "starts-in-prefill",
            Box::new(|h| {
                let l = h.sub_models[0].prefill.launches.iter_mut().find(|l| l.args.contains(&BufferRef::Positions)).unwrap();
                *l.args.iter_mut().find(|a| **a == BufferRef::Positions).unwrap() = BufferRef::SequenceStarts;
            }),
            "SequenceStarts",
        ),
        (
            "cache-in-encode",
            Box::new(|h| {
                let e = h.sub_models[0].encode_batch.as_mut().unwrap();
                let l = e.plan.launches.iter_mut().find(|l| l.args.contains(&BufferRef::SequenceStarts)).unwrap();
                *l.args.iter_mut().find(|a| **a == BufferRef::SequenceStarts).unwrap() = BufferRef::KeyCache { layer: 0, part: 0 };
            }),
            "KeyCache",
        ),
    ];
    for (tag, edit, what) in cases {
        let p = with_header(mef, &format!("enc-{tag}"), edit);
        let e = Artifact::open(&p).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains(what) && e.contains("corrupt") && e.contains("recompile"), "{tag}: {e}");
        let r = run_bin("maxrun", &["inspect".as_ref(), p.as_os_str()]);
        assert_clean_error(&r, 1, &[what]);
    }
}
