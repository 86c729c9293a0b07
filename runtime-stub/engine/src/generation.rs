//! One request's generation: its sampling parameters and penalties, the
//! sampler's random state, its end conditions (an end-of-sequence token, a stop
//! string, the token limit, the artifact's context) and its text. Every way of
//! running an artifact (`maxrun --prompt`, `--chat`, `bench`, the server, one
//! sequence or many in a batch) drives a [`Generation`] per request, so they
//! all mean the same by each parameter.

use std::collections::{HashMap, VecDeque};

use tokenizers::Tokenizer;

use super::text::{DecodeError, TextOptions, TextStream};
use crate::constrain::{Constraint, Grammar};
use maxrun_runtime::sampler::{sample, Rng, SamplingParams};

/// How many of the latest tokens (prompt included) the repeat penalty looks at,
/// as llama.cpp's `--repeat-last-n` default.
pub const REPEAT_WINDOW: usize = 64;

/// What a request asks of its generation.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationParams {
    pub sampling: SamplingParams,
    pub seed: u64,
    /// New tokens at most (the end-of-sequence token included).
    pub max_tokens: usize,
    /// The reply ends before the first of these (which is not part of it).
    pub stop: Vec<String>,
    /// Never pick an end-of-sequence token.
    pub ignore_eos: bool,
    /// Divides the positive logits (multiplies the negative ones) of the last
    /// [`REPEAT_WINDOW`] tokens by this, as llama.cpp's `--repeat-penalty`.
    pub repeat_penalty: Option<f32>,
    /// OpenAI's penalties over the generated tokens: each logit loses
    /// `frequency * count + presence * (count > 0)`.
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// Report the chosen token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
    /// Report each prompt token's log-probability (given the tokens before it)
    /// and this many alternatives; the prompt then takes no cached prefix.
    /// With `max_tokens` 0 the request only scores its prompt.
    pub prompt_logprobs: Option<usize>,
    /// Added to these tokens' logits before sampling (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    /// The grammar the reply must match (structured output).
    pub grammar: Option<Grammar>,
    /// Whether the stop string stays in the text and special tokens give text.
    pub text: TextOptions,
}

impl Default for GenerationParams {
    fn default() -> Self {
        GenerationParams {
            sampling: SamplingParams::default(),
            seed: 0,
            max_tokens: 128,
            stop: vec![],
            ignore_eos: false,
            repeat_penalty: None,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logprobs: None,
            prompt_logprobs: None,
            logit_bias: vec![],
            grammar: None,
            text: TextOptions::default(),
        }
    }
}

/// Why a reply ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// The token limit or the artifact's maximum context.
    Length,
    /// The client went away or the request was cancelled.
    Cancelled,
}

impl FinishReason {
    /// OpenAI's `finish_reason`.
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// A token's log-probability under the model (before penalties and sampling
/// filters, as OpenAI reports them) and the most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// What one step of a generation produced.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// Text that became visible with this token (may be empty).
    pub text: String,
    pub logprob: Option<TokenLogprob>,
    /// Set when the reply ends with this token.
    pub finish: Option<FinishReason>,
}

/// One request's generation state.
#[derive(Debug)]
pub struct Generation {
    params: GenerationParams,
    rng: Rng,
    text: TextStream,
    generated: Vec<u32>,
    recent: VecDeque<u32>,
    counts: HashMap<u32, u32>,
    prompt_tokens: usize,
    eos: Vec<u32>,
    /// New tokens allowed: the request's limit, or what the context leaves.
    limit: usize,
    row: Vec<f32>,
    finished: Option<FinishReason>,
    constraint: Option<Constraint>,
    /// Why the grammar could not go on, when it could not.
    constraint_error: Option<String>,
}

