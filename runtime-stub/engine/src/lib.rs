//! The engine: requests in, tokens out. `maxrun --prompt`, `--chat`, `bench`
//! and the server all drive it, so a parameter means the same everywhere.
//!
//! A request is a prompt (token ids) and its [`GenerationParams`]. Each
//! [`Engine::step`] advances every request it can by one step of the model and
//! returns what happened as [`Event`]s: tokens with the text they made visible,
//! prompt logits where a request asked for them, and the end of a request with
//! its usage. Requests join ([`Engine::submit`]) and leave ([`Engine::cancel`])
//! between steps.
//!
//! The engine names no device: it drives the executor interface
//! (`maxrun_runtime::executor`), which the CPU, a CPU mesh and the GPU implement. Two
//! backends run the steps (docs/serving.md):
//! - **batched** (`batch.rs`): the artifact's batch plans on an
//!   [`Executor`] over its paged KV pool. Each step holds the decode rows of every
//!   running request plus chunks of new prompts ([`scheduler`]), so the weights
//!   are read once per step for all of them; prompts that share a prefix share
//!   its KV blocks ([`blocks`]).
//! - **serial** (`serial.rs`): one request at a time on a [`SequenceExecutor`]
//!   through the single-stream plans, reusing the cached prefix of the previous
//!   request (a chat's earlier turns). This is `maxrun --prompt` and `--chat`:
//!   the single-stream plans are the fastest way to run one sequence.
//!
//! The batched backend can speculate ([`Engine::speculate`], `speculate.rs`):
//! a running sequence's decode row comes with drafted tokens, and one step
//! verifies them, giving the tokens plain decoding would give.
//!
//! Sentence encoders have no generation loop: [`embed::Embedder`] packs a
//! request's inputs into steps of an [`maxrun_runtime::executor::EncodeExecutor`].

pub mod batch;
pub mod constrain;
pub mod blocks;
pub mod draft;
pub mod embed;
pub mod generation;
pub mod scheduler;
pub mod serial;
pub mod speculate;
pub mod text;

use std::collections::HashMap;
use std::time::Instant;

use tokenizers::Tokenizer;

use maxrun_runtime::artifact::Artifact;
use maxrun_runtime::executor::{Executor, ProfileRow, RunError, SequenceExecutor};
pub use generation::{FinishReason, Generation, GenerationParams, TokenLogprob};
pub use text::{DecodeError, TextOptions};

/// A request's id, unique within an engine.
pub type RequestId = u64;

/// A generation request.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub params: GenerationParams,
    /// Also return the logits of every prompt position (tests compare them).
    pub all_logits: bool,
}

impl Request {
    pub fn new(prompt: Vec<u32>, params: GenerationParams) -> Request {
        Request { prompt, params, all_logits: false }
    }
}

/// Token counts and times of a finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Generated tokens, an end-of-sequence token included.
    pub completion_tokens: usize,
    /// Prompt tokens whose KV came from a cache instead of being computed.
    pub cached_tokens: usize,
    /// Seconds from submission to the first token.
    pub time_to_first_token: f64,
    /// Seconds from the first token to the last.
    pub decode_seconds: f64,
    /// Speculative decoding: drafts verified, drafts that stood, and the
    /// verification steps of this request (0 without speculation).
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
    pub verifications: u64,
}

/// What a step produced.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A new token of request `id` and the text it made visible.
    Token { id: RequestId, token: u32, text: String, logprob: Option<TokenLogprob> },
    /// The logits of one prompt position (requests with `all_logits`).
    Logits { id: RequestId, position: usize, logits: Vec<f32> },
    /// The log-probability of prompt token `position` (from 1) given the
    /// tokens before it (requests with `prompt_logprobs`), in order.
    PromptLogprob { id: RequestId, position: usize, logprob: TokenLogprob },
    /// Request `id` ended; `text` is the rest of its reply (what streaming held
    /// back while it could still start a stop string).
    Finished { id: RequestId, reason: FinishReason, text: String, usage: Usage },
}

