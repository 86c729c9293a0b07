//! The HTTP endpoints: completions and chat completions (whole or streamed as
//! server-sent events; the Responses API is `responses.rs`, on the same path
//! to the engine: [`prepare_chat`]), embeddings, tokenize and detokenize, models, health and
//! metrics. Each handler
//! checks the request (API key, model name, fields, prompt length, queue room),
//! hands it to the engine's thread and turns what comes back into OpenAI's
//! response or chunk format. A streamed response that the client drops drops
//! its channel, which cancels the request in the engine.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use serde_json::{json, Value};
use tokio::sync::mpsc as tmpsc;

use super::errors::ApiError;
use super::openai::{self, ChatRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest, Prompt, TokenizeRequest};
use super::worker::{Job, Shared, Update};
use maxrun_engine::{FinishReason, GenerationParams, TokenLogprob};
use maxrun_runtime::format::GenerationDefaults;

/// What the handlers know of the model.
pub struct ModelInfo {
    /// The name clients use (`--served-model-name`, else the artifact's model name).
    pub name: String,
    /// How the model writes tool calls (`--tool-parser`, else from the chat template).
    pub tool_format: maxrun_engine::constrain::tools::ToolFormat,
    /// Whether replies' `<think>...</think>` goes to `reasoning_content`.
    pub reasoning: bool,
    pub created: u64,
    /// The artifact's path as the command line gave it.
    pub artifact: String,
    pub max_length: u64,
    pub vocab: u64,
    pub tokenizer: tokenizers::Tokenizer,
    pub template: Option<String>,
    pub bos_text: String,
    pub eos_text: String,
    pub encoder: bool,
    pub embedding_width: Option<u64>,
    pub defaults: GenerationDefaults,
}

/// The server's state.
pub struct AppState {
    pub jobs: Mutex<mpsc::Sender<Job>>,
    pub shared: Arc<Shared>,
    pub info: ModelInfo,
    pub api_key: Option<String>,
    /// Requests that may wait for room in the engine before new ones get 503.
    pub max_queue: usize,
    /// Drop unknown request fields instead of refusing them.
    pub allow_extra_fields: bool,
    pub next_id: AtomicU64,
    pub shutting_down: AtomicBool,
    /// Stored responses of `/v1/responses` (`responses.rs`).
    pub responses: Mutex<super::response_store::ResponseStore<super::responses::StoredResponse>>,
}

type St = State<Arc<AppState>>;

impl AppState {
    pub(super) fn send(&self, job: Job) -> Result<(), ApiError> {
        self.jobs.lock().expect("never poisoned").send(job).map_err(|_| ApiError::overloaded("the server is shutting down", 1))
    }

    fn count(&self, endpoint: &str, status: u16) {
        self.shared.metrics.requests.with_label_values(&[endpoint, &status.to_string()]).inc();
    }

    pub(super) fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(key) = &self.api_key else { return Ok(()) };
        let given = headers.get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer ")).map(str::trim);
        if given == Some(key.as_str()) {
            Ok(())
        } else {
            Err(ApiError::unauthorized())
        }
    }

    pub(super) fn check_model(&self, model: &Option<String>) -> Result<(), ApiError> {
        match model {
            // sglang-router names the model `unknown` in a request that named none.
            Some(m) if m == "unknown" && self.info.name != "unknown" => Ok(()),
            Some(m) if m != &self.info.name => Err(ApiError::model_not_found(m, &self.info.name)),
            _ => Ok(()),
        }
    }

    /// Refuses a request when the queue is full or the server is stopping.
    pub(super) fn admit(self: &Arc<Self>) -> Result<InFlight, ApiError> {
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(ApiError::overloaded("the server is shutting down", 5));
        }
        let in_flight = self.shared.in_flight.load(Ordering::Relaxed);
        let running = self.shared.stats.lock().expect("never poisoned").running;
        if in_flight.saturating_sub(running) >= self.max_queue {
            return Err(ApiError::overloaded(format!("{} requests are waiting (--max-queue {}); try again shortly", in_flight - running, self.max_queue), 1));
        }
        self.shared.in_flight.fetch_add(1, Ordering::Relaxed);
        Ok(InFlight(self.shared.clone()))
    }
}

/// A request in flight; dropping it (the response ends, or its client went away)
/// takes it off the count.
pub(super) struct InFlight(Arc<Shared>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

pub(super) fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// One line per request on stderr.
pub(super) fn log_request(id: &str, endpoint: &str, status: u16, usage: Option<(usize, usize)>, started: Instant, finish: Option<&str>) {
    let line = json!({
        "request": id,
        "endpoint": endpoint,
        "status": status,
        "prompt_tokens": usage.map(|u| u.0),
        "completion_tokens": usage.map(|u| u.1),
        "duration_ms": (started.elapsed().as_secs_f64() * 1e4).round() / 10.0,
        "finish_reason": finish,
    });
    eprintln!("{line}");
}

/// Answers with `result`, counting and logging it.
pub(super) fn respond(st: &AppState, endpoint: &str, id: &str, started: Instant, result: Result<Response, ApiError>) -> Response {
    let response = result.unwrap_or_else(|e| {
        log_request(id, endpoint, e.status, None, started, None);
        e.into_response()
    });
    st.count(endpoint, response.status().as_u16());
    response
}

pub async fn health(State(st): St) -> Response {
    if st.shutting_down.load(Ordering::Relaxed) {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "shutting down"}))).into_response();
    }
    Json(json!({"status": "ok"})).into_response()
}

pub async fn metrics(State(st): St) -> Response {
    ([("content-type", "text/plain; version=0.0.4")], st.shared.metrics.render()).into_response()
}

pub async fn models(State(st): St, headers: HeaderMap) -> Response {
    let started = Instant::now();
    let result = st.authorize(&headers).map(|()| {
        let i = &st.info;
        Json(json!({"object": "list", "data": [{"id": i.name, "object": "model", "created": i.created, "owned_by": "maxrun", "max_model_len": i.max_length}]})).into_response()
    });
    respond(&st, "/v1/models", "models", started, result)
}

/// SGLang's `GET /server_info` (also `/get_server_info`), which sglang-router
/// reads when it adds a replica: `served_model_name` is the id its
/// `/v1/models` lists. The fields SGLang's server arguments share with
/// maxrun's, and the engine's state.
pub async fn server_info(State(st): St, headers: HeaderMap) -> Response {
    let started = Instant::now();
    let result = st.authorize(&headers).map(|()| {
        let i = &st.info;
        let s = st.shared.stats.lock().expect("never poisoned").clone();
        Json(json!({
            "served_model_name": i.name,
            "model_path": i.artifact,
            "tokenizer_path": i.artifact,
            "context_length": i.max_length,
            "page_size": s.kv_block_size,
            "max_total_num_tokens": s.kv_blocks_total * s.kv_block_size,
            "max_queued_requests": st.max_queue,
            "tp_size": 1,
            "dp_size": 1,
            "is_embedding": i.encoder,
            "version": concat!("maxrun ", env!("CARGO_PKG_VERSION")),
            "internal_states": [{"num_running_reqs": s.running, "num_waiting_reqs": s.waiting, "kv_cache_usage": if s.kv_blocks_total > 0 { s.kv_blocks_used as f64 / s.kv_blocks_total as f64 } else { 0.0 }}],
        }))
        .into_response()
    });
    respond(&st, "/server_info", "server_info", started, result)
}

