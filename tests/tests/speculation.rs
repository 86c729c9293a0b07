//! Speculative decoding end to end (issue #65): prompt lookup's drafts,
//! verified in batch steps of SmolLM2, give exactly the tokens plain decoding
//! gives: greedy over the 34 prompts of `../shared/speculation/prompts.jsonl`
//! (through the chat template) for the README artifact, and for float32,
//! bfloat16 and q8_0 artifacts of the same model, alone and 8 at a time;
//! sampled with seeds, with penalties and with a JSON schema. Plain decoding is
//! the serial engine on the single-stream plans, what `maxrun --prompt` runs.
//! The drafts must actually stand on the prompts that repeat their input.

use std::collections::HashMap;

use maxc_tests::*;
use maxrun_runtime::artifact::Artifact;
use maxrun_engine::speculate::SpeculationConfig;
use maxrun_engine::{load_tokenizer, Engine, Event, GenerationParams, ModelFacts, Request, RequestId, Stats};
use maxrun_runtime::runner::{Device, Runner};
use maxrun_runtime::sampler::SamplingParams;

/// The prompts file's lines: (kind, prompt).
fn prompts() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(fixtures_dir().parent().unwrap().join("speculation/prompts.jsonl")).unwrap();
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["kind"].as_str().unwrap().to_string(), v["prompt"].as_str().unwrap().to_string())
        })
        .collect()
}

/// `prompt` as one user message through the artifact's chat template.
fn chat_ids(a: &Artifact, prompt: &str) -> Vec<u32> {
    let tokenizer = load_tokenizer(a).unwrap();
    let template = std::str::from_utf8(a.section(maxrun_runtime::format::SectionKind::ChatTemplate)).unwrap();
    let text = |id: Option<u32>| id.and_then(|i| tokenizer.id_to_token(i)).unwrap_or_default();
    let (bos, eos) = (text(a.header.tokenizer.bos_token_id), text(a.header.tokenizer.eos_token_ids.first().copied()));
    let rendered = maxrun_runtime::chat::render(template, &[maxrun_runtime::chat::Message::new("user", prompt)], true, &bos, &eos).unwrap();
    tokenizer.encode(rendered.as_str(), false).unwrap().get_ids().to_vec()
}

/// SmolLM2 as the README compiles it (`extra` flags added), for a 1024-token context.
fn smollm2(tag: &str, extra: &[&str]) -> TempPath {
    let out = temp_file(tag, "m.mef");
    let manifest = workspace_root().join("manifests/smollm2-135m.toml");
    let mut args: Vec<&std::ffi::OsStr> = vec!["compile".as_ref(), manifest.as_os_str(), "-o".as_ref(), out.as_os_str(), "--model-override".as_ref(), "transformer.max_length=1024".as_ref()];
    args.extend(extra.iter().map(std::ffi::OsStr::new));
    let (code, _, err) = run_bin("maxc", &args);
    assert_eq!(code, 0, "{err}");
    out
}

/// Runs `requests` through `engine`, `at_once` at a time; each one's tokens.
fn run(engine: &mut Engine<'_>, requests: &[Request], at_once: usize) -> Vec<Vec<u32>> {
    let mut out = vec![Vec::new(); requests.len()];
    for group in (0..requests.len()).collect::<Vec<_>>().chunks(at_once) {
        let ids: HashMap<RequestId, usize> = group.iter().map(|&i| (engine.submit(requests[i].clone()).unwrap(), i)).collect();
        let mut steps = 0;
        while engine.has_work() {
            for e in engine.step().unwrap() {
                if let Event::Token { id, token, .. } = e {
                    out[ids[&id]].push(token);
                }
            }
            steps += 1;
            assert!(steps < 100_000, "the engine does not finish");
        }
    }
    out
}

/// Plain decoding: the serial engine on the single-stream plans.
fn plain(a: &Artifact, requests: &[Request]) -> Vec<Vec<u32>> {
    let (runner, _) = Runner::open(a, 2, Device::Cpu).unwrap();
    let mut engine = Engine::serial(ModelFacts::of(a), Box::new(runner), load_tokenizer(a).unwrap());
    run(&mut engine, requests, 1)
}