/// Why a request was refused.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the prompt is empty: it has no tokens to condition on")]
    EmptyPrompt,
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    BadToken { id: u32, vocab: u64 },
    #[error("prompt is too long: {tokens} tokens exceeds the maximum context length of {max} tokens")]
    PromptTooLong { tokens: usize, max: usize },
    #[error("{0}")]
    Batch(#[from] scheduler::AddError),
    #[error("the grammar cannot be built: {0}")]
    Grammar(String),
}

/// Why a step failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Run(#[from] RunError),
    #[error(transparent)]
    Submit(#[from] SubmitError),
    #[error(transparent)]
    Decode(#[from] DecodeError),
}

/// Counters for stats lines and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Stats {
    pub steps: u64,
    /// Rows computed: prompt rows (and recomputed ones) and decode rows.
    pub prompt_rows: u64,
    pub decode_rows: u64,
    pub requests_finished: u64,
    pub preemptions: u64,
    /// Requests waiting for room, and running.
    pub waiting: usize,
    pub running: usize,
    /// KV blocks of the batched backend's pool (0 on the serial backend).
    pub kv_blocks_total: usize,
    pub kv_blocks_used: usize,
    /// Positions per KV block (0 on the serial backend).
    pub kv_block_size: usize,
    /// Prompt positions looked up in the prefix cache, and found.
    pub prefix_queried_tokens: u64,
    pub prefix_hit_tokens: u64,
    /// Speculative decoding: drafted tokens verified, those that stood, and
    /// the verification steps of a sequence (each gives one token more than
    /// the drafts that stood).
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
    pub verifications: u64,
    /// Verifications by how many tokens they gave (index: tokens - 1, the last
    /// bucket `MAX_DRAFTS + 1` tokens).
    pub accepted_lengths: [u64; speculate::MAX_DRAFTS + 1],
}

/// A request in flight.
struct Active {
    generation: Generation,
    all_logits: bool,
    /// The prompt, kept while its tokens are scored (`prompt_logprobs`).
    scored_prompt: Option<Vec<u32>>,
    /// The next prompt position to score (a recomputed row is not scored twice).
    next_scored: usize,
    submitted: Instant,
    first_token: Option<Instant>,
    cached_tokens: usize,
    /// Its drafts' source and how many to draft (speculating engines, requests
    /// that generate).
    speculation: Option<(speculate::NGramIndex, speculate::DraftLength)>,
}

enum Backend<'a> {
    Serial(serial::Serial<'a>),
    Batched(Box<batch::Batched<'a>>),
}

/// What the engine needs to know of the model it runs.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelFacts<'a> {
    pub vocab_size: u64,
    /// The longest sequence (prompt and generated tokens).
    pub max_length: u64,
    pub eos_token_ids: Vec<u32>,
    /// The tokenizer's JSON, for grammars (structured output); `None`: requests
    /// with a grammar are refused.
    pub tokenizer_json: Option<&'a str>,
}

impl<'a> ModelFacts<'a> {
    /// The facts an artifact records.
    pub fn of(artifact: &'a Artifact) -> ModelFacts<'a> {
        let h = &artifact.header;
        ModelFacts { vocab_size: h.model.vocab_size, max_length: h.max_length, eos_token_ids: h.tokenizer.eos_token_ids.clone(), tokenizer_json: artifact.tokenizer_json().ok() }
    }
}

/// The engine over one model.
pub struct Engine<'a> {
    backend: Backend<'a>,
    tokenizer: Tokenizer,
    model: ModelFacts<'a>,
    requests: HashMap<RequestId, Active>,
    next_id: RequestId,
    stats: Stats,
    /// The vocabulary's grammars, built at the first request with a grammar.
    grammars: Option<crate::constrain::Grammars>,
    /// The step's threads leave a CPU free, so grammar masks are computed on a
    /// helper thread beside the step (decided once: the usable CPUs are read
    /// from the affinity mask and cgroup files).
    masks_beside_step: bool,
    /// Speculative decoding, where it is on, and its draft model (prompt
    /// lookup without one).
    speculation: Option<speculate::SpeculationConfig>,
    draft_model: Option<draft::DraftModel<'a>>,
    drafts: Vec<u32>,
    /// Requests that take drafts before the next step.
    to_draft: Vec<RequestId>,
}

