//! The engine's pieces against the tokenizers of the fixtures: streamed text
//! reassembles to the tokenizer's own decode of the whole reply (the oracle),
//! stop strings cut it where `str::find` says, and nothing past a stop string
//! is ever handed out.

use maxc_tests::*;
use maxrun_engine::text::{TextOptions, TextStream};

fn tokenizer(name: &str) -> tokenizers::Tokenizer {
    tokenizers::Tokenizer::from_file(fixture(name).join("tokenizer.json")).unwrap()
}

/// Every golden reply of a fixture, as token ids.
fn replies(name: &str) -> Vec<Vec<u32>> {
    cases(&golden(name)).iter().map(|c| ids(&c["greedy_ids"])).collect()
}

#[test]
fn streamed_text_is_the_decode_of_the_whole_reply() {
    // A byte-level BPE vocabulary of 49152 (tiny-llama's is SmolLM2's) and the
    // arch fixtures' 1024-token one, whose greedy texts split characters.
    for name in ["tiny-llama", "arch-gemma2", "arch-gpt2", "arch-phi3"] {
        let tok = tokenizer(name);
        for ids in replies(name) {
            let mut stream = TextStream::new(vec![], TextOptions::default());
            let mut streamed = String::new();
            for &id in &ids {
                stream.push(&tok, id).unwrap();
                let piece = stream.take();
                assert!(!piece.contains('\u{FFFD}') || tok.decode(&ids, false).unwrap().contains('\u{FFFD}'), "{name}: half a character handed out");
                streamed.push_str(&piece);
            }
            streamed.push_str(&stream.finish(&tok).unwrap());
            assert_eq!(streamed, tok.decode(&ids, false).unwrap(), "{name}: {ids:?}");
        }
    }
}

#[test]
fn a_stop_string_ends_the_text_before_it() {
    let tok = tokenizer("tiny-llama");
    for ids in replies("tiny-llama") {
        let full = tok.decode(&ids, false).unwrap();
        // A stop string from the middle of the reply, three characters long.
        let chars: Vec<char> = full.chars().collect();
        let mid = chars.len() / 2;
        let stop: String = chars[mid..mid + 3].iter().collect();
        let want = &full[..full.find(&stop).unwrap()];
        let mut stream = TextStream::new(vec!["never appears".into(), stop.clone()], TextOptions::default());
        let mut streamed = String::new();
        for &id in &ids {
            stream.push(&tok, id).unwrap();
            streamed.push_str(&stream.take());
            assert!(!streamed.contains(&stop), "handed out the stop string {stop:?}: {streamed:?}");
            if stream.stopped() {
                break;
            }
        }
        assert!(stream.stopped(), "{stop:?} in {full:?}");
        streamed.push_str(&stream.finish(&tok).unwrap());
        assert_eq!(streamed, want);
        assert_eq!(stream.text(), want);
    }
}

#[test]
fn a_kept_stop_string_ends_the_text_after_it() {
    // vLLM's include_stop_str_in_output / SGLang's no_stop_trim: the reply ends
    // with the earliest stop string, which is part of it.
    let tok = tokenizer("tiny-llama");
    let keep = TextOptions { keep_stop: true, ..TextOptions::default() };
    for ids in replies("tiny-llama") {
        let full = tok.decode(&ids, false).unwrap();
        let chars: Vec<char> = full.chars().collect();
        let mid = chars.len() / 3;
        let stop: String = chars[mid..mid + 4].iter().collect();
        let want = &full[..full.find(&stop).unwrap() + stop.len()];
        let mut stream = TextStream::new(vec!["never appears".into(), stop.clone()], keep);
        let mut streamed = String::new();
        for &id in &ids {
            stream.push(&tok, id).unwrap();
            streamed.push_str(&stream.take());
            if stream.stopped() {
                break;
            }
        }
        assert!(stream.stopped(), "{stop:?} in {full:?}");
        streamed.push_str(&stream.finish(&tok).unwrap());
        assert_eq!(streamed, want, "stop {stop:?} in {full:?}");
        assert_eq!(stream.text(), want);
    }
}