/// Speculative decoding with prompt lookup on the batched engine (a 128 MiB KV pool).
fn speculative(a: &Artifact, requests: &[Request], at_once: usize) -> (Vec<Vec<u32>>, Stats) {
    let (executor, _) = maxrun_runtime::runner::open_executor(a, 2, Device::Cpu, Some(128 << 20)).unwrap();
    let mut engine = Engine::batched(ModelFacts::of(a), executor, load_tokenizer(a).unwrap());
    engine.speculate(SpeculationConfig::default()).unwrap();
    let out = run(&mut engine, requests, at_once);
    (out, engine.stats())
}

/// Greedy requests of `max_tokens` for the prompts, through the chat template.
fn greedy(a: &Artifact, prompts: &[(String, String)], max_tokens: usize) -> Vec<Request> {
    prompts.iter().map(|(_, p)| Request::new(chat_ids(a, p), GenerationParams { max_tokens, ..GenerationParams::default() })).collect()
}

fn same(what: &str, prompts: &[(String, String)], want: &[Vec<u32>], got: &[Vec<u32>]) {
    for (i, ((kind, _), (w, g))) in prompts.iter().zip(want.iter().zip(got)).enumerate() {
        let first = w.iter().zip(g).position(|(x, y)| x != y);
        assert!(w == g, "{what}: prompt {i} ({kind}) differs from plain decoding at token {first:?} of {} / {}", w.len(), g.len());
    }
}

/// The README artifact, every prompt, greedy: the same tokens alone and 8 at a
/// time as plain decoding; drafts stand on the input-grounded prompts (most of
/// their tokens come from them) and the open-ended ones still finish the same.
#[test]
fn greedy_text_with_prompt_lookup_is_plain_decodings() {
    let mef = smollm2("spec-readme", &[]);
    let a = Artifact::open(&mef).unwrap();
    let prompts = prompts();
    assert_eq!(prompts.len(), 34);
    let requests = greedy(&a, &prompts, 48);
    let want = plain(&a, &requests);
    let (alone, stats) = speculative(&a, &requests, 1);
    same("alone", &prompts, &want, &alone);
    assert!(stats.accepted_tokens * 4 > stats.draft_tokens, "drafts stand: {stats:?}");
    let generated: usize = want.iter().map(Vec::len).sum();
    eprintln!("{} tokens: {} drafted, {} accepted, {} verifications", generated, stats.draft_tokens, stats.accepted_tokens, stats.verifications);
    let (eight, stats) = speculative(&a, &requests, 8);
    same("8 at a time", &prompts, &want, &eight);
    assert!(stats.accepted_tokens > 0, "{stats:?}");
}

/// float32, bfloat16 and q8_0 weights: a third of the prompts, greedy, alone
/// and 8 at a time.
#[test]
fn greedy_text_is_plain_decodings_for_float_and_q8_0_weights() {
    let prompts: Vec<(String, String)> = prompts().into_iter().step_by(3).collect();
    for encoding in ["float32", "bfloat16", "q8_0"] {
        let mef = smollm2(&format!("spec-{encoding}"), &["--quantization-encoding", encoding]);
        let a = Artifact::open(&mef).unwrap();
        let requests = greedy(&a, &prompts, 32);
        let want = plain(&a, &requests);
        let (alone, stats) = speculative(&a, &requests, 1);
        same(&format!("{encoding}, alone"), &prompts, &want, &alone);
        assert!(stats.accepted_tokens > 0, "{encoding}: {stats:?}");
        let (eight, _) = speculative(&a, &requests, 8);
        same(&format!("{encoding}, 8 at a time"), &prompts, &want, &eight);
    }
}