/// SGLang's `GET /model_info` (also `/get_model_info`).
pub async fn model_info(State(st): St, headers: HeaderMap) -> Response {
    let started = Instant::now();
    let result = st.authorize(&headers).map(|()| {
        let i = &st.info;
        Json(json!({"model_path": i.artifact, "tokenizer_path": i.artifact, "served_model_name": i.name, "is_generation": !i.encoder, "max_model_len": i.max_length})).into_response()
    });
    respond(&st, "/model_info", "model_info", started, result)
}

pub async fn not_found(State(st): St, uri: Uri) -> Response {
    st.count("other", 404);
    ApiError::not_found(uri.path()).into_response()
}

/// The prompts of request field `field` (a string, token ids, or a list of
/// either), each as token ids and as text (what `echo` repeats); `special`:
/// the tokenizer adds its special tokens (a decoder's BOS, an encoder's [CLS]
/// ... [SEP]) to text prompts; token-id prompts are taken as they are.
fn prompt_list(st: &AppState, prompt: &Prompt, field: &str, special: bool) -> Result<Vec<(Vec<u32>, String)>, ApiError> {
    let tokenizer = &st.info.tokenizer;
    let one = |i: Option<usize>, text: Option<&str>, ids: Option<&[u32]>| -> Result<(Vec<u32>, String), ApiError> {
        let param = i.map_or(field.to_string(), |i| format!("{field}[{i}]"));
        let (ids, text) = match (text, ids) {
            (Some(t), _) => {
                let ids = tokenizer.encode(t, special).map(|e| e.get_ids().to_vec()).map_err(|e| ApiError::invalid(format!("the prompt does not tokenize: {e}"), Some(param.clone())))?;
                (ids, t.to_string())
            }
            (None, Some(ids)) => {
                if let Some(&bad) = ids.iter().find(|&&t| t as u64 >= st.info.vocab) {
                    return Err(ApiError::invalid(format!("token id {bad} is outside the vocabulary of {} tokens", st.info.vocab), Some(param)));
                }
                (ids.to_vec(), tokenizer.decode(ids, false).unwrap_or_default())
            }
            (None, None) => unreachable!("a prompt is text or ids"),
        };
        if ids.is_empty() {
            return Err(ApiError::invalid("the prompt is empty: it has no tokens to condition on", Some(param)));
        }
        Ok((ids, text))
    };
    let list = match prompt {
        Prompt::Text(t) => vec![one(None, Some(t), None)?],
        Prompt::Tokens(t) => vec![one(None, None, Some(t))?],
        Prompt::Texts(v) => v.iter().enumerate().map(|(i, t)| one(Some(i), Some(t), None)).collect::<Result<_, _>>()?,
        Prompt::TokenLists(v) => v.iter().enumerate().map(|(i, t)| one(Some(i), None, Some(t))).collect::<Result<_, _>>()?,
    };
    if list.is_empty() {
        return Err(ApiError::invalid(format!("{field} is an empty list; send at least one"), Some(field.into())));
    }
    Ok(list)
}

/// Refuses a prompt that leaves no room for a token.
fn check_length(st: &AppState, tokens: usize, param: &str) -> Result<(), ApiError> {
    let max = st.info.max_length;
    if tokens as u64 > max {
        return Err(ApiError::too_long(tokens, max, param));
    }
    if tokens as u64 == max {
        return Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::invalid(format!("prompt is too long: {tokens} tokens fill the maximum context length of {max} tokens and leave no room for a reply"), Some(param.into()))
        });
    }
    Ok(())
}

/// What a finished generation gathered.
struct Gathered {
    text: String,
    reason: FinishReason,
    usage: maxrun_engine::Usage,
    logprobs: Vec<(String, TokenLogprob)>,
    /// The prompt's tokens from the second on, scored (echo with logprobs).
    prompt_logprobs: Vec<TokenLogprob>,
}

/// Waits for a request's updates to its end.
async fn gather(mut rx: tmpsc::UnboundedReceiver<Update>) -> Result<Gathered, ApiError> {
    let mut g = Gathered { text: String::new(), reason: FinishReason::Stop, usage: Default::default(), logprobs: vec![], prompt_logprobs: vec![] };
    while let Some(u) = rx.recv().await {
        match u {
            Update::Token { text, logprob, .. } => {
                g.text.push_str(&text);
                if let Some(lp) = logprob {
                    g.logprobs.push((text, lp));
                }
            }
            Update::PromptLogprob(lp) => g.prompt_logprobs.push(lp),
            Update::Finished { reason, text, usage } => {
                g.text.push_str(&text);
                g.reason = reason;
                g.usage = usage;
                return Ok(g);
            }
            Update::Failed(e) => return Err(e),
        }
    }
    Err(ApiError::internal("the engine's thread ended"))
}

/// The response flavour of an endpoint.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// The prompt a completion choice repeats before its text (`echo`).
#[derive(Clone)]
struct Echo {
    text: String,
    tokens: Vec<u32>,
}

/// One choice of a response: the updates of its generation.
struct Choice {
    rx: tmpsc::UnboundedReceiver<Update>,
    echo: Option<Echo>,
    /// The first choice of its prompt: its prompt tokens count in the usage once.
    counts_prompt: bool,
}

/// What to generate: each prompt `n` times (choice `p * n + j` is prompt `p`'s
/// `j`-th, seeded `seed + j`).
struct Plan {
    prompts: Vec<(Vec<u32>, Option<Echo>)>,
    n: usize,
    params: GenerationParams,
    grammar_field: &'static str,
}

/// Starts every choice's generation; returns their update channels.
fn start(st: &AppState, plan: Plan) -> Result<Vec<Choice>, ApiError> {
    let mut choices = Vec::with_capacity(plan.prompts.len() * plan.n);
    for (prompt, echo) in plan.prompts {
        for j in 0..plan.n {
            let (tx, rx) = tmpsc::unbounded_channel();
            let params = GenerationParams { seed: plan.params.seed.wrapping_add(j as u64), ..plan.params.clone() };
            st.send(Job::Generate { prompt: prompt.clone(), params, arrived: Instant::now(), updates: tx, grammar_field: plan.grammar_field, admitted: None })?;
            choices.push(Choice { rx, echo: echo.clone(), counts_prompt: j == 0 });
        }
    }
    Ok(choices)
}