#[test]
fn skipped_special_tokens_give_no_text() {
    // The decode of the tokenizers library with skip_special_tokens, streamed
    // token by token; without the option the special tokens' text is there.
    let tok = tokenizer("tiny-llama");
    let ids = tok.encode("Hello there<|im_end|>\n<|im_start|>assistant\nHi", false).unwrap().get_ids().to_vec();
    let skipped = tok.decode(&ids, true).unwrap();
    let kept = tok.decode(&ids, false).unwrap();
    assert!(kept.contains("<|im_start|>") && !skipped.contains("<|im_start|>"), "{kept:?} / {skipped:?}");
    for (options, want) in [(TextOptions { skip_special_tokens: true, ..TextOptions::default() }, &skipped), (TextOptions::default(), &kept)] {
        let mut stream = TextStream::new(vec![], options);
        let mut streamed = String::new();
        for &id in &ids {
            stream.push(&tok, id).unwrap();
            streamed.push_str(&stream.take());
        }
        streamed.push_str(&stream.finish(&tok).unwrap());
        assert_eq!(&streamed, want, "{options:?}");
    }
}

/// The engine over a fake executor: a device whose "model" makes each next
/// token a hash of every token before it, read back through the step's block
/// tables from a tiny paged KV pool (a token and its position per slot), with
/// random step latencies. A wrong block table, slot, reused prefix block or
/// recomputation after a preemption reads the wrong tokens and changes the
/// output, which the test computes on its own from the prompts alone.
mod fake_executor {
    use std::collections::HashMap;

    use maxrun_engine::{Engine, Event, GenerationParams, ModelFacts, Request, RequestId};
    use maxrun_runtime::executor::{BatchStep, Executor, PoolLimits, RunError};

    const VOCAB: u64 = 512;

    thread_local! {
        static WINDOW: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    }