/// Sampled requests draw what they draw without speculation, token for token
/// (the same seeds, the same logits, one random draw per token): temperature
/// with top-p, a repetition penalty, and a JSON schema the reply must match.
#[test]
fn sampled_text_with_prompt_lookup_is_plain_samplings() {
    let mef = smollm2("spec-sampled", &[]);
    let a = Artifact::open(&mef).unwrap();
    let prompts: Vec<(String, String)> = prompts().into_iter().take(6).collect();
    let schema = serde_json::json!({"type": "object", "properties": {"answer": {"type": "string", "maxLength": 80}}, "required": ["answer"]});
    let mut requests = Vec::new();
    for (i, (_, p)) in prompts.iter().enumerate() {
        let sampling = SamplingParams { temperature: 0.8, top_p: 0.9, ..SamplingParams::default() };
        let mut params = GenerationParams { sampling, seed: 7 + i as u64, max_tokens: 40, ..GenerationParams::default() };
        match i % 3 {
            1 => params.repeat_penalty = Some(1.3),
            2 => params.grammar = Some(maxrun_engine::constrain::Grammar::JsonSchema(schema.clone())),
            _ => {}
        }
        requests.push(Request::new(chat_ids(&a, p), params));
    }
    let want = plain(&a, &requests);
    let (alone, _) = speculative(&a, &requests, 1);
    same("sampled, alone", &prompts, &want, &alone);
    let (together, _) = speculative(&a, &requests, 6);
    same("sampled, 6 at a time", &prompts, &want, &together);
}