/// Everything one generation request's response needs.
struct Reply {
    st: Arc<AppState>,
    kind: Kind,
    id: String,
    endpoint: &'static str,
    started: Instant,
    include_usage: bool,
    logprobs: Option<usize>,
    guard: InFlight,
    /// Chat with tools: how the reply's calls are read and answered.
    tools: Option<ToolReply>,
    /// Chat with a reasoning parser: whether the prompt opened `<think>`.
    think: Option<bool>,
    /// Streamed thinking goes out as it comes (else in one delta when it ends:
    /// SGLang's `stream_reasoning: false`).
    stream_reasoning: bool,
}

/// How a chat reply with tools is read and answered.
#[derive(Clone, Copy, Debug)]
pub(super) struct ToolReply {
    pub format: maxrun_engine::constrain::tools::ToolFormat,
    /// The reply is held to the call grammar (`tool_choice` required or a
    /// named function): its calls stream as they are generated.
    pub forced: bool,
    /// A named function: OpenAI (and vLLM, matching it) end such a reply with
    /// `finish_reason: "stop"`, and `"tool_calls"` only for calls the model chose.
    pub named: bool,
    /// `parallel_tool_calls: false` or a named function: calls past the first
    /// are dropped (the call grammar already allows only one).
    pub max_calls: Option<usize>,
}

impl ToolReply {
    /// The finish reason of a reply whose engine reason is `reason`: a reply that
    /// made calls and ended by itself says so, unless a named function forced it.
    fn finish(&self, reason: &'static str, called: bool) -> &'static str {
        if called && reason == "stop" && !self.named {
            "tool_calls"
        } else {
            reason
        }
    }
}

/// The id of call `i` of choice `choice` of response `id`.
fn call_id(id: &str, choice: usize, i: usize) -> String {
    format!("call_{}_{choice}_{i}", id.trim_start_matches("chatcmpl-"))
}

/// OpenAI's `tool_calls` entries of choice `choice` (ids from the request's).
fn tool_calls_json(id: &str, choice: usize, calls: &[maxrun_engine::constrain::tools::ToolCall]) -> Vec<Value> {
    calls.iter().enumerate().map(|(i, c)| json!({"id": call_id(id, choice, i), "type": "function", "function": {"name": c.name, "arguments": c.arguments.to_string()}})).collect()
}

/// What one streamed choice has sent so far.
struct ChoiceStream {
    first: bool,
    /// Bytes of completion text sent (`text_offset` of the next token).
    offset: usize,
    done: bool,
    think: Option<maxrun_engine::constrain::reasoning::ThinkSplitter>,
    calls: Option<maxrun_engine::constrain::tools::ToolStream>,
    /// A call was sent.
    called: bool,
    /// Thinking not sent yet (`stream_reasoning: false`).
    held_reasoning: String,
}

impl Reply {
    fn base(&self) -> Value {
        let object = match self.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        };
        json!({"id": self.id, "object": object, "created": now_secs(), "model": self.st.info.name})
    }

    /// The `logprobs` of a completion choice: the echoed prompt's tokens (the
    /// first has no log-probability), then the generated ones.
    fn completion_logprobs(&self, echo: Option<(&Echo, &[TokenLogprob])>, tokens: &[(String, TokenLogprob)], offset: usize) -> Value {
        if self.logprobs.is_none() {
            return Value::Null;
        }
        let tokenizer = &self.st.info.tokenizer;
        let mut entries: Vec<(String, Option<&TokenLogprob>)> = Vec::new();
        if let Some((e, scored)) = echo {
            for (p, &t) in e.tokens.iter().enumerate() {
                entries.push((openai::token_text(tokenizer, t), p.checked_sub(1).and_then(|i| scored.get(i))));
            }
        }
        entries.extend(tokens.iter().map(|(text, lp)| (text.clone(), Some(lp))));
        openai::completion_logprobs(&entries, tokenizer, offset)
    }

    fn chat_logprobs(&self, tokens: &[(String, TokenLogprob)]) -> Value {
        if self.logprobs.is_none() {
            return Value::Null;
        }
        openai::chat_logprobs(tokens, &self.st.info.tokenizer)
    }

    /// A completion chunk of choice `index` with `text` (and `finish`, on its last).
    fn text_chunk(&self, index: usize, text: &str, logprobs: Value, finish: Option<&str>) -> Value {
        let mut v = self.base();
        v["choices"] = json!([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]);
        v
    }

    /// A chat chunk of choice `index` with `delta`.
    fn delta_chunk(&self, index: usize, delta: Value, logprobs: &[(String, TokenLogprob)], finish: Option<&str>) -> Value {
        let mut v = self.base();
        v["choices"] = json!([{"index": index, "delta": delta, "logprobs": self.chat_logprobs(logprobs), "finish_reason": finish}]);
        v
    }

    /// Splits a finished chat reply into reasoning, content and tool calls.
    fn split(&self, text: String) -> (Option<String>, String, Vec<maxrun_engine::constrain::tools::ToolCall>) {
        let (reasoning, content) = match self.think {
            Some(open) => {
                let (r, c) = maxrun_engine::constrain::reasoning::split(&text, open);
                (Some(r), c)
            }
            None => (None, text),
        };
        match self.tools {
            Some(t) => {
                let mut p = maxrun_engine::constrain::tools::parse(&content, t.format);
                if let Some(max) = t.max_calls {
                    p.calls.truncate(max);
                }
                (reasoning, p.content, p.calls)
            }
            None => (reasoning, content, vec![]),
        }
    }