impl Generation {
    /// A generation after `prompt`, for an artifact whose end-of-sequence tokens
    /// are `eos` and whose context holds `max_length` positions.
    pub fn new(prompt: &[u32], params: GenerationParams, eos: &[u32], max_length: usize) -> Generation {
        let recent = prompt.iter().rev().take(REPEAT_WINDOW).rev().copied().collect();
        let limit = params.max_tokens.min(max_length.saturating_sub(prompt.len()));
        // Nothing to generate ends at once, unless the prompt is to be scored.
        let finished = if limit == 0 && params.prompt_logprobs.is_none() { Some(FinishReason::Length) } else { None };
        Generation {
            rng: Rng::new(params.seed),
            text: TextStream::new(params.stop.clone(), params.text),
            params,
            generated: Vec::new(),
            recent,
            counts: HashMap::new(),
            prompt_tokens: prompt.len(),
            eos: eos.to_vec(),
            limit,
            row: Vec::new(),
            finished,
            constraint: None,
            constraint_error: None,
        }
    }

    /// Holds the reply to `constraint` (built from the params' grammar by the engine).
    pub fn with_constraint(mut self, constraint: Constraint) -> Generation {
        self.constraint = Some(constraint);
        self
    }

    /// The grammar state, for the engine to compute the next mask ahead.
    pub fn constraint_mut(&mut self) -> Option<&mut Constraint> {
        self.constraint.as_mut().filter(|_| self.finished.is_none())
    }

    /// Why the grammar stopped the reply early, if it did (an llguidance error).
    pub fn constraint_error(&self) -> Option<&str> {
        self.constraint_error.as_deref()
    }

    pub fn params(&self) -> &GenerationParams {
        &self.params
    }

    /// Tokens generated so far (an end-of-sequence token included).
    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// Why the reply ended, once it has.
    pub fn finished(&self) -> Option<FinishReason> {
        self.finished
    }

    /// Whether the artifact's context, not the request's limit, ended the reply.
    pub fn hit_context(&self) -> bool {
        self.finished == Some(FinishReason::Length) && self.limit < self.params.max_tokens
    }

    /// New tokens it may generate in all (its limit, or what the context leaves).
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Whether the request takes no new token (a prompt scored, nothing generated).
    pub fn generates_nothing(&self) -> bool {
        self.limit == 0
    }

    /// Ends a request that generates nothing once its prompt ran.
    pub fn end_at_limit(&mut self) {
        self.finished.get_or_insert(FinishReason::Length);
    }

    /// Ends the reply early (a client that went away).
    pub fn cancel(&mut self) {
        self.finished.get_or_insert(FinishReason::Cancelled);
    }

