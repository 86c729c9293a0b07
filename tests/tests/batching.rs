//! The batched engine (runtime-stub/engine/src/batch.rs) against the goldens and
//! against single-stream runs of the same artifact: prompts that run together,
//! joined at different steps, get the logits and greedy texts they get alone;
//! concurrent requests with random arrivals and cancellations complete with
//! their single-stream texts; a full KV pool preempts and still gives the same
//! texts; a shared prefix is computed once.

use std::collections::HashMap;

use maxc_tests::*;
use maxrun_runtime::artifact::Artifact;
use maxrun_engine::{load_tokenizer, Engine, Event, GenerationParams, ModelFacts, Request, RequestId};
use maxrun_runtime::runner::{Device, Runner};
use maxrun_runtime::sampler::SamplingParams;

fn float32_artifact(name: &str) -> TempPath {
    let model = if name == "smollm2-135m" { smollm2_gguf() } else { fixture(name) };
    compile_model(&format!("batch-{name}"), &model, &["--quantization-encoding", "float32"])
}

/// The batched engine on the artifact's CPU executor, 2 threads, a KV pool of
/// `kv_bytes` (`None`: the default).
fn batched(artifact: &Artifact, kv_bytes: Option<u64>) -> Result<Engine<'_>, maxrun_runtime::runner::RunnerError> {
    let (executor, _) = maxrun_runtime::runner::open_executor(artifact, 2, Device::Cpu, kv_bytes)?;
    Ok(Engine::batched(ModelFacts::of(artifact), executor, load_tokenizer(artifact).unwrap()))
}

fn greedy(max_tokens: usize, ignore_eos: bool) -> GenerationParams {
    GenerationParams { max_tokens, ignore_eos, ..GenerationParams::default() }
}

/// What one request produced.
#[derive(Default, Debug)]
struct Outcome {
    logits: HashMap<usize, Vec<f32>>,
    tokens: Vec<u32>,
    text: String,
    finished: bool,
}

/// Steps `engine` until every request has finished, submitting `later[k]` after
/// step `later[k].0`; returns each request's outcome by submission index.
fn run_all(engine: &mut Engine<'_>, first: Vec<Request>, later: Vec<(usize, Request)>) -> Vec<Outcome> {
    let mut ids: Vec<RequestId> = first.into_iter().map(|r| engine.submit(r).unwrap()).collect();
    let mut later = later.into_iter().peekable();
    let mut out: HashMap<RequestId, Outcome> = HashMap::new();
    let mut step = 0;
    while engine.has_work() || later.peek().is_some() {
        while let Some((_, r)) = later.next_if(|(at, _)| *at <= step) {
            ids.push(engine.submit(r).unwrap());
        }
        for e in engine.step().unwrap() {
            match e {
                Event::Logits { id, position, logits } => {
                    out.entry(id).or_default().logits.insert(position, logits);
                }
                Event::Token { id, token, text, .. } => {
                    let o = out.entry(id).or_default();
                    o.tokens.push(token);
                    o.text.push_str(&text);
                }
                Event::Finished { id, text, .. } => {
                    let o = out.entry(id).or_default();
                    o.text.push_str(&text);
                    o.finished = true;
                }
                Event::PromptLogprob { .. } => unreachable!("no request asked for prompt log-probabilities"),
            }
        }
        step += 1;
        assert!(step < 10_000, "the engine does not finish");
    }
    ids.into_iter().map(|id| out.remove(&id).unwrap_or_default()).collect()
}