impl std::fmt::Debug for Engine<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("requests", &self.requests.len()).field("stats", &self.stats).finish()
    }
}

/// The artifact's tokenizer, without padding (a tokenizer's fixed padding is for
/// batching in Python; a sequence here is exactly its tokens).
pub fn load_tokenizer(artifact: &Artifact) -> Result<Tokenizer, String> {
    let json = artifact.tokenizer_json().map_err(|e| e.to_string())?;
    let mut t: Tokenizer = json.parse().map_err(|e| format!("{}: the artifact's tokenizer does not load: {e}", artifact.path.display()))?;
    t.with_padding(None);
    Ok(t)
}

impl<'a> Engine<'a> {
    /// An engine that runs one request at a time on `runner`.
    pub fn serial(model: ModelFacts<'a>, runner: Box<dyn SequenceExecutor + 'a>, tokenizer: Tokenizer) -> Engine<'a> {
        Engine::with_backend(model, Backend::Serial(serial::Serial::new(runner)), tokenizer)
    }

    /// An engine that batches requests over `executor`'s batch plans and KV pool
    /// (`maxrun_runtime::runner::open_executor` opens one for an artifact on a device).
    pub fn batched(model: ModelFacts<'a>, executor: Box<dyn Executor + 'a>, tokenizer: Tokenizer) -> Engine<'a> {
        Engine::with_backend(model, Backend::Batched(Box::new(batch::Batched::new(executor))), tokenizer)
    }

    /// Whether steps run many requests together.
    pub fn is_batched(&self) -> bool {
        matches!(self.backend, Backend::Batched(_))
    }

    fn with_backend(model: ModelFacts<'a>, backend: Backend<'a>, tokenizer: Tokenizer) -> Engine<'a> {
        let mut engine = Engine { backend, tokenizer, model, requests: HashMap::new(), next_id: 1, stats: Stats::default(), grammars: None, masks_beside_step: false, speculation: None, draft_model: None, drafts: Vec::new(), to_draft: Vec::new() };
        engine.masks_beside_step = engine.threads() < maxrun_runtime::executor::usable_cpus();
        engine
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Turns speculative decoding on for the requests submitted from now on:
    /// prompt lookup drafts, verified in the batched backend's steps. The
    /// serial backend cannot (its plans take one token per step): an error.
    pub fn speculate(&mut self, config: speculate::SpeculationConfig) -> Result<(), String> {
        config.check()?;
        if !self.is_batched() {
            return Err("speculative decoding verifies drafts in batch steps, and this engine runs the single-stream plans (an artifact without batch plans, or a device without a batched executor)".into());
        }
        self.speculation = Some(config);
        Ok(())
    }

    /// Turns speculative decoding on with `draft` proposing the drafts (a
    /// second artifact with the target's vocabulary, on its own executor).
    pub fn speculate_with_draft(&mut self, config: speculate::SpeculationConfig, draft: draft::DraftModel<'a>) -> Result<(), String> {
        self.speculate(config)?;
        self.draft_model = Some(draft);
        Ok(())
    }

    /// The speculation settings, where it is on.
    pub fn speculation(&self) -> Option<&speculate::SpeculationConfig> {
        self.speculation.as_ref()
    }

    pub fn model(&self) -> &ModelFacts<'a> {
        &self.model
    }

    /// The serial backend's executor (its plan counts and description).
    pub fn runner(&mut self) -> Option<&mut (dyn SequenceExecutor + 'a)> {
        match &mut self.backend {
            Backend::Serial(s) => Some(s.runner()),
            Backend::Batched(_) => None,
        }
    }

    /// Times every launch, where the executor can.
    pub fn enable_profile(&mut self) {
        match &mut self.backend {
            Backend::Serial(s) => s.runner().enable_profile(),
            Backend::Batched(b) => b.enable_profile(),
        }
    }

    /// The kernels' times so far, slowest first (empty unless profiling).
    pub fn profile(&mut self) -> Vec<ProfileRow> {
        match &mut self.backend {
            Backend::Serial(s) => s.runner().profile(),
            Backend::Batched(b) => b.profile(),
        }
    }

    /// The worker threads the model's steps run on.
    pub fn threads(&self) -> usize {
        match &self.backend {
            Backend::Serial(s) => s.threads(),
            Backend::Batched(b) => b.threads(),
        }
    }

    /// Where it runs, for stats lines.
    pub fn describe(&self) -> String {
        let base = match &self.backend {
            Backend::Serial(s) => s.describe(),
            Backend::Batched(b) => b.describe(),
        };
        match (&self.speculation, &self.draft_model) {
            (Some(c), Some(d)) => format!("{base}, speculative: draft model ({}), up to {} drafts", d.describe(), c.max_drafts),
            (Some(c), None) => format!("{base}, speculative: n-gram {}..{}, up to {} drafts", c.min_n, c.max_n, c.max_drafts),
            (None, _) => base,
        }
    }

    /// Queues a request; refused when it cannot run on this artifact.
    pub fn submit(&mut self, request: Request) -> Result<RequestId, SubmitError> {
        let max_length = self.model.max_length as usize;
        let vocab = self.model.vocab_size;
        if request.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if let Some(&id) = request.prompt.iter().find(|&&id| id as u64 >= vocab) {
            return Err(SubmitError::BadToken { id, vocab });
        }
        if request.prompt.len() > max_length {
            return Err(SubmitError::PromptTooLong { tokens: request.prompt.len(), max: max_length });
        }
        let constraint = match &request.params.grammar {
            None => None,
            Some(g) => Some(self.grammars()?.constraint(g).map_err(SubmitError::Grammar)?),
        };
        let id = self.next_id;
        let scored_prompt = request.params.prompt_logprobs.map(|_| request.prompt.clone());
        // Scoring the prompt needs every position's logits.
        let backend_request = Request { all_logits: request.all_logits || scored_prompt.is_some(), ..request.clone() };
        match &mut self.backend {
            Backend::Serial(s) => s.add(id, &backend_request),
            Backend::Batched(b) => b.add(id, &backend_request)?,
        }
        self.next_id += 1;
        let mut generation = Generation::new(&request.prompt, request.params, &self.model.eos_token_ids, max_length);
        if let Some(c) = constraint {
            generation = generation.with_constraint(c);
        }
        // Requests that want every position's logits (prompt scoring, tests)
        // run as they would without speculation.
        let speculation = self.speculation.as_ref().filter(|_| !request.all_logits && scored_prompt.is_none()).map(|c| (speculate::NGramIndex::new(c.min_n, c.max_n), speculate::DraftLength::default()));
        self.requests.insert(id, Active { generation, all_logits: request.all_logits, scored_prompt, next_scored: 1, submitted: Instant::now(), first_token: None, cached_tokens: 0, speculation });
        Ok(id)
    }

    /// The artifact's grammars (llguidance's token trie), built on first use.
    fn grammars(&mut self) -> Result<&crate::constrain::Grammars, SubmitError> {
        if self.grammars.is_none() {
            let m = &self.model;
            let json = m.tokenizer_json.ok_or_else(|| SubmitError::Grammar("the model's tokenizer JSON is not available".into()))?;
            let g = crate::constrain::Grammars::new(json, &self.tokenizer, m.vocab_size as usize, &m.eos_token_ids).map_err(SubmitError::Grammar)?;
            self.grammars = Some(g);
        }
        Ok(self.grammars.as_ref().expect("built above"))
    }

    /// Ends a request now, giving its KV blocks back; `false` if it is unknown
    /// (already finished). No event follows.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        if self.requests.remove(&id).is_none() {
            return false;
        }
        match &mut self.backend {
            Backend::Serial(s) => s.remove(id),
            Backend::Batched(b) => b.remove(id),
        }
        if let Some(d) = &mut self.draft_model {
            d.remove(id);
        }
        true
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.requests.is_empty()
    }

    /// Requests in flight.
    pub fn requests(&self) -> usize {
        self.requests.len()
    }

    pub fn stats(&self) -> Stats {
        let mut s = self.stats;
        match &self.backend {
            Backend::Serial(b) => {
                s.waiting = b.waiting();
                s.running = usize::from(b.busy());
            }
            Backend::Batched(b) => b.fill_stats(&mut s),
        }
        s
    }

    /// Runs one step; returns what it produced (nothing when no request is in flight).
    pub fn step(&mut self) -> Result<Vec<Event>, EngineError> {
        let mut events = Vec::new();
        // Requests that cannot take a single token (a prompt that fills the
        // context) end at once.
        let done: Vec<RequestId> = self.requests.iter().filter(|(_, a)| a.generation.finished().is_some()).map(|(&id, _)| id).collect();
        for id in done {
            self.finish(id, &mut events)?;
        }
        if self.requests.is_empty() {
            return Ok(events);
        }
        // The grammars' next masks: computed before the step, or beside it; a
        // step without constrained requests computes none.
        let overlap = self.masks_beside_step;
        let (backend, requests) = (&mut self.backend, &mut self.requests);
        let output = std::thread::scope(|scope| {
            let pending: Vec<&mut crate::constrain::Constraint> =
                requests.values_mut().filter_map(|a| a.generation.constraint_mut()).filter(|c| !c.is_prepared()).collect();
            // With a core to spare, the masks overlap the step on a helper thread;
            // where the step's threads take every core, a helper only takes a core
            // from them (their barriers then wait on it), so the masks come first
            // on this thread (docs/serving.md, Structured output).
            let pending = if overlap {
                pending
            } else {
                pending.into_iter().for_each(|c| c.prepare());
                Vec::new()
            };
            let helper = (!pending.is_empty()).then(|| scope.spawn(move || pending.into_iter().for_each(|c| c.prepare())));
            let output = match backend {
                Backend::Serial(s) => s.step(),
                Backend::Batched(b) => b.step(),
            };
            if let Some(h) = helper {
                h.join().expect("the mask thread does not panic");
            }
            output
        })?;
        // Requests whose prompt this step finished: the draft model computes
        // theirs now, before their first token (prompt processing, not decoding).
        if let (Some(draft), Backend::Batched(b)) = (&mut self.draft_model, &self.backend) {
            let fresh: Vec<(RequestId, Vec<u32>)> = output
                .rows
                .iter()
                .filter(|r| r.next && !r.verifies)
                .filter(|r| self.requests.get(&r.id).is_some_and(|a| a.first_token.is_none() && a.speculation.is_some()))
                .filter_map(|r| Some((r.id, b.tokens(r.id)?.to_vec())))
                .collect();
            if !fresh.is_empty() {
                draft.prefill(&fresh)?;
            }
        }
        self.stats.steps += 1;
        self.stats.prompt_rows += output.prompt_rows as u64;
        self.stats.decode_rows += output.decode_rows as u64;
        let vocab = self.model.vocab_size as usize;
        let mut i = 0;
        while i < output.rows.len() {
            let out = &output.rows[i];
            if out.verifies {
                // A verification step's rows of one sequence, in position order.
                let n = output.rows[i..].iter().take_while(|r| r.verifies && r.id == out.id).count();
                self.verify(out.id, &output.logits[i * vocab..(i + n) * vocab], &mut events)?;
                i += n;
                continue;
            }
            i += 1;
            let row = &output.logits[(i - 1) * vocab..i * vocab];
            let Some(active) = self.requests.get_mut(&out.id) else { continue };
            active.cached_tokens = active.cached_tokens.max(out.cached_tokens);
            if active.all_logits && out.position < active.generation.prompt_tokens() {
                events.push(Event::Logits { id: out.id, position: out.position, logits: row.to_vec() });
            }
            if let (Some(prompt), Some(top)) = (&active.scored_prompt, active.generation.params().prompt_logprobs) {
                if out.position + 1 == active.next_scored && active.next_scored < prompt.len() {
                    let logprob = generation::logprob_of(row, prompt[active.next_scored], top);
                    events.push(Event::PromptLogprob { id: out.id, position: active.next_scored, logprob });
                    active.next_scored += 1;
                }
            }
            if !out.next {
                continue;
            }
            if active.generation.generates_nothing() {
                active.generation.end_at_limit();
                self.finish(out.id, &mut events)?;
                continue;
            }
            let sampled = active.generation.next(row, &self.tokenizer)?;
            active.first_token.get_or_insert_with(Instant::now);
            events.push(Event::Token { id: out.id, token: sampled.token, text: sampled.text, logprob: sampled.logprob });
            match sampled.finish {
                Some(_) => self.finish(out.id, &mut events)?,
                None => {
                    match &mut self.backend {
                        Backend::Serial(s) => s.append(out.id, sampled.token),
                        Backend::Batched(b) => b.append(out.id, sampled.token),
                    }
                    self.draft(out.id);
                }
            }
        }
        self.draft_queued()?;
        self.limit_step_drafts();
        Ok(events)
    }

    /// Queues request `id` for drafts before the next step, where it speculates.
    fn draft(&mut self, id: RequestId) {
        if self.speculation.is_some() {
            self.to_draft.push(id);
        }
    }

    /// Drafts tokens after the last token of every queued request: as many as
    /// its acceptance estimate says pay and its token limit leaves, from the
    /// draft model (all of them in its batch steps) or by prompt lookup.
    fn draft_queued(&mut self) -> Result<(), EngineError> {
        let (Some(config), Backend::Batched(b)) = (&self.speculation, &mut self.backend) else { return Ok(()) };
        // A draft's cost in target decode steps per sequence: its verification
        // row, whose share grows with the sequences that split the step's
        // weight reads, and the draft model's step that proposes it.
        let decoding = self.requests.values().filter(|a| a.first_token.is_some()).count().max(1);
        let per_draft = config.row_cost * decoding as f64 + self.draft_model.as_ref().map_or(0.0, |d| d.relative_cost);
        let mut wants: Vec<(RequestId, &[u32], usize)> = Vec::new();
        for id in self.to_draft.drain(..) {
            let Some(active) = self.requests.get_mut(&id) else { continue };
            let Some((_, length)) = &mut active.speculation else { continue };
            let g = &active.generation;
            // The token after the drafts comes from the last row: leave room for it.
            let left = g.limit().saturating_sub(g.generated().len() + 1);
            let k = length.next(config.max_drafts, per_draft).min(left);
            if k == 0 || g.finished().is_some() {
                continue;
            }
            if let Some(tokens) = b.tokens(id) {
                wants.push((id, tokens, k));
            }
        }
        let proposed: Vec<(RequestId, Vec<u32>)> = match &mut self.draft_model {
            Some(model) => model.propose(&wants)?.into_iter().collect(),
            None => wants
                .iter()
                .filter_map(|&(id, tokens, k)| {
                    let (proposer, _) = self.requests.get_mut(&id)?.speculation.as_mut()?;
                    self.drafts.clear();
                    speculate::Proposer::propose(proposer, tokens, k, &mut self.drafts);
                    Some((id, self.drafts.clone()))
                })
                .collect(),
        };
        for (id, drafts) in proposed {
            if !drafts.is_empty() {
                b.set_drafts(id, &drafts);
            }
        }
        Ok(())
    }

    /// Keeps the step's drafted rows within [`speculate::SpeculationConfig::max_step_drafts`]:
    /// the requests with the most drafts give theirs up first.
    fn limit_step_drafts(&mut self) {
        let (Some(config), Backend::Batched(b)) = (&self.speculation, &mut self.backend) else { return };
        let mut drafted: Vec<(usize, RequestId)> = self.requests.keys().map(|&id| (b.drafts(id).len(), id)).filter(|d| d.0 > 0).collect();
        let mut total: usize = drafted.iter().map(|d| d.0).sum();
        drafted.sort_unstable_by(|a, b| b.cmp(a));
        for (n, id) in drafted {
            if total <= config.max_step_drafts {
                break;
            }
            let keep = n.saturating_sub(total - config.max_step_drafts);
            b.keep_drafts(id, keep);
            total -= n - keep;
        }
    }

    /// Verifies request `id`'s drafts against `logits`, the rows of its last
    /// token and its drafts (`[drafts + 1, vocab]`): samples from each row in
    /// turn as plain decoding would; a draft stands while it equals the token
    /// sampled before it. Emits every token that stands and the one after them.
    fn verify(&mut self, id: RequestId, logits: &[f32], events: &mut Vec<Event>) -> Result<(), EngineError> {
        let vocab = self.model.vocab_size as usize;
        let Backend::Batched(b) = &mut self.backend else { unreachable!("only the batched backend verifies") };
        let drafts = b.drafts(id).to_vec();
        let Some(active) = self.requests.get_mut(&id) else { return Ok(()) };
        debug_assert_eq!(logits.len(), (drafts.len() + 1) * vocab);
        let (mut accepted, mut last, mut finished) = (0, None, false);
        for (r, row) in logits.chunks_exact(vocab).enumerate() {
            // The tests' wrong scheme takes each draft as it is.
            let unchecked = r < drafts.len() && self.speculation.as_ref().is_some_and(|c| c.accept_unchecked);
            let sampled = if unchecked { active.generation.take(drafts[r], &self.tokenizer)? } else { active.generation.next(row, &self.tokenizer)? };
            active.first_token.get_or_insert_with(Instant::now);
            events.push(Event::Token { id, token: sampled.token, text: sampled.text, logprob: sampled.logprob });
            let stands = r < drafts.len() && sampled.token == drafts[r];
            last = Some(sampled.token);
            if sampled.finish.is_some() {
                finished = true;
                break;
            }
            if !stands {
                break;
            }
            accepted += 1;
        }
        // A finished request verified what it could; its drafts count as far as they were checked.
        let checked = if finished { accepted.min(drafts.len()) } else { drafts.len() };
        if let Some((_, length)) = &mut active.speculation {
            length.record(checked, accepted);
        }
        self.stats.draft_tokens += checked as u64;
        self.stats.accepted_tokens += accepted as u64;
        self.stats.verifications += 1;
        self.stats.accepted_lengths[accepted.min(speculate::MAX_DRAFTS)] += 1;
        if finished {
            return self.finish(id, events);
        }
        let Backend::Batched(b) = &mut self.backend else { unreachable!() };
        b.accept(id, accepted);
        b.append(id, last.expect("one row at least"));
        self.draft(id);
        Ok(())
    }

    /// Ends request `id`: its last text and usage, its KV given back.
    fn finish(&mut self, id: RequestId, events: &mut Vec<Event>) -> Result<(), EngineError> {
        let Some(mut active) = self.requests.remove(&id) else { return Ok(()) };
        match &mut self.backend {
            Backend::Serial(s) => s.finish(id),
            Backend::Batched(b) => b.remove(id),
        }
        if let Some(d) = &mut self.draft_model {
            d.remove(id);
        }
        let g = &mut active.generation;
        let text = g.finish_text(&self.tokenizer)?;
        let now = Instant::now();
        let first = active.first_token.unwrap_or(now);
        let usage = Usage {
            prompt_tokens: g.prompt_tokens(),
            completion_tokens: g.generated().len(),
            cached_tokens: active.cached_tokens,
            time_to_first_token: first.duration_since(active.submitted).as_secs_f64(),
            decode_seconds: now.duration_since(first).as_secs_f64(),
            draft_tokens: active.speculation.as_ref().map_or(0, |s| s.1.drafted),
            accepted_tokens: active.speculation.as_ref().map_or(0, |s| s.1.accepted),
            verifications: active.speculation.as_ref().map_or(0, |s| s.1.verifications),
        };
        self.stats.requests_finished += 1;
        events.push(Event::Finished { id, reason: g.finished().unwrap_or(FinishReason::Length), text, usage });
        Ok(())
    }
}

/// One logits row a backend's step returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutputRow {
    pub id: RequestId,
    pub position: usize,
    /// The request's last token: its logits pick the next one.
    pub next: bool,
    /// A row of a verification step ([`Engine::speculate`]).
    pub verifies: bool,
    /// Prompt tokens the request found cached so far.
    pub cached_tokens: usize,
}

/// What a backend's step computed: a logits row per output row.
#[derive(Debug, Default)]
pub struct StepOutput {
    pub rows: Vec<OutputRow>,
    /// `[rows, vocab]`.
    pub logits: Vec<f32>,
    pub prompt_rows: usize,
    pub decode_rows: usize,
}
