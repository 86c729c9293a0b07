//! The engine's thread. HTTP handlers send it jobs; it steps the engine and
//! routes each request's tokens to the handler that waits for them (a channel
//! per request). A request whose channel the handler dropped (the client went
//! away) is cancelled before the next step, so its KV blocks go back at once.
//!
//! The engine is the batched one where the artifact has batch plans and an
//! executor for the device (the CPU, a CPU mesh, the GPU), else the serial one
//! (one request at a time); a sentence encoder embeds instead, through the
//! embedder over its encode executor (batched steps of its encoder batch plan
//! on the CPU, else one input per step).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicUsize;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc as tmpsc, oneshot};

use super::errors::ApiError;
use super::metrics::Metrics;
use maxrun_runtime::artifact::Artifact;
use maxrun_engine::embed::{Embedder, EncoderFacts};
use maxrun_engine::{Engine, Event, FinishReason, GenerationParams, ModelFacts, Request, RequestId, Stats, SubmitError, TokenLogprob, Usage};
use maxrun_runtime::runner::{Device, Runner};

/// What a request's handler hears.
#[derive(Debug)]
pub enum Update {
    Token { token: u32, text: String, logprob: Option<TokenLogprob> },
    /// The next prompt token's log-probability (echo with logprobs), in order
    /// and before the first token.
    PromptLogprob(TokenLogprob),
    Finished { reason: FinishReason, text: String, usage: Usage },
    Failed(ApiError),
}

/// Work for the engine's thread.
// One job per request goes through the channel and is taken apart at once:
// boxing the large variant would add an allocation for nothing.
#[allow(clippy::large_enum_variant)]
pub enum Job {
    /// `grammar_field`: the request field that set the grammar, for its error.
    /// `admitted` hears once the engine took the request (its grammar built);
    /// a request it refuses drops it and sends `Update::Failed`.
    Generate { prompt: Vec<u32>, params: GenerationParams, arrived: Instant, updates: tmpsc::UnboundedSender<Update>, grammar_field: &'static str, admitted: Option<oneshot::Sender<()>> },
    Embed { inputs: Vec<Vec<u32>>, reply: oneshot::Sender<Result<Vec<Vec<f32>>, ApiError>> },
    /// End every request in flight (the shutdown timeout ran out).
    CancelAll,
    Stop,
}

/// What the handlers and the engine's thread share.
pub struct Shared {
    pub metrics: Metrics,
    /// Requests accepted and not yet finished.
    pub in_flight: AtomicUsize,
    /// The engine's counters after its last step.
    pub stats: Mutex<Stats>,
}

/// How the engine's thread runs.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    pub threads: usize,
    pub device: Device,
    pub kv_cache_memory: Option<u64>,
    /// Speculative decoding for every generation request (the batched engine),
    /// with this draft model where given.
    pub speculation: Option<maxrun_engine::speculate::SpeculationConfig>,
    pub draft: Option<Arc<Artifact>>,
}

struct Active {
    updates: tmpsc::UnboundedSender<Update>,
    arrived: Instant,
    last_token: Option<Instant>,
}

/// Starts the engine's thread on `artifact`; returns once the engine is ready
/// (its KV cache allocated), with a description of it, or why it cannot run.
pub fn spawn(artifact: Artifact, opts: WorkerOptions, shared: Arc<Shared>) -> anyhow::Result<(mpsc::Sender<Job>, std::thread::JoinHandle<()>, String)> {
    let (jobs, rx) = mpsc::channel::<Job>();
    let (ready_tx, ready_rx) = mpsc::channel::<Result<String, String>>();
    let handle = std::thread::Builder::new()
        .name("maxrun-engine".into())
        .spawn(move || {
            let encoder = artifact.header.model.embedding_width.is_some();
            if encoder {
                // The encoder batch plan on the CPU (many inputs per step), else
                // one input per step (a GPU, an artifact of an older maxc).
                let embedder = match maxrun_runtime::runner::open_encoder(&artifact, opts.threads, opts.device) {
                    Ok((executor, note)) => {
                        if let Some(note) = note {
                            eprintln!("maxrun serve: {note}");
                        }
                        let facts = EncoderFacts::of(&artifact).expect("an encoder artifact");
                        Embedder::new(executor, facts)
                    }
                    Err(e) => return drop(ready_tx.send(Err(e.to_string()))),
                };
                let _ = ready_tx.send(Ok(format!("sentence encoder, {}", embedder.describe())));
                return embed_loop(embedder, rx, &shared);
            }
            let tokenizer = match maxrun_engine::load_tokenizer(&artifact) {
                Ok(t) => t,
                Err(e) => return drop(ready_tx.send(Err(e))),
            };
            let engine = open_engine(&artifact, &opts, tokenizer);
            let mut engine = match engine {
                Ok(e) => e,
                Err(e) => return drop(ready_tx.send(Err(e))),
            };
            let _ = ready_tx.send(Ok(engine.describe()));
            generate_loop(&mut engine, rx, &shared);
        })?;
    let description = ready_rx.recv().map_err(|_| anyhow::anyhow!("the engine's thread ended while starting"))?.map_err(|e| anyhow::anyhow!(e))?;
    Ok((jobs, handle, description))
}