/// The golden prompts of a fixture run as one batch (the second joins after one
/// step, the third after three) with every prompt logit returned, then 24 greedy
/// tokens each.
fn check_batch_against_golden_and_single(name: &str) {
    let mef = float32_artifact(name);
    let artifact = Artifact::open(&mef).unwrap();
    let golden = golden(name);
    let cases = cases(&golden);
    // As the goldens were generated: EOS suppressed on the arch-* fixtures.
    let ignore_eos = name.starts_with("arch-");
    let request = |c: &serde_json::Value| Request { prompt: ids(&c["input_ids"]), params: greedy(ids(&c["greedy_ids"]).len(), ignore_eos), all_logits: true };
    let mut batched = batched(&artifact, None).unwrap();
    let later: Vec<(usize, Request)> = cases.iter().enumerate().skip(1).map(|(i, c)| (2 * i - 1, request(c))).collect();
    let together = run_all(&mut batched, vec![request(&cases[0])], later);
    let (runner, _) = Runner::open(&artifact, 2, Device::Cpu).unwrap();
    let mut serial = Engine::serial(ModelFacts::of(&artifact), Box::new(runner), load_tokenizer(&artifact).unwrap());
    for (i, (case, got)) in cases.iter().zip(&together).enumerate() {
        let what = format!("{name} case {i}");
        let prompt = ids(&case["input_ids"]);
        let (shape, gold) = golden_logits(name, case);
        let vocab = shape[1];
        assert_eq!(got.logits.len(), prompt.len(), "{what}: a logits row for every prompt position");
        let ours: Vec<f32> = (0..prompt.len()).flat_map(|p| got.logits[&p].clone()).collect();
        assert_logits_close(&format!("{what} batched vs golden"), &ours, &gold);
        let alone = &run_all(&mut serial, vec![request(case)], vec![])[0];
        let single: Vec<f32> = (0..prompt.len()).flat_map(|p| alone.logits[&p].clone()).collect();
        assert_logits_close(&format!("{what} batched vs alone"), &ours, &single);
        assert_eq!(ours.len(), prompt.len() * vocab);
        assert_greedy_prefix(&what, &got.tokens, &ids(&case["greedy_ids"]));
        assert_eq!(got.tokens, alone.tokens, "{what}: greedy ids batched and alone");
        assert_eq!(got.text, alone.text, "{what}: text");
        assert!(got.finished, "{what}");
    }
    let s = batched.stats();
    assert_eq!((s.running, s.waiting, s.kv_blocks_used), (0, 0, 0), "{name}: every block given back: {s:?}");
}

#[test]
fn batched_prompts_match_golden_and_single_stream_on_every_fixture() {
    for name in ["tiny-llama", "tiny-qwen2", "arch-qwen3", "arch-gemma2", "arch-phi3", "arch-granite", "arch-olmo2", "arch-gpt2", "smollm2-135m"] {
        check_batch_against_golden_and_single(name);
    }
}

/// The mixture-of-experts fixtures the same way: the batched engine's steps
/// route each row to its own experts, whatever joins the step.
#[test]
fn batched_mixtures_of_experts_match_golden_and_single_stream() {
    for name in ["arch-qwen3-moe", "arch-mixtral", "arch-gpt-oss"] {
        check_batch_against_golden_and_single(name);
    }
}


/// SmolLM2 as the README's manifest compiles it (Q4_1 blocks, int16
/// activations, f16 KV cache), with `extra` flags.
fn smollm2_default(tag: &str, extra: &[&str]) -> TempPath {
    compile_model(tag, &smollm2_gguf(), extra)
}

const PROMPTS: [&str; 16] = [
    "Once upon a time, there was a little robot",
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "The three primary colors are",
    "In 1969, astronauts",
    "A recipe for pancakes: first,",
    "Photosynthesis is the process by which",
    "The quick brown fox",
    "My favourite book is",
    "Water boils at",
    "List three animals that live in the ocean:",
    "The meaning of life is",
    "To be or not to be,",
    "Rust is a programming language that",
    "The best way to learn a language is",
];

fn tokens(artifact: &Artifact, text: &str) -> Vec<u32> {
    load_tokenizer(artifact).unwrap().encode(text, false).unwrap().get_ids().to_vec()
}

/// Each prompt alone through the serial engine (the single-stream plans).
fn alone(artifact: &Artifact, requests: &[Request]) -> Vec<Outcome> {
    let (runner, _) = Runner::open(artifact, 2, Device::Cpu).unwrap();
    let mut serial = Engine::serial(ModelFacts::of(artifact), Box::new(runner), load_tokenizer(artifact).unwrap());
    requests.iter().map(|r| run_all(&mut serial, vec![r.clone()], vec![]).remove(0)).collect()
}

/// A xorshift stream for arrival and cancellation times.
struct Dice(u64);