    /// The whole response at once.
    async fn whole(self, choices: Vec<Choice>) -> Result<Response, ApiError> {
        let gathered = futures_util::future::join_all(choices.into_iter().map(|c| async move { (gather(c.rx).await, c.echo, c.counts_prompt) })).await;
        let (mut prompt_tokens, mut completion_tokens) = (0, 0);
        let (mut out, mut reasons) = (Vec::new(), Vec::new());
        for (index, (g, echo, counts_prompt)) in gathered.into_iter().enumerate() {
            let g = g?;
            if counts_prompt {
                prompt_tokens += g.usage.prompt_tokens;
            }
            completion_tokens += g.usage.completion_tokens;
            let mut reason = g.reason.name();
            out.push(match self.kind {
                Kind::Completion => {
                    let lp = self.completion_logprobs(echo.as_ref().map(|e| (e, g.prompt_logprobs.as_slice())), &g.logprobs, 0);
                    let text = match &echo {
                        Some(e) => format!("{}{}", e.text, g.text),
                        None => g.text,
                    };
                    json!({"index": index, "text": text, "logprobs": lp, "finish_reason": reason})
                }
                Kind::Chat => {
                    let lp = self.chat_logprobs(&g.logprobs);
                    let (reasoning, content, calls) = self.split(g.text);
                    let mut message = json!({"role": "assistant", "content": if content.is_empty() && !calls.is_empty() { Value::Null } else { json!(content) }});
                    if let Some(r) = reasoning {
                        message["reasoning_content"] = if r.is_empty() { Value::Null } else { json!(r) };
                    }
                    if !calls.is_empty() {
                        message["tool_calls"] = json!(tool_calls_json(&self.id, index, &calls));
                    }
                    if let Some(t) = self.tools {
                        reason = t.finish(reason, !calls.is_empty());
                    }
                    json!({"index": index, "message": message, "logprobs": lp, "finish_reason": reason})
                }
            });
            reasons.push(reason);
        }
        let usage = openai::Usage::new(prompt_tokens, completion_tokens);
        let mut v = self.base();
        if self.kind == Kind::Chat {
            v["object"] = json!("chat.completion");
        }
        v["choices"] = json!(out);
        v["usage"] = json!(usage);
        log_request(&self.id, self.endpoint, 200, Some((usage.prompt_tokens, usage.completion_tokens)), self.started, Some(&reasons.join(",")));
        drop(self.guard);
        Ok(Json(v).into_response())
    }

    /// The chunk that opens choice `index` (`role: assistant`), unless sent.
    fn open(&self, index: usize, c: &mut ChoiceStream, out: &mut Vec<Value>) {
        if c.first {
            out.push(self.delta_chunk(index, json!({"role": "assistant", "content": ""}), &[], None));
            c.first = false;
        }
    }

    /// Call pieces as OpenAI streams them: a call's index, id, type and name
    /// with empty arguments, then its arguments in pieces under its index. The
    /// first opens the choice when nothing else has (`role: assistant`,
    /// `content: null`).
    fn call_chunks(&self, index: usize, c: &mut ChoiceStream, deltas: Vec<maxrun_engine::constrain::tools::CallDelta>, out: &mut Vec<Value>) {
        use maxrun_engine::constrain::tools::CallDelta;
        for d in deltas {
            let mut delta = match d {
                CallDelta::Head { index: i, name } => {
                    c.called = true;
                    json!({"tool_calls": [{"index": i, "id": call_id(&self.id, index, i), "type": "function", "function": {"name": name, "arguments": ""}}]})
                }
                CallDelta::Arguments { index: i, text } => json!({"tool_calls": [{"index": i, "function": {"arguments": text}}]}),
            };
            if c.first {
                delta["role"] = json!("assistant");
                delta["content"] = Value::Null;
                c.first = false;
            }
            out.push(self.delta_chunk(index, delta, &[], None));
        }
    }

    /// One update of choice `index` as the events it makes.
    fn stream_update(&self, index: usize, c: &mut ChoiceStream, u: Update, out: &mut Vec<Value>) -> Result<Option<(&'static str, maxrun_engine::Usage)>, ApiError> {
        match u {
            Update::PromptLogprob(_) => {}
            Update::Token { text, logprob, .. } => {
                let lps: Vec<(String, TokenLogprob)> = logprob.into_iter().map(|lp| (text.clone(), lp)).collect();
                match self.kind {
                    Kind::Completion => {
                        if !text.is_empty() || !lps.is_empty() {
                            out.push(self.text_chunk(index, &text, self.completion_logprobs(None, &lps, c.offset), None));
                            c.offset += text.len();
                        }
                    }
                    Kind::Chat => {
                        let (reasoning, content) = match &mut c.think {
                            Some(t) => t.push(&text),
                            None => (String::new(), text),
                        };
                        let (content, deltas) = match &mut c.calls {
                            Some(calls) => {
                                let content = calls.push(&content);
                                (content, calls.deltas())
                            }
                            None => (content, vec![]),
                        };
                        // A reply held to the call grammar opens with its first call
                        // (`content: null`), as OpenAI's do; others with the role at once.
                        if !self.tools.is_some_and(|t| t.forced) {
                            self.open(index, c, out);
                        }
                        if !self.stream_reasoning {
                            c.held_reasoning.push_str(&reasoning);
                        } else if !reasoning.is_empty() {
                            self.open(index, c, out);
                            out.push(self.delta_chunk(index, json!({"reasoning_content": reasoning}), &[], None));
                        }
                        if !content.is_empty() || !lps.is_empty() {
                            self.open(index, c, out);
                            // The thinking ended where the content begins.
                            if !c.held_reasoning.is_empty() {
                                out.push(self.delta_chunk(index, json!({"reasoning_content": std::mem::take(&mut c.held_reasoning)}), &[], None));
                            }
                            out.push(self.delta_chunk(index, json!({"content": content}), &lps, None));
                        }
                        self.call_chunks(index, c, deltas, out);
                    }
                }
            }
            Update::Finished { reason, text, usage } => {
                c.done = true;
                let mut reason = reason.name();
                match self.kind {
                    Kind::Completion => out.push(self.text_chunk(index, &text, Value::Null, Some(reason))),
                    Kind::Chat => {
                        let (reasoning, mut content) = match &mut c.think {
                            Some(t) => {
                                let (r1, c1) = t.push(&text);
                                let (r2, c2) = t.finish();
                                (r1 + &r2, c1 + &c2)
                            }
                            None => (String::new(), text),
                        };
                        let reasoning = std::mem::take(&mut c.held_reasoning) + &reasoning;
                        let mut deltas = vec![];
                        if let Some(s) = &mut c.calls {
                            let sent = s.push(&content);
                            let (_, rest, last) = s.finish(self.tools.and_then(|t| t.max_calls));
                            content = sent + &rest;
                            deltas = last;
                        }
                        if !reasoning.is_empty() {
                            self.open(index, c, out);
                            out.push(self.delta_chunk(index, json!({"reasoning_content": reasoning}), &[], None));
                        }
                        if !content.is_empty() {
                            self.open(index, c, out);
                            out.push(self.delta_chunk(index, json!({"content": content}), &[], None));
                        }
                        self.call_chunks(index, c, deltas, out);
                        self.open(index, c, out);
                        if let Some(t) = self.tools {
                            reason = t.finish(reason, c.called);
                        }
                        out.push(self.delta_chunk(index, json!({}), &[], Some(reason)));
                    }
                }
                return Ok(Some((reason, usage)));
            }
            Update::Failed(e) => return Err(e),
        }
        Ok(None)
    }