/// The batched engine on the artifact's executor for `opts.device` where it has
/// one, else the serial engine (one request at a time) with the reason on stderr.
fn open_engine<'a>(artifact: &'a Artifact, opts: &'a WorkerOptions, tokenizer: tokenizers::Tokenizer) -> Result<Engine<'a>, String> {
    let model = ModelFacts::of(artifact);
    let batched_error = match maxrun_runtime::executor::batch_limits(artifact) {
        Err(e) => e.to_string(),
        Ok(_) => match maxrun_runtime::runner::open_executor(artifact, opts.threads, opts.device, opts.kv_cache_memory) {
            Ok((executor, note)) => {
                if let Some(note) = note {
                    eprintln!("maxrun serve: {note}");
                }
                let mut engine = Engine::batched(model, executor, tokenizer);
                match (&opts.speculation, &opts.draft) {
                    (Some(config), Some(draft)) => {
                        let model = maxrun_engine::draft::DraftModel::of(maxrun_runtime::runner::open_draft_executor(artifact, draft, opts.threads, opts.device, None)?);
                        engine.speculate_with_draft(config.clone(), model)?;
                    }
                    (Some(config), None) => engine.speculate(config.clone())?,
                    (None, _) => {}
                }
                return Ok(engine);
            }
            // A pool that cannot hold one sequence is the operator's to fix, not a
            // reason to serve one request at a time.
            Err(e @ maxrun_runtime::runner::RunnerError::Run(maxrun_runtime::executor::RunError::PoolTooSmall { .. } | maxrun_runtime::executor::RunError::KvCacheMemory { .. })) => return Err(e.to_string()),
            Err(e) => e.to_string(),
        },
    };
    if opts.speculation.is_some() {
        return Err(format!("--speculative verifies drafts in batch steps, and this artifact cannot run them here: {batched_error}"));
    }
    let (runner, _) = Runner::open(artifact, opts.threads, opts.device).map_err(|e| e.to_string())?;
    eprintln!("maxrun serve: one request at a time: {batched_error}");
    Ok(Engine::serial(model, Box::new(runner), tokenizer))
}

fn embed_loop(mut embedder: Embedder<'_>, rx: mpsc::Receiver<Job>, shared: &Shared) {
    let m = &shared.metrics;
    while let Ok(job) = rx.recv() {
        match job {
            Job::Embed { inputs, reply } => {
                let before = embedder.steps();
                let result = embedder.embed_all(&inputs).map_err(|e| {
                    if e.is_bad_input() {
                        ApiError::invalid(e.to_string(), Some("input".into()))
                    } else {
                        ApiError::internal(format!("the model failed: {e}"))
                    }
                });
                m.embedding_steps.inc_by(embedder.steps() - before);
                if result.is_ok() {
                    m.embedding_inputs.inc_by(inputs.len() as u64);
                }
                let _ = reply.send(result);
            }
            Job::Generate { updates, .. } => {
                let _ = updates.send(Update::Failed(ApiError::invalid("this model is a sentence encoder: use /v1/embeddings", Some("model".into()))));
            }
            Job::CancelAll => {}
            Job::Stop => return,
        }
    }
}

/// Tokens generated over the last few seconds, for the rate gauge.
struct Rate {
    window: VecDeque<(Instant, u64)>,
}

impl Rate {
    fn add(&mut self, now: Instant, tokens: u64) -> f64 {
        self.window.push_back((now, tokens));
        while self.window.front().is_some_and(|(t, _)| now.duration_since(*t) > Duration::from_secs(5)) {
            self.window.pop_front();
        }
        let span = self.window.front().map_or(0.0, |(t, _)| now.duration_since(*t).as_secs_f64());
        let total: u64 = self.window.iter().skip(1).map(|(_, n)| n).sum();
        if span > 0.0 {
            total as f64 / span
        } else {
            0.0
        }
    }
}