/// The CLI: `maxrun --prompt --speculative ngram` prints plain decoding's text
/// and its figures; bad settings are refused by name before any work.
#[test]
fn the_cli_speculates_and_refuses_bad_settings() {
    let mef = smollm2("spec-cli", &[]);
    let prompt = prompts()[0].1.clone();
    let base = |extra: &[&str]| -> (i32, String, String) {
        let mut args: Vec<&std::ffi::OsStr> = vec![mef.as_os_str(), "--prompt".as_ref(), prompt.as_ref(), "-n".as_ref(), "40".as_ref(), "--temperature".as_ref(), "0".as_ref(), "--no-stream".as_ref()];
        args.extend(extra.iter().map(std::ffi::OsStr::new));
        run_bin("maxrun", &args)
    };
    let (code, want, err) = base(&[]);
    assert_eq!(code, 0, "{err}");
    let (code, got, err) = base(&["--speculative", "ngram"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(got, want, "the same text");
    assert!(err.contains("speculative:") && err.contains("accepted"), "{err}");
    for (flags, needles) in [
        (vec!["--speculative", "eagle"], vec!["--speculative", "eagle", "ngram"]),
        (vec!["--speculative", "ngram", "--draft-tokens", "0"], vec!["--draft-tokens 0", "1 to 15"]),
        (vec!["--speculative", "ngram", "--ngram", "5..2"], vec!["--ngram", "min <= max"]),
        (vec!["--speculative", "ngram", "--ngram", "three"], vec!["--ngram", "MIN..MAX"]),
    ] {
        assert_clean_error(&base(&flags), 1, &needles);
    }
}

/// Samples of `n` requests for `prompt` (temperature 1, 3 tokens, seeds from
/// `seed0`) through `engine`, 16 at a time; each sample's tokens.
fn samples(engine: &mut Engine<'_>, prompt: &[u32], n: usize, seed0: u64) -> Vec<Vec<u32>> {
    let requests: Vec<Request> = (0..n as u64)
        .map(|s| {
            let sampling = SamplingParams { temperature: 1.0, ..SamplingParams::default() };
            Request::new(prompt.to_vec(), GenerationParams { sampling, seed: seed0 + s, max_tokens: 3, ignore_eos: true, ..GenerationParams::default() })
        })
        .collect();
    run(engine, &requests, 16)
}

/// The two-sample chi-square test of homogeneity of the tokens at `position`
/// in `a` and `b`: bins of the tokens seen, the rare ones pooled so that every
/// bin expects at least 5 of each sample; its p-value.
fn homogeneity(a: &[Vec<u32>], b: &[Vec<u32>], position: usize) -> f64 {
    use statrs::distribution::{ChiSquared, ContinuousCDF};
    let count = |s: &[Vec<u32>]| {
        let mut m: HashMap<u32, f64> = HashMap::new();
        for x in s {
            *m.entry(x[position]).or_default() += 1.0;
        }
        m
    };
    let (ca, cb) = (count(a), count(b));
    let (na, nb) = (a.len() as f64, b.len() as f64);
    let mut tokens: Vec<u32> = ca.keys().chain(cb.keys()).copied().collect();
    tokens.sort_unstable();
    tokens.dedup();
    // Bins: tokens in order, merged until each bin's total expects >= 5 per sample.
    let mut bins: Vec<(f64, f64)> = Vec::new();
    let mut open = (0.0, 0.0);
    let least = 5.0 * (na + nb) / na.min(nb);
    for t in tokens {
        open.0 += ca.get(&t).copied().unwrap_or(0.0);
        open.1 += cb.get(&t).copied().unwrap_or(0.0);
        if open.0 + open.1 >= least {
            bins.push(open);
            open = (0.0, 0.0);
        }
    }
    match bins.last_mut() {
        Some(last) => {
            last.0 += open.0;
            last.1 += open.1;
        }
        None => bins.push(open),
    }
    if bins.len() < 2 {
        return 1.0;
    }
    let mut x2 = 0.0;
    for &(oa, ob) in &bins {
        let total = oa + ob;
        let (ea, eb) = (total * na / (na + nb), total * nb / (na + nb));
        x2 += (oa - ea).powi(2) / ea + (ob - eb).powi(2) / eb;
    }
    1.0 - ChiSquared::new((bins.len() - 1) as f64).unwrap().cdf(x2)
}

/// Sampling keeps the target's distribution with a draft model that is
/// rarely right: `arch-qwen3` as the target and `arch-olmo2` as the draft (two
/// random models of one 1024-token vocabulary), 20k samples of the first three
/// tokens at temperature 1 with speculation against 20k without (other
/// seeds), each position's tokens equal in distribution by a chi-square test
/// at p > 0.001; the same test fails a scheme that keeps every draft unchecked.
#[test]
fn speculative_sampling_keeps_the_distribution() {
    let target_mef = compile_model("spec-qwen3", &fixture("arch-qwen3"), &["--max-sequences", "16"]);
    let draft_mef = compile_model("spec-olmo2", &fixture("arch-olmo2"), &["--max-sequences", "16"]);
    let (target, draft) = (Artifact::open(&target_mef).unwrap(), Artifact::open(&draft_mef).unwrap());
    let prompt = ids(&cases(&golden("arch-qwen3"))[0]["input_ids"]);
    const N: usize = 20_000;
    let engine = |config: Option<SpeculationConfig>| {
        let (executor, _) = maxrun_runtime::runner::open_executor(&target, 2, Device::Cpu, Some(64 << 20)).unwrap();
        let mut e = Engine::batched(ModelFacts::of(&target), executor, load_tokenizer(&target).unwrap());
        if let Some(c) = config {
            let model = maxrun_engine::draft::DraftModel::of(maxrun_runtime::runner::open_draft_executor(&target, &draft, 2, Device::Cpu, Some(64 << 20)).unwrap());
            e.speculate_with_draft(c, model).unwrap();
        }
        e
    };
    let plain = samples(&mut engine(None), &prompt, N, 0);
    // Always 2 drafts (the most three tokens leave), however rarely they stand.
    let config = SpeculationConfig { max_drafts: 2, row_cost: 0.0, ..SpeculationConfig::default() };
    let mut spec_engine = engine(Some(config.clone()));
    let speculative = samples(&mut spec_engine, &prompt, N, N as u64);
    let stats = spec_engine.stats();
    eprintln!("drafted {}, accepted {} ({:.2}%)", stats.draft_tokens, stats.accepted_tokens, 100.0 * stats.accepted_tokens as f64 / stats.draft_tokens.max(1) as f64);
    assert!(stats.draft_tokens > N as u64 / 2, "drafts were verified: {stats:?}");
    let broken = samples(&mut engine(Some(SpeculationConfig { accept_unchecked: true, ..config })), &prompt, N, 2 * N as u64);
    for position in 0..3 {
        let p = homogeneity(&plain, &speculative, position);
        eprintln!("token {position}: p = {p:.4} with speculation, {:.3e} unchecked", homogeneity(&plain, &broken, position));
        assert!(p > 1e-3, "token {position}: speculative sampling's distribution differs from plain sampling's (p = {p})");
    }
    let worst = (1..3).map(|pos| homogeneity(&plain, &broken, pos)).fold(1.0, f64::min);
    assert!(worst < 1e-3, "the test cannot tell a scheme that keeps every draft (p = {worst})");
}