    /// Server-sent events: a chunk per token with visible text (or a
    /// log-probability), each choice's last with its finish reason, the usage
    /// when asked, then `[DONE]`. Choices are interleaved as their tokens come.
    /// A completion with `echo` first sends each choice's prompt (with its
    /// tokens' log-probabilities, once they are scored). A chat with a
    /// reasoning parser streams the thinking as `reasoning_content` deltas;
    /// with tools, text that may be a call is held back, and the calls come as
    /// `tool_calls` deltas at the end.
    fn stream(self, choices: Vec<Choice>) -> Response {
        use maxrun_engine::constrain::{reasoning::ThinkSplitter, tools::ToolStream};
        use futures_util::StreamExt;
        struct S {
            reply: Reply,
            merged: futures_util::stream::SelectAll<futures_util::stream::BoxStream<'static, (usize, Option<Update>)>>,
            choices: Vec<ChoiceStream>,
            /// Echoed prompts not yet sent, and their scores so far.
            echoes: Vec<Option<(Echo, Vec<TokenLogprob>)>>,
            counts_prompt: Vec<bool>,
            usage: (usize, usize),
            reasons: Vec<&'static str>,
            done: bool,
            queue: std::collections::VecDeque<SseEvent>,
        }
        let event = |v: Value| SseEvent::default().data(v.to_string());
        let mut streams = Vec::new();
        let (mut echoes, mut counts_prompt) = (Vec::new(), Vec::new());
        for (index, c) in choices.into_iter().enumerate() {
            echoes.push(c.echo.map(|e| (e, Vec::new())));
            counts_prompt.push(c.counts_prompt);
            // Each choice's updates, then one `None` when its channel ends.
            let updates = futures_util::stream::unfold(Some(c.rx), move |rx| async move {
                let mut rx = rx?;
                match rx.recv().await {
                    Some(u) => Some(((index, Some(u)), Some(rx))),
                    None => Some(((index, None), None)),
                }
            });
            streams.push(updates.boxed());
        }
        let new_choice = |_| ChoiceStream { first: true, offset: 0, done: false, think: self.think.map(ThinkSplitter::new), calls: self.tools.map(|t| ToolStream::new(t.format, t.forced)), called: false, held_reasoning: String::new() };
        let choice_state: Vec<ChoiceStream> = (0..streams.len()).map(new_choice).collect();
        let state = S { reply: self, merged: futures_util::stream::select_all(streams), choices: choice_state, echoes, counts_prompt, usage: (0, 0), reasons: vec![], done: false, queue: Default::default() };
        let stream = futures_util::stream::unfold(state, move |mut s| async move {
            loop {
                if let Some(e) = s.queue.pop_front() {
                    return Some((Ok::<_, std::convert::Infallible>(e), s));
                }
                if s.done {
                    return None;
                }
                let next = s.merged.next().await;
                let r = &s.reply;
                let (index, update) = match next {
                    Some((index, Some(u))) => (index, u),
                    Some((index, None)) => {
                        if !s.choices[index].done {
                            // The engine's thread went away without an end.
                            s.choices[index].done = true;
                            s.queue.push_back(SseEvent::default().data(ApiError::internal("the engine's thread ended").body().to_string()));
                            s.queue.push_back(SseEvent::default().data("[DONE]"));
                            s.done = true;
                        }
                        continue;
                    }
                    None => {
                        s.done = true;
                        continue;
                    }
                };
                // An echoed prompt goes first: once scored (its log-probabilities
                // come before the first token), or at once without logprobs.
                if let Some((echo, scored)) = &mut s.echoes[index] {
                    if let Update::PromptLogprob(lp) = &update {
                        scored.push(lp.clone());
                        continue;
                    }
                    let lp = r.completion_logprobs(Some((echo, scored)), &[], 0);
                    s.queue.push_back(event(r.text_chunk(index, &echo.text, lp, None)));
                    s.choices[index].offset = echo.text.len();
                    s.echoes[index] = None;
                }
                let mut chunks = Vec::new();
                match r.stream_update(index, &mut s.choices[index], update, &mut chunks) {
                    Ok(finished) => {
                        s.queue.extend(chunks.into_iter().map(event));
                        if let Some((reason, usage)) = finished {
                            s.reasons.push(reason);
                            if s.counts_prompt[index] {
                                s.usage.0 += usage.prompt_tokens;
                            }
                            s.usage.1 += usage.completion_tokens;
                            if s.choices.iter().all(|c| c.done) {
                                s.done = true;
                                if r.include_usage {
                                    let mut u = r.base();
                                    u["choices"] = json!([]);
                                    u["usage"] = json!(openai::Usage::new(s.usage.0, s.usage.1));
                                    s.queue.push_back(event(u));
                                }
                                s.queue.push_back(SseEvent::default().data("[DONE]"));
                                log_request(&r.id, r.endpoint, 200, Some(s.usage), r.started, Some(&s.reasons.join(",")));
                            }
                        }
                    }
                    Err(e) => {
                        // Headers are sent: the error goes in the stream, as OpenAI does.
                        s.done = true;
                        log_request(&r.id, r.endpoint, e.status, None, r.started, None);
                        s.queue.push_back(SseEvent::default().data(e.body().to_string()));
                        s.queue.push_back(SseEvent::default().data("[DONE]"));
                    }
                }
            }
        });
        Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
    }
}

pub async fn completions(State(st): St, headers: HeaderMap, body: Bytes) -> Response {
    let started = Instant::now();
    let id = format!("cmpl-{}", st.next_id.fetch_add(1, Ordering::Relaxed));
    let result = completions_inner(&st, &headers, &body, &id, started).await;
    respond(&st, "/v1/completions", &id, started, result)
}

async fn completions_inner(st: &Arc<AppState>, headers: &HeaderMap, body: &[u8], id: &str, started: Instant) -> Result<Response, ApiError> {
    st.authorize(headers)?;
    let (r, sampling): (CompletionRequest, _) = openai::parse_allowing(body, openai::COMPLETION_FIELDS, true, st.allow_extra_fields)?;
    st.check_model(&r.model)?;
    if st.info.encoder {
        return Err(ApiError::invalid("this model is a sentence encoder: use /v1/embeddings", Some("model".into())));
    }
    openai::check_completion_extras(&r)?;
    let n = openai::choices(&sampling)?;
    let prompts = prompt_list(st, &r.prompt, "prompt", r.add_special_tokens)?;
    if prompts.len() * n > openai::MAX_CHOICES {
        return Err(ApiError::invalid(format!("{} prompts x n = {n} make {} choices; at most {} per request", prompts.len(), prompts.len() * n, openai::MAX_CHOICES), Some("n".into())));
    }
    for (i, (ids, _)) in prompts.iter().enumerate() {
        check_length(st, ids.len(), if prompts.len() == 1 { "prompt".into() } else { format!("prompt[{i}]") }.as_str())?;
    }
    // OpenAI's completions default to 16 tokens; with echo, 0 scores the prompt.
    let logprobs = r.logprobs.map(|n| n as usize);
    let mut params = openai::generation_params(&sampling, sampling.max_tokens, 16, logprobs, r.echo, &st.info.defaults)?;
    if r.echo {
        params.prompt_logprobs = logprobs;
    }
    params.logit_bias = openai::logit_bias(&r.logit_bias, st.info.vocab)?;
    let (grammar_field, grammar) = openai::grammar(&r.response_format, &r.guided)?.map_or(("response_format", None), |(f, g)| (f, Some(g)));
    params.grammar = grammar;
    let prompts = prompts.into_iter().map(|(ids, text)| {
        let echo = r.echo.then(|| Echo { text, tokens: ids.clone() });
        (ids, echo)
    });
    let guard = st.admit()?;
    let choices = start(st, Plan { prompts: prompts.collect(), n, params, grammar_field })?;
    let include_usage = sampling.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let reply = Reply { st: st.clone(), kind: Kind::Completion, id: id.to_string(), endpoint: "/v1/completions", started, include_usage, logprobs, guard, tools: None, think: None, stream_reasoning: true };
    if sampling.stream {
        Ok(reply.stream(choices))
    } else {
        reply.whole(choices).await
    }
}