impl Dice {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

#[test]
fn sixteen_concurrent_requests_with_random_arrivals_and_cancellations() {
    let mef = smollm2_default("batch-concurrent", &[]);
    let artifact = Artifact::open(&mef).unwrap();
    let requests: Vec<Request> = PROMPTS.iter().enumerate().map(|(i, p)| Request::new(tokens(&artifact, p), greedy(24 + i % 3 * 8, false))).collect();
    let mut dice = Dice(0x5eed);
    let arrivals: Vec<u64> = (0..16).map(|i| if i < 4 { 0 } else { dice.below(40) }).collect();
    // Three requests are cancelled a few steps after they arrive.
    let cancelled: HashMap<usize, u64> = [3usize, 8, 13].iter().map(|&i| (i, arrivals[i] + 2 + dice.below(10))).collect();
    let mut engine = batched(&artifact, None).unwrap();
    let mut ids: HashMap<usize, RequestId> = HashMap::new();
    let mut out: HashMap<RequestId, Outcome> = HashMap::new();
    let mut most_running = 0;
    for step in 0..2_000u64 {
        for (i, r) in requests.iter().enumerate() {
            if arrivals[i] == step {
                ids.insert(i, engine.submit(r.clone()).unwrap());
            }
        }
        for (&i, &at) in &cancelled {
            if at == step {
                assert!(engine.cancel(ids[&i]), "request {i} had finished before its cancellation");
            }
        }
        for e in engine.step().unwrap() {
            match e {
                Event::Token { id, token, .. } => out.entry(id).or_default().tokens.push(token),
                Event::Finished { id, .. } => out.entry(id).or_default().finished = true,
                Event::Logits { .. } | Event::PromptLogprob { .. } => unreachable!("no request asked for prompt logits"),
            }
        }
        most_running = most_running.max(engine.stats().running);
        if step > 40 && !engine.has_work() {
            break;
        }
    }
    assert!(!engine.has_work(), "every request finished or was cancelled");
    assert!(most_running >= 8, "requests ran together (at most {most_running} at once)");
    let single = alone(&artifact, &requests);
    for (i, r) in requests.iter().enumerate() {
        let got = &out[&ids[&i]];
        if cancelled.contains_key(&i) {
            assert!(!got.finished, "request {i} was cancelled: no end follows");
            assert_eq!(got.tokens, single[i].tokens[..got.tokens.len()], "request {i}: tokens before its cancellation");
        } else {
            assert!(got.finished, "request {i}");
            assert_eq!(got.tokens, single[i].tokens, "request {i} ({:?}): batched and alone", PROMPTS[i]);
            assert!(!got.tokens.is_empty() && got.tokens.len() <= r.params.max_tokens);
        }
    }
    let s = engine.stats();
    assert_eq!((s.running, s.waiting, s.kv_blocks_used), (0, 0, 0), "cancelled and finished requests gave their blocks back: {s:?}");
}

/// A sharded artifact (`--devices cpu:0,1`) serves many sequences at once
/// through the mesh executor (the sub-models' batch plans, their collectives
/// counting the step's rows, then its rows with logits): 8 requests submitted
/// together run in the same steps, and each greedy text is the one the mesh
/// gives the request alone through its single-stream plans.
#[test]
fn a_two_device_mesh_serves_eight_sequences_with_their_texts_alone() {
    let mef = smollm2_default("batch-mesh", &["--devices", "cpu:0,1"]);
    let artifact = Artifact::open(&mef).unwrap();
    assert_eq!(artifact.header.sub_models.len(), 2);
    assert!(artifact.header.sub_models.iter().all(|m| m.batch.as_ref().is_some_and(|b| !b.mixed.collectives.is_empty())), "every device's batch plans exchange activations");
    let requests: Vec<Request> = PROMPTS[..8].iter().map(|p| Request::new(tokens(&artifact, p), greedy(24, true))).collect();
    let mut engine = batched(&artifact, None).unwrap();
    assert!(engine.is_batched() && engine.describe().contains("devices: 2"), "{}", engine.describe());
    let ids: Vec<RequestId> = requests.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
    let mut out: HashMap<RequestId, Outcome> = HashMap::new();
    let mut most_running = 0;
    while engine.has_work() {
        for e in engine.step().unwrap() {
            match e {
                Event::Token { id, token, .. } => out.entry(id).or_default().tokens.push(token),
                Event::Finished { id, .. } => out.entry(id).or_default().finished = true,
                Event::Logits { .. } | Event::PromptLogprob { .. } => unreachable!("no request asked for prompt logits"),
            }
        }
        most_running = most_running.max(engine.stats().running);
    }
    assert_eq!(most_running, 8, "the 8 requests ran together");
    let single = alone(&artifact, &requests);
    for (i, id) in ids.iter().enumerate() {
        assert!(out[id].finished);
        assert_eq!(out[id].tokens.len(), 24);
        assert_eq!(out[id].tokens, single[i].tokens, "request {i} ({:?}): on the mesh batched and alone", PROMPTS[i]);
    }
}

/// A sampled request draws, token for token, what its seed draws alone: its
/// logits do not depend on what runs beside it. One sequence decodes through the
/// single-row plan's GEMVs, several through the batch plan's row tiles, so this
/// holds only while those kernels give a row the same bits (on the default
/// int16 artifact; `kernels_llvm::integer_rows_alone_and_in_a_batch_give_the_same_bits`).
/// When they differed in the last bits, about one token in two hundred
/// changed: 768 tokens here.
#[test]
fn sampled_requests_in_a_batch_draw_what_they_draw_alone() {
    let mef = smollm2_default("batch-sampled", &[]);
    let artifact = Artifact::open(&mef).unwrap();
    let sampled = |i: usize| GenerationParams { sampling: SamplingParams { temperature: 1.0, ..SamplingParams::default() }, seed: 40 + i as u64, ..greedy(48, true) };
    let requests: Vec<Request> = PROMPTS.iter().enumerate().map(|(i, p)| Request::new(tokens(&artifact, p), sampled(i))).collect();
    let mut engine = batched(&artifact, None).unwrap();
    let together = run_all(&mut engine, requests.clone(), vec![]);
    let mut texts = std::collections::HashSet::new();
    for (i, r) in requests.iter().enumerate() {
        let alone = run_all(&mut engine, vec![r.clone()], vec![]).remove(0);
        assert_eq!(alone.tokens.len(), 48, "request {i} ignores EOS");
        assert_eq!(together[i].tokens, alone.tokens, "request {i} ({:?}, seed {}): in a batch of 16 and alone", PROMPTS[i], r.params.seed);
        texts.insert(alone.text);
    }
    assert_eq!(texts.len(), 16, "sampling drew 16 different texts");
}

#[test]
fn a_full_kv_pool_preempts_and_the_texts_stay_the_same() {
    // A context of 256 (16 blocks per sequence) and a pool of 20 blocks: six
    // sequences of ~100 tokens need 7 blocks each, so running ones are preempted
    // and compute their tokens again later.
    let mef = smollm2_default("batch-preempt", &["--model-override", "transformer.max_length=256"]);
    let artifact = Artifact::open(&mef).unwrap();
    let h = &artifact.header;
    let per_block = h.batch.unwrap().block_bytes(&h.kv_cache).unwrap() * 2 * h.kv_cache.layers;
    let requests: Vec<Request> = PROMPTS[..6].iter().map(|p| Request::new(tokens(&artifact, p), greedy(90, true))).collect();
    let mut engine = batched(&artifact, Some(20 * per_block)).unwrap();
    assert_eq!(engine.stats().kv_blocks_total, 20);
    let got = run_all(&mut engine, requests.clone(), vec![]);
    assert!(engine.stats().preemptions > 0, "the pool never filled: {:?}", engine.stats());
    let single = alone(&artifact, &requests);
    for (i, (g, s)) in got.iter().zip(&single).enumerate() {
        assert_eq!(g.tokens.len(), 90, "request {i}");
        assert_eq!(g.tokens, s.tokens, "request {i}: preempted and recomputed, batched vs alone");
    }
    // A pool too small for one sequence of the full context is refused.
    let e = batched(&artifact, Some(15 * per_block)).unwrap_err().to_string();
    assert!(e.contains("15 blocks") && e.contains("at least 16"), "{e}");
}

#[test]
fn a_shared_prefix_is_computed_once_and_gives_the_same_logits() {
    let mef = smollm2_default("batch-prefix", &[]);
    let artifact = Artifact::open(&mef).unwrap();
    let text = "The history of the printing press begins in East Asia, where woodblock printing was used for centuries before movable type appeared. ".repeat(12);
    let prefix = tokens(&artifact, &text)[..200].to_vec();
    let first = Request::new([prefix.clone(), tokens(&artifact, " Summarize this.")].concat(), greedy(4, true));
    let second_prompt = [prefix, tokens(&artifact, " In one sentence, what came first?")].concat();
    let second = Request { prompt: second_prompt.clone(), params: greedy(4, true), all_logits: true };
    let mut engine = batched(&artifact, None).unwrap();
    run_all(&mut engine, vec![first], vec![]);
    let before = engine.stats();
    let got = run_all(&mut engine, vec![second.clone()], vec![]).remove(0);
    let after = engine.stats();
    // The first 12 blocks (192 positions) of the 200 shared tokens are cached.
    let cached = 192;
    assert_eq!(after.prompt_rows - before.prompt_rows, (second_prompt.len() - cached) as u64, "only the new positions run");
    assert_eq!(after.prefix_hit_tokens - before.prefix_hit_tokens, cached as u64);
    let mut positions: Vec<usize> = got.logits.keys().copied().collect();
    positions.sort_unstable();
    assert_eq!(positions, (cached..second_prompt.len()).collect::<Vec<_>>(), "logits of the computed positions");
    let single = alone(&artifact, std::slice::from_ref(&second)).remove(0);
    for p in cached..second_prompt.len() {
        assert_logits_close(&format!("position {p}: cached prefix vs alone"), &got.logits[&p], &single.logits[&p]);
    }
    assert_eq!(got.tokens, single.tokens);
}

#[test]
fn the_kv_pool_holds_as_many_tokens_as_its_bytes_allow() {
    // A pool of one full-context sequence's blocks (the least the engine takes):
    // a reservation per sequence at the full context would run one sequence at
    // a time; blocks run all 16 short ones at once.
    let mef = smollm2_default("batch-pool", &[]);
    let artifact = Artifact::open(&mef).unwrap();
    let h = &artifact.header;
    let b = h.batch.unwrap();
    let per_block = b.block_bytes(&h.kv_cache).unwrap() * 2 * h.kv_cache.layers;
    let v = inspect_json(&mef);
    assert_eq!(v["batch"]["kv_bytes_per_block"].as_u64(), Some(per_block), "inspect reports a block's bytes");
    assert_eq!(v["batch"]["block_size"].as_u64(), Some(16));
    let blocks = b.blocks_per_sequence;
    let mut engine = batched(&artifact, Some(blocks * per_block + per_block / 2)).unwrap();
    assert_eq!(engine.stats().kv_blocks_total as u64, blocks, "the pool is as many blocks as its bytes hold");
    let requests: Vec<Request> = PROMPTS.iter().map(|p| Request::new(tokens(&artifact, p), greedy(30, true))).collect();
    for r in &requests {
        engine.submit(r.clone()).unwrap();
    }
    let mut most = 0;
    while engine.has_work() {
        engine.step().unwrap();
        most = most.max(engine.stats().running);
    }
    assert_eq!(most, 16, "every sequence ran at once");
    assert_eq!(engine.stats().preemptions, 0);
}

#[test]
fn requests_queued_together_share_the_prompt_blocks_computed_in_the_same_step() {
    // Three copies of one prompt (a request's `n` choices) queued at once: the
    // first computes the prompt; the others take its full blocks in the step
    // that computes them (each layer stores every row's key and value before
    // any row attends) and compute only the last partial block. Their greedy
    // tokens must equal the prompt's alone: a row reading a block before it is
    // written would not.
    let mef = smollm2_default("batch-choices", &[]);
    let artifact = Artifact::open(&mef).unwrap();
    let text = "The history of the printing press begins in East Asia, where woodblock printing was used for centuries. ".repeat(12);
    let prompt = tokens(&artifact, &text)[..203].to_vec();
    let request = Request::new(prompt.clone(), greedy(12, true));
    let mut engine = batched(&artifact, None).unwrap();
    let ids: Vec<RequestId> = (0..3).map(|_| engine.submit(request.clone()).unwrap()).collect();
    let cached = (prompt.len() - 1) / 16 * 16;
    let tail = prompt.len() - cached;
    let (mut tokens_of, mut usage) = (HashMap::<RequestId, Vec<u32>>::new(), HashMap::new());
    let mut shared_step = false;
    while engine.has_work() {
        let before = engine.stats();
        for e in engine.step().unwrap() {
            match e {
                Event::Token { id, token, .. } => tokens_of.entry(id).or_default().push(token),
                Event::Finished { id, usage: u, .. } => {
                    usage.insert(id, u);
                }
                Event::Logits { .. } | Event::PromptLogprob { .. } => unreachable!(),
            }
        }
        let after = engine.stats();
        // A step that ran the first prompt's last chunk beside the others' tails.
        shared_step |= after.prefix_hit_tokens > before.prefix_hit_tokens && after.prompt_rows - before.prompt_rows > 2 * tail as u64;
    }
    assert_eq!(usage[&ids[0]].cached_tokens, 0);
    for id in &ids[1..] {
        assert_eq!(usage[id].cached_tokens, cached, "choice {id} took the first one's full blocks");
    }
    assert_eq!(engine.stats().prompt_rows, (prompt.len() + 2 * (prompt.len() - cached)) as u64, "the shared blocks ran once");
    assert!(shared_step, "the later choices were admitted in the step that computed their prefix");
    let single = alone(&artifact, std::slice::from_ref(&request)).remove(0);
    for id in &ids {
        assert_eq!(tokens_of[id], single.tokens, "request {id}: sharing and alone");
    }
}

/// The log-probability of `token` under `logits`, in f64.
fn log_softmax_at(logits: &[f32], token: u32) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let lse = logits.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln() + max;
    logits[token as usize] as f64 - lse
}