fn submit_error(e: SubmitError, grammar_field: &str) -> ApiError {
    match e {
        SubmitError::PromptTooLong { tokens, max } => ApiError::too_long(tokens, max as u64, "prompt"),
        SubmitError::Grammar(_) => ApiError::invalid(e.to_string(), Some(grammar_field.into())),
        other => ApiError::invalid(other.to_string(), Some("prompt".into())),
    }
}

fn generate_loop(engine: &mut Engine<'_>, rx: mpsc::Receiver<Job>, shared: &Shared) {
    let mut active: HashMap<RequestId, Active> = HashMap::new();
    let mut rate = Rate { window: VecDeque::new() };
    let m = &shared.metrics;
    // The gauges (the KV pool's size among them) are there before a first request.
    publish(engine, shared);
    loop {
        // New jobs: all that are there, or wait for one when idle.
        let mut jobs = Vec::new();
        if active.is_empty() {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(j) => jobs.push(j),
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
        }
        jobs.extend(rx.try_iter());
        for job in jobs {
            match job {
                Job::Generate { prompt, params, arrived, updates, grammar_field, admitted } => match engine.submit(Request::new(prompt, params)) {
                    Ok(id) => {
                        if let Some(a) = admitted {
                            let _ = a.send(());
                        }
                        active.insert(id, Active { updates, arrived, last_token: None });
                    }
                    Err(e) => {
                        let _ = updates.send(Update::Failed(submit_error(e, grammar_field)));
                    }
                },
                Job::Embed { reply, .. } => {
                    let _ = reply.send(Err(ApiError::invalid("this model generates text; embeddings need a sentence encoder artifact", Some("model".into()))));
                }
                Job::CancelAll => {
                    for (id, a) in active.drain() {
                        engine.cancel(id);
                        m.cancelled.inc();
                        let _ = a.updates.send(Update::Finished { reason: FinishReason::Cancelled, text: String::new(), usage: Usage::default() });
                    }
                }
                Job::Stop => return,
            }
        }
        // Clients that went away.
        let gone: Vec<RequestId> = active.iter().filter(|(_, a)| a.updates.is_closed()).map(|(&id, _)| id).collect();
        for id in gone {
            engine.cancel(id);
            active.remove(&id);
            m.cancelled.inc();
        }
        if !engine.has_work() {
            publish(engine, shared);
            continue;
        }
        let events = match engine.step() {
            Ok(e) => e,
            Err(e) => {
                // The engine's own failure: every request in flight ends with it.
                eprintln!("maxrun serve: the engine failed: {e}");
                for (id, a) in active.drain() {
                    engine.cancel(id);
                    let _ = a.updates.send(Update::Failed(ApiError::internal(format!("the engine failed: {e}"))));
                }
                publish(engine, shared);
                continue;
            }
        };
        // The gauges first: a client that has its last token and then reads
        // /metrics sees its request's KV blocks already given back.
        publish(engine, shared);
        let now = Instant::now();
        let mut tokens = 0;
        for event in events {
            match event {
                Event::Token { id, token, text, logprob } => {
                    tokens += 1;
                    if let Some(a) = active.get_mut(&id) {
                        match a.last_token {
                            None => m.time_to_first_token.observe(now.duration_since(a.arrived).as_secs_f64()),
                            Some(t) => m.inter_token_latency.observe(now.duration_since(t).as_secs_f64()),
                        }
                        a.last_token = Some(now);
                        let _ = a.updates.send(Update::Token { token, text, logprob });
                    }
                }
                Event::Finished { id, reason, text, usage } => {
                    if let Some(a) = active.remove(&id) {
                        m.prompt_tokens.inc_by(usage.prompt_tokens as u64);
                        m.request_duration.observe(now.duration_since(a.arrived).as_secs_f64());
                        let _ = a.updates.send(Update::Finished { reason, text, usage });
                    }
                }
                Event::PromptLogprob { id, logprob, .. } => {
                    if let Some(a) = active.get(&id) {
                        let _ = a.updates.send(Update::PromptLogprob(logprob));
                    }
                }
                Event::Logits { .. } => {}
            }
        }
        m.generated_tokens.inc_by(tokens);
        m.tokens_per_second.set(rate.add(now, tokens));
    }
}

fn publish(engine: &Engine<'_>, shared: &Shared) {
    let s = engine.stats();
    shared.metrics.observe_engine(&s);
    *shared.stats.lock().expect("the stats lock is never poisoned") = s;
}