pub async fn chat(State(st): St, headers: HeaderMap, body: Bytes) -> Response {
    let started = Instant::now();
    let id = format!("chatcmpl-{}", st.next_id.fetch_add(1, Ordering::Relaxed));
    let result = chat_inner(&st, &headers, &body, &id, started).await;
    respond(&st, "/v1/chat/completions", &id, started, result)
}

async fn chat_inner(st: &Arc<AppState>, headers: &HeaderMap, body: &[u8], id: &str, started: Instant) -> Result<Response, ApiError> {
    st.authorize(headers)?;
    let (r, sampling): (ChatRequest, _) = openai::parse_allowing(body, openai::CHAT_FIELDS, true, st.allow_extra_fields)?;
    st.check_model(&r.model)?;
    if st.info.encoder {
        return Err(ApiError::invalid("this model is a sentence encoder: use /v1/embeddings", Some("model".into())));
    }
    let logprobs = openai::check_chat_extras(&r)?;
    let offered = openai::tools(&r.tools)?;
    let choice = openai::tool_choice(&r.tool_choice, &offered)?;
    let n = openai::choices(&sampling)?;
    let grammar = openai::grammar(&r.response_format, &r.guided)?;
    let ask = ChatAsk {
        messages: &r.messages,
        messages_param: "messages",
        offered,
        choice,
        parallel_tool_calls: r.parallel_tool_calls,
        grammar,
        limit: r.max_completion_tokens.or(sampling.max_tokens),
        sampling: &sampling,
        logprobs,
        tools_param: |i| format!("tools[{i}].function.parameters"),
        continue_final: r.continue_final_message,
        separate_reasoning: r.separate_reasoning.unwrap_or(true),
    };
    let logit_bias = openai::logit_bias(&r.logit_bias, st.info.vocab)?;
    let mut job = prepare_chat(st, ask)?;
    job.params.logit_bias = logit_bias;
    let guard = st.admit()?;
    let choices = start(st, Plan { prompts: vec![(job.prompt, None)], n, params: job.params, grammar_field: job.grammar_field })?;
    let include_usage = sampling.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let stream_reasoning = r.stream_reasoning.unwrap_or(true);
    let reply = Reply { st: st.clone(), kind: Kind::Chat, id: id.to_string(), endpoint: "/v1/chat/completions", started, include_usage, logprobs, guard, tools: job.tools, think: job.think, stream_reasoning };
    if sampling.stream {
        Ok(reply.stream(choices))
    } else {
        reply.whole(choices).await
    }
}

/// What a chat-shaped request asks of the engine, from `/v1/chat/completions`
/// or `/v1/responses` (`responses.rs`, which turns its items into messages).
pub(super) struct ChatAsk<'a> {
    pub messages: &'a [openai::ChatMessage],
    /// The request field the messages came from, for errors.
    pub messages_param: &'static str,
    pub offered: Vec<maxrun_engine::constrain::tools::Tool>,
    pub choice: openai::ToolChoice,
    pub parallel_tool_calls: Option<bool>,
    /// The grammar the request's own fields set, and the field that set it.
    pub grammar: Option<(&'static str, maxrun_engine::constrain::Grammar)>,
    /// The token limit the request set (`None`: to the end of the context).
    pub limit: Option<u64>,
    pub sampling: &'a openai::Sampling,
    pub logprobs: Option<usize>,
    /// The field of tool `i`'s parameters schema, for errors.
    pub tools_param: fn(usize) -> String,
    /// The reply continues the last message, an assistant's (vLLM's
    /// `continue_final_message`): the prompt ends with that message's text,
    /// without its end of turn or a generation prompt.
    pub continue_final: bool,
    /// With a reasoning parser, the thinking goes to `reasoning_content`.
    pub separate_reasoning: bool,
}

/// A chat-shaped request ready for the engine.
pub(super) struct ChatJob {
    pub prompt: Vec<u32>,
    pub params: GenerationParams,
    pub grammar_field: &'static str,
    /// How the reply's calls are read, where the request uses tools.
    pub tools: Option<ToolReply>,
    /// With a reasoning parser: whether the prompt opened `<think>`.
    pub think: Option<bool>,
}

/// The path every chat-shaped request takes to the engine: the messages
/// through the chat template (with the tools where the request uses them),
/// the prompt's length checked, the generation parameters, and the reply held
/// to the call grammar for a required or named tool choice (a named function
/// exactly once, `required` at least once, once only with
/// `parallel_tool_calls: false`).
pub(super) fn prepare_chat(st: &AppState, ask: ChatAsk<'_>) -> Result<ChatJob, ApiError> {
    use maxrun_engine::constrain::tools;
    let use_tools = ask.choice != openai::ToolChoice::None;
    let (mut text, format) = chat_text(st, ask.messages, use_tools.then_some(ask.offered.as_slice()), !ask.continue_final, ask.messages_param)?;
    if ask.continue_final {
        text = continued(text, ask.messages)?;
    }
    // A template that opens the thinking itself starts the reply inside it.
    let think = (st.info.reasoning && ask.separate_reasoning).then(|| text.trim_end().ends_with("<think>"));
    let prompt = prompt_list(st, &Prompt::Text(text), ask.messages_param, false)?.remove(0).0;
    check_length(st, prompt.len(), ask.messages_param)?;
    // Without a limit, a reply may run to the end of the context.
    let default_max = (st.info.max_length as usize).saturating_sub(prompt.len());
    let mut params = openai::generation_params(ask.sampling, ask.limit, default_max, ask.logprobs, false, &st.info.defaults)?;
    let (mut grammar_field, grammar) = ask.grammar.map_or(("response_format", None), |(f, g)| (f, Some(g)));
    params.grammar = grammar;
    let named = matches!(ask.choice, openai::ToolChoice::Named(_));
    let parallel = ask.parallel_tool_calls.unwrap_or(true) && !named;
    let forced: Vec<(usize, tools::Tool)> = match &ask.choice {
        openai::ToolChoice::Required => ask.offered.iter().cloned().enumerate().collect(),
        openai::ToolChoice::Named(n) => ask.offered.iter().cloned().enumerate().filter(|(_, t)| &t.name == n).collect(),
        _ => vec![],
    };
    if !forced.is_empty() {
        if params.grammar.is_some() {
            return Err(ApiError::invalid(format!("a required tool call and {grammar_field} cannot both hold the reply; send one"), Some("tool_choice".into())));
        }
        let chosen: Vec<tools::Tool> = forced.iter().map(|(_, t)| t.clone()).collect();
        let grammar = tools::grammar(&chosen, format, parallel).map_err(|(i, e)| {
            let at = (ask.tools_param)(forced[i].0);
            ApiError::invalid(format!("{at}: {e}"), Some(at))
        })?;
        params.grammar = Some(grammar);
        grammar_field = "tools";
    }
    let tools = use_tools.then_some(ToolReply { format, forced: !forced.is_empty(), named, max_calls: (!parallel).then_some(1) });
    Ok(ChatJob { prompt, params, grammar_field, tools, think })
}