    /// The fake model: the next token after `tokens` (never token 0), a hash
    /// of every token before it, or with `WINDOW` set (speculation's scenario)
    /// of the last few only, so that replies repeat themselves and prompt
    /// lookup's drafts are sometimes right (its tokens then come from a few).
    fn next_token(tokens: &[u32]) -> u32 {
        let window = WINDOW.with(|w| w.get());
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &t in &tokens[tokens.len() - window.unwrap_or(tokens.len()).min(tokens.len())..] {
            h = (h ^ t as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
        // Replies of a windowed model fall into short cycles over a few tokens.
        let range = if window.is_some() { 13 } else { VOCAB - 1 };
        1 + (h % range) as u32
    }

    struct Fake {
        limits: PoolLimits,
        /// Per slot: the token and position stored there by the last step that wrote it.
        slots: Vec<Option<(u32, u32)>>,
        logits: Vec<f32>,
        rng: u64,
        steps: usize,
        max_rows_seen: usize,
    }

    impl Fake {
        fn random(&mut self) -> u64 {
            self.rng ^= self.rng << 13;
            self.rng ^= self.rng >> 7;
            self.rng ^= self.rng << 17;
            self.rng
        }
    }

    impl Executor for Fake {
        fn limits(&self) -> PoolLimits {
            self.limits
        }

        fn step(&mut self, step: &BatchStep<'_>) -> Result<&[f32], RunError> {
            let l = self.limits;
            assert!(step.rows() <= l.max_rows && step.logit_rows.len() <= l.max_logit_rows, "the step is within the plan's limits");
            assert_eq!(step.block_tables.len() % l.blocks_per_sequence, 0);
            self.steps += 1;
            self.max_rows_seen = self.max_rows_seen.max(step.rows());
            // Every row's key and value are stored before any row attends, as the kernels do.
            for r in 0..step.rows() {
                let (slot, seq, pos) = (step.slots[r] as usize, step.row_sequences[r] as usize, step.positions[r] as usize);
                let table = &step.block_tables[seq * l.blocks_per_sequence..][..l.blocks_per_sequence];
                assert_eq!(slot, table[pos / l.block_size] as usize * l.block_size + pos % l.block_size, "row {r}'s slot follows its block table");
                assert!((table[pos / l.block_size] as usize) < l.blocks, "a block of the pool");
                self.slots[slot] = Some((step.tokens[r] as u32, pos as u32));
            }
            self.logits.clear();
            for &r in step.logit_rows {
                let (seq, pos) = (step.row_sequences[r as usize] as usize, step.positions[r as usize] as usize);
                let table = &step.block_tables[seq * l.blocks_per_sequence..][..l.blocks_per_sequence];
                // "Attention": the sequence's tokens at positions 0..=pos, read through its table.
                let seen: Vec<u32> = (0..=pos)
                    .map(|p| {
                        let slot = table[p / l.block_size] as usize * l.block_size + p % l.block_size;
                        match self.slots[slot] {
                            Some((token, at)) if at as usize == p => token,
                            // A slot that holds another position: the output shows it.
                            _ => 0,
                        }
                    })
                    .collect();
                let mut row = vec![0.0f32; VOCAB as usize];
                row[next_token(&seen) as usize] = 10.0;
                self.logits.extend(row);
            }
            let pause = self.random() % 1500;
            std::thread::sleep(std::time::Duration::from_micros(pause));
            Ok(&self.logits)
        }

        fn threads(&self) -> usize {
            1
        }

        fn describe(&self) -> String {
            "fake".into()
        }
    }

    /// The tokens a request generates, from its prompt alone.
    fn expected(prompt: &[u32], n: usize) -> Vec<u32> {
        let mut tokens = prompt.to_vec();
        for _ in 0..n {
            tokens.push(next_token(&tokens));
        }
        tokens[prompt.len()..].to_vec()
    }

    fn tokenizer() -> tokenizers::Tokenizer {
        tokenizers::Tokenizer::from_file(maxc_tests::fixture("arch-gpt2").join("tokenizer.json")).unwrap()
    }

    #[test]
    fn preemption_cancellation_and_prefix_reuse_through_a_fake_executor() {
        let stats = scenario(None);
        assert_eq!(stats.draft_tokens, 0);
    }

    /// The same with prompt-lookup speculation, over a model whose replies
    /// repeat (each token a hash of the last one, among 13): every request still gets
    /// exactly the tokens it gets without speculation, through drafts that
    /// stand and drafts that are rejected (their KV rolled back), preemptions
    /// and cancellations. Accepting a draft without checking it, or keeping a
    /// rejected draft's position, changes the tokens.
    #[test]
    fn speculation_gives_the_same_tokens_through_a_fake_executor() {
        WINDOW.with(|w| w.set(Some(1)));
        let stats = scenario(Some(maxrun_engine::speculate::SpeculationConfig { max_drafts: 3, min_n: 1, max_n: 3, row_cost: 0.0, max_step_drafts: 8, ..Default::default() }));
        assert!(stats.accepted_tokens > 0 && stats.accepted_tokens < stats.draft_tokens, "drafts stand and fall: {stats:?}");
        assert!(stats.verifications > 0);
    }

    /// Random arrivals, cancellations and a pool too small for all of them at
    /// once; every request's tokens checked against the fake model's own.
    fn scenario(speculation: Option<maxrun_engine::speculate::SpeculationConfig>) -> maxrun_engine::Stats {
        let block_size = 4;
        // 24 blocks of 4 positions: fewer than the requests below need at
        // once, so decode rows preempt; a sequence may hold 16 blocks (64 positions).
        let limits = PoolLimits { block_size, blocks_per_sequence: 16, blocks: 24, max_rows: 24, max_sequences: 6, max_logit_rows: 6 };
        let fake = Fake { limits, slots: vec![None; 24 * block_size], logits: vec![], rng: 0x9e37_79b9_7f4a_7c15, steps: 0, max_rows_seen: 0 };
        let facts = ModelFacts { vocab_size: VOCAB, max_length: 64, eos_token_ids: vec![0], tokenizer_json: None };
        let mut engine = Engine::batched(facts, Box::new(fake), tokenizer());
        if let Some(config) = speculation {
            engine.speculate(config).unwrap();
        }
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut random = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        // Prompts sharing a 12-token system prefix (three blocks), some of them
        // twice, of 13-30 tokens, each asking for 8-24 tokens.
        let prefix: Vec<u32> = (0..12).map(|i| 100 + i).collect();
        let requests: Vec<(Vec<u32>, usize)> = (0..20)
            .map(|i| {
                let own = 1 + random(18) as usize;
                let body: Vec<u32> = (0..own).map(|j| (1 + (i % 7) * 31 + j as u64 * 3) as u32 % VOCAB as u32).collect();
                ([prefix.clone(), body].concat(), 8 + random(17) as usize)
            })
            .collect();
        let params = |n| GenerationParams { max_tokens: n, ignore_eos: true, ..GenerationParams::default() };
        let mut ids: HashMap<RequestId, usize> = HashMap::new();
        let mut tokens: HashMap<usize, Vec<u32>> = HashMap::new();
        let mut finished: Vec<usize> = Vec::new();
        let mut cancelled: Vec<usize> = Vec::new();
        // The finished requests' own speculation counts: drafted, accepted, verifications.
        let mut usage = (0u64, 0u64, 0u64);
        let mut next = 0;
        let mut steps = 0;
        while next < requests.len() || engine.has_work() {
            // Arrivals: up to three per step, at random.
            for _ in 0..random(4) {
                if next < requests.len() {
                    let (prompt, n) = &requests[next];
                    ids.insert(engine.submit(Request::new(prompt.clone(), params(*n))).unwrap(), next);
                    next += 1;
                }
            }
            // A cancellation now and then, of a request in flight.
            if random(9) == 0 {
                if let Some((&id, &index)) = ids.iter().filter(|(_, i)| !finished.contains(i) && !cancelled.contains(i)).min_by_key(|(id, _)| **id) {
                    assert!(engine.cancel(id));
                    cancelled.push(index);
                }
            }
            for event in engine.step().unwrap() {
                match event {
                    Event::Token { id, token, .. } => tokens.entry(ids[&id]).or_default().push(token),
                    Event::Finished { id, usage: u, .. } => {
                        assert!(u.accepted_tokens <= u.draft_tokens && u.verifications <= u.draft_tokens, "request {}: {u:?}", ids[&id]);
                        usage = (usage.0 + u.draft_tokens, usage.1 + u.accepted_tokens, usage.2 + u.verifications);
                        finished.push(ids[&id]);
                    }
                    Event::Logits { .. } | Event::PromptLogprob { .. } => unreachable!("not asked for"),
                }
            }
            steps += 1;
            assert!(steps < 5000, "the engine does not finish");
        }
        assert!(!cancelled.is_empty(), "the test cancels some requests");
        for (i, (prompt, n)) in requests.iter().enumerate() {
            let got = tokens.get(&i).cloned().unwrap_or_default();
            if cancelled.contains(&i) {
                assert!(!finished.contains(&i), "request {i} was cancelled and did not finish");
                assert_eq!(got, expected(prompt, *n)[..got.len()], "request {i}: what came before its cancellation");
            } else {
                assert!(finished.contains(&i), "request {i} finished");
                assert_eq!(got, expected(prompt, *n), "request {i}");
            }
        }
        let stats = engine.stats();
        assert!(stats.preemptions > 0, "the tiny pool preempts: {stats:?}");
        assert!(stats.prefix_hit_tokens >= 12, "the shared prefix is reused: {stats:?}");
        assert_eq!(stats.kv_blocks_used, 0, "every block is given back (cached ones stay evictable): {stats:?}");
        assert_eq!(stats.running + stats.waiting, 0, "nothing left in flight");
        // Each request reports its own drafts: together no more than the
        // engine's (cancelled requests report none), and some where it drafted.
        assert!(usage.0 <= stats.draft_tokens && usage.1 <= stats.accepted_tokens && usage.2 <= stats.verifications, "{usage:?} against {stats:?}");
        assert_eq!(usage.0 > 0, stats.draft_tokens > 0, "{usage:?} against {stats:?}");
        stats
    }
}