    /// Picks the next token from `logits` (the last position's, `[vocab]`) and
    /// advances: penalties, the end-of-sequence mask, the sampler, then the
    /// end conditions.
    pub fn next(&mut self, logits: &[f32], tokenizer: &Tokenizer) -> Result<Sampled, DecodeError> {
        assert!(self.finished.is_none(), "a finished generation takes no more tokens");
        let p = &self.params;
        let adjusted = p.repeat_penalty.is_some() || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 || p.ignore_eos || !p.logit_bias.is_empty() || self.constraint.is_some();
        if adjusted {
            self.row.clear();
            self.row.extend_from_slice(logits);
        }
        if let Some(penalty) = p.repeat_penalty {
            apply_repeat_penalty(&mut self.row, self.recent.iter().copied(), penalty);
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            for (&t, &n) in &self.counts {
                if let Some(x) = self.row.get_mut(t as usize) {
                    *x -= p.frequency_penalty * n as f32 + p.presence_penalty;
                }
            }
        }
        for &(t, bias) in &p.logit_bias {
            if let Some(x) = self.row.get_mut(t as usize) {
                *x += bias;
            }
        }
        // The grammar's mask comes before ignore_eos: a grammar that has ended
        // allows only end-of-sequence tokens, and those must stay.
        if let Some(c) = &mut self.constraint {
            if let Err(e) = c.apply(&mut self.row) {
                self.constraint_error = Some(e);
            }
        } else if p.ignore_eos {
            for &e in &self.eos {
                if let Some(x) = self.row.get_mut(e as usize) {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        let token = sample(if adjusted { &self.row } else { logits }, &p.sampling, &mut self.rng);
        let logprob = p.logprobs.map(|n| logprob_of(logits, token, n));
        self.record(token, logprob, tokenizer)
    }

    /// Takes `token` as the next one without sampling (no random draw): the
    /// deliberately wrong speculative scheme of the tests
    /// ([`super::speculate::SpeculationConfig::accept_unchecked`]).
    #[doc(hidden)]
    pub fn take(&mut self, token: u32, tokenizer: &Tokenizer) -> Result<Sampled, DecodeError> {
        assert!(self.finished.is_none(), "a finished generation takes no more tokens");
        self.record(token, None, tokenizer)
    }

    /// Advances past `token`: the grammar, the penalties' counts, the text and
    /// the end conditions.
    fn record(&mut self, token: u32, logprob: Option<TokenLogprob>, tokenizer: &Tokenizer) -> Result<Sampled, DecodeError> {
        if let Some(c) = &mut self.constraint {
            if self.constraint_error.is_none() {
                if let Err(e) = c.commit(token) {
                    self.constraint_error = Some(e);
                }
            }
        }
        if self.recent.len() == REPEAT_WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(token);
        *self.counts.entry(token).or_insert(0) += 1;
        self.generated.push(token);
        let end = self.eos.contains(&token);
        if !end {
            self.text.push(tokenizer, token)?;
        }
        let grammar_done = self.constraint.as_ref().is_some_and(Constraint::is_stopped) || self.constraint_error.is_some();
        let finish = if end || self.text.stopped() || grammar_done {
            Some(FinishReason::Stop)
        } else if self.generated.len() >= self.limit {
            Some(FinishReason::Length)
        } else {
            None
        };
        self.finished = finish;
        Ok(Sampled { token, text: self.text.take(), logprob, finish })
    }

    /// The rest of the reply's text once it ended (what streaming held back).
    pub fn finish_text(&mut self, tokenizer: &Tokenizer) -> Result<String, DecodeError> {
        self.text.finish(tokenizer)
    }

    /// The reply's text so far.
    pub fn text(&self) -> &str {
        self.text.text()
    }
}

/// The log-probability of `token` under `logits` and the `top` most likely tokens'.
pub fn logprob_of(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = (logits.iter().map(|&x| ((x - max) as f64).exp()).sum::<f64>().ln() + max as f64) as f32;
    let lp = |t: u32| logits.get(t as usize).map_or(f32::NEG_INFINITY, |&x| x - lse);
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &x) in logits.iter().enumerate() {
            if best.len() < top || x > best[best.len() - 1].1 {
                let at = best.partition_point(|&(_, y)| y >= x);
                best.insert(at, (i as u32, x));
                best.truncate(top);
            }
        }
    }
    TokenLogprob { token, logprob: lp(token), top: best.into_iter().map(|(t, x)| (t, x - lse)).collect() }
}

/// Divides the positive logits of `tokens` by `penalty` and multiplies the
/// negative ones, once per distinct token however often it recurs, as
/// transformers' `RepetitionPenaltyLogitsProcessor`, llama.cpp and vLLM do.
fn apply_repeat_penalty(row: &mut [f32], tokens: impl Iterator<Item = u32>, penalty: f32) {
    let mut distinct: Vec<u32> = tokens.collect();
    distinct.sort_unstable();
    distinct.dedup();
    for t in distinct {
        if let Some(x) = row.get_mut(t as usize) {
            *x = if *x > 0.0 { *x / penalty } else { *x * penalty };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeat_penalty_counts_each_token_once() {
        // transformers: scores.gather(ids) -> where(< 0, * p, / p) -> scatter, so a
        // token seen three times is penalized once.
        let mut row = [2.0, -1.0, 4.0, 1.0];
        apply_repeat_penalty(&mut row, [0, 0, 1, 0, 9].into_iter(), 2.0);
        assert_eq!(row, [1.0, -2.0, 4.0, 1.0]);
    }

    #[test]
    fn logprobs_are_a_log_softmax() {
        let l = logprob_of(&[1.0, 3.0, 2.0], 2, 2);
        let z = (1f64.exp() + 3f64.exp() + 2f64.exp()).ln();
        assert!((l.logprob as f64 - (2.0 - z)).abs() < 1e-6);
        assert_eq!(l.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!((l.top[0].1 as f64 - (3.0 - z)).abs() < 1e-6);
        assert!(logprob_of(&[0.0; 4], 9, 0).logprob.is_infinite());
    }
}