/// A rendered chat cut after the last message's text, so the reply continues
/// it, as transformers' `apply_chat_template(continue_final_message=True)`
/// (which vLLM calls) cuts it: at the last occurrence of that text (stripped
/// of surrounding white space if the template strips it).
fn continued(mut text: String, messages: &[openai::ChatMessage]) -> Result<String, ApiError> {
    let param = Some("continue_final_message".to_string());
    let last = messages.len().saturating_sub(1);
    let Some(m) = messages.last().filter(|m| m.role == "assistant") else {
        return Err(ApiError::invalid("continue_final_message continues the last message, which must be an assistant's", param));
    };
    let final_text = openai::message_text(m, last)?;
    let end = match text.rfind(final_text.as_str()) {
        Some(at) if !final_text.is_empty() => at + final_text.len(),
        _ => match text.rfind(final_text.trim()) {
            Some(at) if !final_text.trim().is_empty() => at + final_text.trim().len(),
            _ => return Err(ApiError::invalid("the chat template does not render the last message's text as it is, so the reply cannot continue it; send it without continue_final_message", param)),
        },
    };
    text.truncate(end);
    Ok(text)
}

/// The text of a chat prompt: `messages` through the artifact's chat template,
/// with `tools` where the request uses them (a template that takes `tools`
/// renders them and its own call format; for others they are described in a
/// system message, in Hermes's format), ending with the generation prompt
/// when `add_generation_prompt`. Also returns the call format the reply uses.
fn chat_text(st: &AppState, messages: &[openai::ChatMessage], tools: Option<&[maxrun_engine::constrain::tools::Tool]>, add_generation_prompt: bool, param: &str) -> Result<(String, maxrun_engine::constrain::tools::ToolFormat), ApiError> {
    use maxrun_engine::constrain::tools::{self, ToolFormat};
    let Some(template) = &st.info.template else {
        return Err(ApiError::invalid("this model has no chat template; use /v1/completions", Some(param.into())));
    };
    let template_tools = template.contains("tools");
    let format = if template_tools { st.info.tool_format } else { ToolFormat::Hermes };
    let mut rendered: Vec<Value> = Vec::with_capacity(messages.len() + 1);
    for (i, m) in messages.iter().enumerate() {
        let text = openai::message_text(m, i)?;
        let calls = parse_calls(m, i)?;
        let message = match m.role.as_str() {
            "system" | "user" => json!({"role": m.role, "content": text}),
            // OpenAI's newer name for system instructions.
            "developer" => json!({"role": "system", "content": text}),
            "assistant" if template_tools && !calls.is_empty() => {
                let tool_calls: Vec<Value> = calls.iter().map(|(id, c)| json!({"id": id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})).collect();
                json!({"role": "assistant", "content": text, "tool_calls": tool_calls})
            }
            "assistant" if !calls.is_empty() => {
                let c: Vec<tools::ToolCall> = calls.into_iter().map(|(_, c)| c).collect();
                let joined = [text.as_str(), &tools::hermes_calls_text(&c)].iter().filter(|s| !s.is_empty()).copied().collect::<Vec<_>>().join("\n");
                json!({"role": "assistant", "content": joined})
            }
            "assistant" => json!({"role": "assistant", "content": text}),
            "tool" if template_tools => json!({"role": "tool", "content": text, "tool_call_id": m.tool_call_id, "name": m.name}),
            "tool" => json!({"role": "user", "content": format!("<tool_response>\n{text}\n</tool_response>")}),
            other => {
                return Err(ApiError::invalid(format!("role `{other}` is not supported; use system, developer, user, assistant or tool"), Some(format!("messages[{i}].role"))));
            }
        };
        rendered.push(message);
    }
    let offered = tools.unwrap_or_default();
    if tools.is_some() && !template_tools {
        let described = tools::hermes_system_prompt(offered);
        match rendered.first_mut().filter(|m| m["role"] == "system") {
            Some(system) => system["content"] = json!(format!("{}\n\n{described}", system["content"].as_str().unwrap_or(""))),
            None => rendered.insert(0, json!({"role": "system", "content": described})),
        }
    }
    let tool_values: Vec<Value> = offered.iter().map(|t| json!({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}})).collect();
    let text = maxrun_runtime::chat::render_with_tools(template, &rendered, (tools.is_some() && template_tools).then_some(tool_values.as_slice()), add_generation_prompt, &st.info.bos_text, &st.info.eos_text)
        .map_err(|e| ApiError::invalid(format!("the model's chat template does not render these messages: {e}"), Some(param.into())))?;
    Ok((text, format))
}

/// An assistant message's earlier calls: (id, call), arguments parsed from their JSON text.
fn parse_calls(m: &openai::ChatMessage, index: usize) -> Result<Vec<(String, maxrun_engine::constrain::tools::ToolCall)>, ApiError> {
    let mut out = Vec::new();
    for (k, c) in m.tool_calls.iter().flatten().enumerate() {
        let at = format!("messages[{index}].tool_calls[{k}]");
        let f = c.get("function").ok_or_else(|| ApiError::invalid("a tool call without `function`", Some(at.clone())))?;
        let name = f.get("name").and_then(Value::as_str).ok_or_else(|| ApiError::invalid("a tool call without a function name", Some(at.clone())))?;
        let arguments = match f.get("arguments") {
            Some(Value::String(s)) => serde_json::from_str(s).map_err(|e| ApiError::invalid(format!("arguments are not JSON: {e}"), Some(at.clone())))?,
            Some(v) => v.clone(),
            None => json!({}),
        };
        let id = c.get("id").and_then(Value::as_str).map_or_else(|| format!("call_{index}_{k}"), str::to_string);
        out.push((id, maxrun_engine::constrain::tools::ToolCall { name: name.to_string(), arguments }));
    }
    Ok(out)
}

