//! `maxrun bench --speculative`: plain decoding against speculative decoding
//! on real prompts (a JSON-lines file such as `../shared/speculation/prompts.jsonl`),
//! in turns, greedy: decode tokens per second of each, their ratio, whether the
//! texts are identical, and the speculation's own figures (drafted and
//! accepted tokens, acceptance rate, mean accepted length, tokens per pass).
//!
//! Plain decoding is the fastest plain path: one sequence through the serial
//! engine's single-stream plans, or with `concurrency > 1` the batched engine
//! without speculation, `concurrency` prompts at a time. Rounds alternate the
//! two (plain first in odd rounds), so both see the same machine.

use std::time::Instant;

use serde::Serialize;

use maxrun_engine::{Engine, EngineError, Event, GenerationParams, Request};

/// One prompt of the benchmark.
#[derive(Clone, Debug)]
pub struct Prompt {
    /// Its group (`input-grounded`, `open-ended`): figures are also given per kind.
    pub kind: String,
    pub ids: Vec<u32>,
}

/// What to run.
#[derive(Clone, Debug)]
pub struct SpeculationBenchConfig {
    pub prompts: Vec<Prompt>,
    /// New tokens per prompt (greedy; an end-of-sequence token ends a reply earlier).
    pub generated_tokens: usize,
    /// Prompts run together.
    pub concurrency: usize,
    /// Rounds of both engines over all the prompts.
    pub rounds: usize,
}

/// One prompt's figures (the mean over rounds).
#[derive(Clone, Debug, Serialize)]
pub struct PromptFigures {
    pub index: usize,
    pub kind: String,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub plain_tokens_per_s: f64,
    pub speculative_tokens_per_s: f64,
    pub speedup: f64,
    /// The two texts are the same tokens.
    pub identical: bool,
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
    /// Verification steps of this prompt's sequence.
    pub passes: u64,
}