#[test]
fn prompt_tokens_are_scored_against_the_golden_log_softmax() {
    // `prompt_logprobs` with `max_tokens` 0 (OpenAI's echo for scoring, as
    // evaluation harnesses send it): each prompt token's log-probability given
    // those before it, from the golden logits of the position before; nothing
    // is generated. A copy of the first prompt runs beside it (the scored one
    // must not take its cached prefix: those positions would have no logits).
    for name in ["tiny-llama", "smollm2-135m"] {
        let mef = float32_artifact(name);
        let artifact = Artifact::open(&mef).unwrap();
        let golden = golden(name);
        let mut engines = vec![batched(&artifact, None).unwrap()];
        let (runner, _) = Runner::open(&artifact, 2, Device::Cpu).unwrap();
        engines.push(Engine::serial(ModelFacts::of(&artifact), Box::new(runner), load_tokenizer(&artifact).unwrap()));
        for engine in &mut engines {
            for (i, case) in cases(&golden).iter().enumerate() {
                let what = format!("{name} case {i} ({})", if engine.is_batched() { "batched" } else { "serial" });
                let prompt = ids(&case["input_ids"]);
                let (shape, gold) = golden_logits(name, case);
                let vocab = shape[1];
                let bound = 2.0 * logits_error(&gold, &gold).1 as f64;
                // The same prompt generating first: its blocks enter the prefix
                // cache, which the scored request must not take (it needs every
                // position's logits).
                engine.submit(Request::new(prompt.clone(), greedy(2, true))).unwrap();
                let params = GenerationParams { max_tokens: 0, prompt_logprobs: Some(3), ..GenerationParams::default() };
                let id = engine.submit(Request::new(prompt.clone(), params)).unwrap();
                let (mut scored, mut finished) = (Vec::new(), None);
                while engine.has_work() {
                    for e in engine.step().unwrap() {
                        match e {
                            Event::PromptLogprob { id: got, position, logprob } if got == id => scored.push((position, logprob)),
                            Event::Token { id: got, .. } => assert_ne!(got, id, "{what}: a scored prompt generates nothing"),
                            Event::Finished { id: got, reason, usage, .. } if got == id => finished = Some((reason, usage)),
                            _ => {}
                        }
                    }
                }
                let (reason, usage) = finished.unwrap_or_else(|| panic!("{what}: the request ends"));
                assert_eq!((reason, usage.completion_tokens, usage.prompt_tokens), (maxrun_engine::FinishReason::Length, 0, prompt.len()), "{what}");
                assert_eq!(scored.iter().map(|s| s.0).collect::<Vec<_>>(), (1..prompt.len()).collect::<Vec<_>>(), "{what}: every prompt token after the first, once, in order");
                for (p, lp) in &scored {
                    let row = &gold[(p - 1) * vocab..*p * vocab];
                    let want = log_softmax_at(row, prompt[*p]);
                    assert_eq!(lp.token, prompt[*p]);
                    assert!((lp.logprob as f64 - want).abs() <= bound, "{what} position {p}: {} vs golden {want}", lp.logprob);
                    assert_eq!(lp.top.len(), 3);
                    let best = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                    let best_lp = log_softmax_at(row, row.iter().position(|&x| x == best).unwrap() as u32);
                    assert!((lp.top[0].1 as f64 - best_lp).abs() <= bound, "{what} position {p}: the most likely token's log-probability");
                }
            }
        }
    }
}