pub async fn tokenize(State(st): St, headers: HeaderMap, body: Bytes) -> Response {
    let started = Instant::now();
    let id = format!("tok-{}", st.next_id.fetch_add(1, Ordering::Relaxed));
    let result = tokenize_inner(&st, &headers, &body, &id, started);
    respond(&st, "/tokenize", &id, started, result)
}

/// `/tokenize` (vLLM's shape): the ids of a text prompt, or of chat messages
/// through the chat template exactly as a chat request renders them, with the
/// count and the context they must fit. Tokenizing is short CPU work on the
/// request's own thread; the body limit bounds it.
fn tokenize_inner(st: &AppState, headers: &HeaderMap, body: &[u8], id: &str, started: Instant) -> Result<Response, ApiError> {
    st.authorize(headers)?;
    let (r, _): (TokenizeRequest, _) = openai::parse_allowing(body, openai::TOKENIZE_FIELDS, false, st.allow_extra_fields)?;
    st.check_model(&r.model)?;
    r.check()?;
    let (text, special, param) = match (&r.prompt, &r.messages) {
        (Some(p), _) => (p.clone(), r.add_special_tokens.unwrap_or(true), "prompt"),
        (None, Some(messages)) => {
            let offered = openai::tools(&r.tools)?;
            let tools = (!offered.is_empty()).then_some(offered.as_slice());
            let (text, _) = chat_text(st, messages, tools, r.add_generation_prompt.unwrap_or(true), "messages")?;
            (text, r.add_special_tokens.unwrap_or(false), "messages")
        }
        (None, None) => unreachable!("TokenizeRequest::check refuses a request with neither"),
    };
    let tokenizer = &st.info.tokenizer;
    let tokens = tokenizer.encode(text.as_str(), special).map_err(|e| ApiError::invalid(format!("the text does not tokenize: {e}"), Some(param.into())))?.get_ids().to_vec();
    let mut v = json!({"count": tokens.len(), "max_model_len": st.info.max_length, "tokens": tokens});
    if r.return_token_strs {
        v["token_strs"] = json!(tokens.iter().map(|&t| tokenizer.id_to_token(t).unwrap_or_default()).collect::<Vec<_>>());
    }
    log_request(id, "/tokenize", 200, Some((tokens.len(), 0)), started, None);
    Ok(Json(v).into_response())
}

pub async fn detokenize(State(st): St, headers: HeaderMap, body: Bytes) -> Response {
    let started = Instant::now();
    let id = format!("detok-{}", st.next_id.fetch_add(1, Ordering::Relaxed));
    let result = detokenize_inner(&st, &headers, &body, &id, started);
    respond(&st, "/detokenize", &id, started, result)
}

/// `/detokenize`: ids back to text as the tokenizer decodes them, special
/// tokens included (transformers' `decode` default), so a chat's ids give
/// back the template's text.
fn detokenize_inner(st: &AppState, headers: &HeaderMap, body: &[u8], id: &str, started: Instant) -> Result<Response, ApiError> {
    st.authorize(headers)?;
    let (r, _): (DetokenizeRequest, _) = openai::parse_allowing(body, openai::DETOKENIZE_FIELDS, false, st.allow_extra_fields)?;
    st.check_model(&r.model)?;
    let vocab = st.info.vocab;
    if let Some((i, bad)) = r.tokens.iter().enumerate().find(|(_, &t)| t as u64 >= vocab) {
        return Err(ApiError::invalid(format!("tokens[{i}] = {bad} is outside the vocabulary of {vocab} tokens (ids 0 to {})", vocab.saturating_sub(1)), Some("tokens".into())));
    }
    let prompt = st.info.tokenizer.decode(&r.tokens, false).map_err(|e| ApiError::invalid(format!("the tokens do not decode: {e}"), Some("tokens".into())))?;
    log_request(id, "/detokenize", 200, Some((r.tokens.len(), 0)), started, None);
    Ok(Json(json!({"prompt": prompt})).into_response())
}

pub async fn embeddings(State(st): St, headers: HeaderMap, body: Bytes) -> Response {
    let started = Instant::now();
    let id = format!("embd-{}", st.next_id.fetch_add(1, Ordering::Relaxed));
    let result = embeddings_inner(&st, &headers, &body, &id, started).await;
    respond(&st, "/v1/embeddings", &id, started, result)
}

async fn embeddings_inner(st: &Arc<AppState>, headers: &HeaderMap, body: &[u8], id: &str, started: Instant) -> Result<Response, ApiError> {
    st.authorize(headers)?;
    let (r, _): (EmbeddingRequest, _) = openai::parse_allowing(body, openai::EMBEDDING_FIELDS, false, st.allow_extra_fields)?;
    st.check_model(&r.model)?;
    let Some(width) = st.info.embedding_width.filter(|_| st.info.encoder) else {
        return Err(ApiError::invalid("this model generates text; embeddings need a sentence encoder artifact", Some("model".into())));
    };
    let base64 = match r.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => return Err(ApiError::invalid(format!("encoding_format `{other}`: use float or base64"), Some("encoding_format".into()))),
    };
    if r.dimensions.is_some_and(|d| d != width) {
        return Err(ApiError::invalid(format!("this model's embeddings have {width} dimensions; other sizes are not supported"), Some("dimensions".into())));
    }
    // Encoders take their special tokens ([CLS] ... [SEP]).
    let listed = prompt_list(st, &r.input, "input", true)?;
    if listed.len() > 2048 {
        return Err(ApiError::invalid(format!("{} inputs; send 1 to 2048", listed.len()), Some("input".into())));
    }
    let mut inputs = Vec::with_capacity(listed.len());
    for (ids, _) in listed {
        if ids.len() as u64 > st.info.max_length {
            return Err(ApiError::too_long(ids.len(), st.info.max_length, "input"));
        }
        inputs.push(ids);
    }
    let tokens: usize = inputs.iter().map(Vec::len).sum();
    let _guard = st.admit()?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    st.send(Job::Embed { inputs, reply: tx })?;
    let vectors = rx.await.map_err(|_| ApiError::internal("the engine's thread ended"))??;
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let embedding = if base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    log_request(id, "/v1/embeddings", 200, Some((tokens, 0)), started, None);
    Ok(Json(json!({"object": "list", "data": data, "model": st.info.name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})).into_response())
}