/// Figures over a group of prompts.
#[derive(Clone, Debug, Serialize)]
pub struct KindFigures {
    pub kind: String,
    pub prompts: usize,
    /// The mean over the prompts of each one's speedup.
    pub mean_speedup: f64,
    /// Accepted drafts over drafted ones.
    pub acceptance_rate: f64,
    /// Accepted drafts per verification step.
    pub mean_accepted_length: f64,
    /// Tokens per pass of the target over the weights: every generated token
    /// over the steps that gave them (decode steps and verification steps).
    pub tokens_per_pass: f64,
    pub all_identical: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct SpeculationReport {
    pub model: String,
    pub device: String,
    pub method: String,
    pub max_drafts: usize,
    pub concurrency: usize,
    pub rounds: usize,
    pub prompts: Vec<PromptFigures>,
    pub kinds: Vec<KindFigures>,
    /// Aggregate decode tokens/s of all the prompts, each engine.
    pub plain_tokens_per_s: f64,
    pub speculative_tokens_per_s: f64,
}

/// One run of `engine` over the prompts, `concurrency` at a time: per prompt
/// its tokens, decode seconds and (speculating) draft counts; and the
/// aggregate decode rate.
struct Run {
    tokens: Vec<Vec<u32>>,
    seconds: Vec<f64>,
    drafted: Vec<u64>,
    accepted: Vec<u64>,
    passes: Vec<u64>,
    decode_steps: u64,
    aggregate: f64,
}

fn run(engine: &mut Engine<'_>, cfg: &SpeculationBenchConfig) -> Result<Run, EngineError> {
    let n = cfg.prompts.len();
    let params = GenerationParams { max_tokens: cfg.generated_tokens, ..GenerationParams::default() };
    let mut r = Run { tokens: vec![Vec::new(); n], seconds: vec![0.0; n], drafted: vec![0; n], accepted: vec![0; n], passes: vec![0; n], decode_steps: 0, aggregate: 0.0 };
    let (mut decode_tokens, mut decode_time) = (0u64, 0.0f64);
    for group in (0..n).collect::<Vec<_>>().chunks(cfg.concurrency) {
        let mut ids = Vec::new();
        for &p in group {
            ids.push((engine.submit(Request::new(cfg.prompts[p].ids.clone(), params.clone())).map_err(EngineError::Submit)?, p));
        }
        let mut first_tokens = 0;
        while engine.has_work() {
            let before = engine.stats();
            let t = Instant::now();
            let events = engine.step()?;
            let dt = t.elapsed().as_secs_f64();
            let after = engine.stats();
            let tokens = events.iter().filter(|e| matches!(e, Event::Token { .. })).count() as u64;
            // Decode steps: every prompt of the group has its first token, and
            // the step computed no prompt rows.
            if first_tokens == group.len() && after.prompt_rows == before.prompt_rows {
                decode_tokens += tokens;
                decode_time += dt;
                r.decode_steps += 1;
            }
            for e in events {
                match e {
                    Event::Token { id, token, .. } => {
                        let p = ids.iter().find(|x| x.0 == id).expect("submitted here").1;
                        if r.tokens[p].is_empty() {
                            first_tokens += 1;
                        }
                        r.tokens[p].push(token);
                    }
                    Event::Finished { id, usage, .. } => {
                        let p = ids.iter().find(|x| x.0 == id).expect("submitted here").1;
                        r.seconds[p] = usage.decode_seconds;
                        r.drafted[p] += usage.draft_tokens;
                        r.accepted[p] += usage.accepted_tokens;
                        r.passes[p] += usage.verifications;
                    }
                    Event::Logits { .. } | Event::PromptLogprob { .. } => {}
                }
            }
        }
    }
    r.aggregate = if decode_time > 0.0 { decode_tokens as f64 / decode_time } else { 0.0 };
    Ok(r)
}

/// Runs both engines over the prompts in alternating rounds; `method` names
/// the proposer in the report.
pub fn speculation(plain: &mut Engine<'_>, speculative: &mut Engine<'_>, cfg: &SpeculationBenchConfig, model: &str, method: &str) -> Result<SpeculationReport, EngineError> {
    let n = cfg.prompts.len();
    let (mut plain_rate, mut spec_rate) = (vec![0.0; n], vec![0.0; n]);
    let (mut plain_aggregate, mut spec_aggregate) = (0.0, 0.0);
    let mut last: Option<(Run, Run)> = None;
    for round in 0..cfg.rounds.max(1) {
        let (p, s) = if round % 2 == 0 {
            let p = run(plain, cfg)?;
            (p, run(speculative, cfg)?)
        } else {
            let s = run(speculative, cfg)?;
            (run(plain, cfg)?, s)
        };
        for i in 0..n {
            let rate = |r: &Run| if r.seconds[i] > 0.0 { r.tokens[i].len().saturating_sub(1) as f64 / r.seconds[i] } else { 0.0 };
            plain_rate[i] += rate(&p) / cfg.rounds.max(1) as f64;
            spec_rate[i] += rate(&s) / cfg.rounds.max(1) as f64;
        }
        plain_aggregate += p.aggregate / cfg.rounds.max(1) as f64;
        spec_aggregate += s.aggregate / cfg.rounds.max(1) as f64;
        last = Some((p, s));
    }
    let (p, s) = last.expect("one round at least");
    let prompts: Vec<PromptFigures> = (0..n)
        .map(|i| PromptFigures {
            index: i,
            kind: cfg.prompts[i].kind.clone(),
            prompt_tokens: cfg.prompts[i].ids.len(),
            generated_tokens: s.tokens[i].len(),
            plain_tokens_per_s: plain_rate[i],
            speculative_tokens_per_s: spec_rate[i],
            speedup: if plain_rate[i] > 0.0 { spec_rate[i] / plain_rate[i] } else { 0.0 },
            identical: p.tokens[i] == s.tokens[i],
            draft_tokens: s.drafted[i],
            accepted_tokens: s.accepted[i],
            passes: s.passes[i],
        })
        .collect();
    let mut kinds: Vec<String> = Vec::new();
    for f in &prompts {
        if !kinds.contains(&f.kind) {
            kinds.push(f.kind.clone());
        }
    }
    let kinds = kinds
        .into_iter()
        .map(|kind| {
            let mine: Vec<&PromptFigures> = prompts.iter().filter(|f| f.kind == kind).collect();
            let (drafted, accepted, passes) = mine.iter().fold((0u64, 0u64, 0u64), |a, f| (a.0 + f.draft_tokens, a.1 + f.accepted_tokens, a.2 + f.passes));
            // Decode tokens (all but each prompt's first) over the passes that
            // gave them: verification passes give accepted + 1, plain decode
            // steps one each.
            let decoded: u64 = mine.iter().map(|f| f.generated_tokens.saturating_sub(1) as u64).sum();
            let plain_steps = decoded.saturating_sub(accepted + passes);
            KindFigures {
                prompts: mine.len(),
                mean_speedup: mine.iter().map(|f| f.speedup).sum::<f64>() / mine.len() as f64,
                acceptance_rate: if drafted > 0 { accepted as f64 / drafted as f64 } else { 0.0 },
                mean_accepted_length: if passes > 0 { accepted as f64 / passes as f64 } else { 0.0 },
                tokens_per_pass: if passes + plain_steps > 0 { decoded as f64 / (passes + plain_steps) as f64 } else { 0.0 },
                all_identical: mine.iter().all(|f| f.identical),
                kind,
            }
        })
        .collect();
    let config = speculative.speculation().cloned().unwrap_or_default();
    Ok(SpeculationReport {
        model: model.to_string(),
        device: speculative.describe(),
        method: method.to_string(),
        max_drafts: config.max_drafts,
        concurrency: cfg.concurrency,
        rounds: cfg.rounds.max(1),
        prompts,
        kinds,
        plain_tokens_per_s: plain_aggregate,
        speculative_tokens_per_s: spec_aggregate,
    })
}

/// The report as a table: a line per prompt, then per kind.
pub fn render_speculation(r: &SpeculationReport) -> String {
    let mut out = format!(
        "{} | {} | speculative: {} (up to {} drafts) | {} at a time, {} round(s)\n\n| prompt | kind | prompt tok | generated | plain tok/s | speculative tok/s | speedup | drafted | accepted | passes | same text |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n",
        r.model, r.device, r.method, r.max_drafts, r.concurrency, r.rounds
    );
    for p in &r.prompts {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {:.1} | {:.1} | {:.2}x | {} | {} | {} | {} |\n",
            p.index,
            p.kind,
            p.prompt_tokens,
            p.generated_tokens,
            p.plain_tokens_per_s,
            p.speculative_tokens_per_s,
            p.speedup,
            p.draft_tokens,
            p.accepted_tokens,
            p.passes,
            if p.identical { "yes" } else { "NO" }
        ));
    }
    out.push_str("\n| kind | prompts | mean speedup | acceptance | mean accepted length | tokens per pass | all the same text |\n|---|---:|---:|---:|---:|---:|---|\n");
    for k in &r.kinds {
        out.push_str(&format!(
            "| {} | {} | {:.2}x | {:.1}% | {:.2} | {:.2} | {} |\n",
            k.kind,
            k.prompts,
            k.mean_speedup,
            k.acceptance_rate * 100.0,
            k.mean_accepted_length,
            k.tokens_per_pass,
            if k.all_identical { "yes" } else { "NO" }
        ));
    }
    out.push_str(&format!("\naggregate decode: plain {:.1} tok/s, speculative {:.1} tok/s ({:.2}x)\n", r.plain_tokens_per_s, r.speculative_tokens_per_s, if r.plain_tokens_per_s > 0.0 { r.speculative_tokens_per_s / r.plain_tokens_per_s } else { 0.0 }));
    out
}
