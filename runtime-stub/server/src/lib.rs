//! `maxrun serve`: an OpenAI-compatible HTTP server over the engine
//! (docs/serving.md). axum on tokio answers HTTP; one thread runs the engine
//! (`worker.rs`), so many requests share its steps.
//!
//! Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both whole or
//! streamed as server-sent events), `POST /v1/embeddings` (sentence encoders),
//! `POST /v1/responses` with `GET` / `DELETE /v1/responses/{id}` (OpenAI's
//! Responses API, `responses.rs`; stored responses in `response_store.rs`),
//! `POST /tokenize` and `POST /detokenize` (vLLM's shapes), `GET /v1/models`,
//! `GET /health`, `GET /metrics` (Prometheus text).
//!
//! SIGTERM and SIGINT stop the server gracefully: it stops accepting, lets the
//! requests in flight finish for up to `--shutdown-timeout` seconds, cancels what
//! is left (their streams end with `finish_reason: "cancelled"`), and exits 0.

pub mod errors;
pub mod metrics;
pub mod openai;
pub mod response_store;
pub mod responses;
pub mod routes;
pub mod worker;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, Context};
use axum::routing::{get, post};
use axum::Router;

use maxrun_runtime::artifact::Artifact;
use maxrun_runtime::runner::Device;
use routes::{AppState, ModelInfo};
use worker::{Job, Shared, WorkerOptions};

/// How the server runs (`maxrun serve` flags).
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub host: String,
    /// 0: any free port (the address chosen is printed).
    pub port: u16,
    pub api_key: Option<String>,
    pub served_model_name: Option<String>,
    pub max_queue: usize,
    pub shutdown_timeout: Duration,
    pub threads: usize,
    pub device: Device,
    pub kv_cache_memory: Option<u64>,
    /// `hermes`, `llama3`, `mistral`, `harmony`; `None`: from the chat template.
    pub tool_parser: Option<maxrun_engine::constrain::tools::ToolFormat>,
    /// Split `<think>...</think>` (and gpt-oss's analysis channel) into
    /// `reasoning_content`: `None` when the chat template mentions `<think>`
    /// or harmony's `<|channel|>`.
    pub reasoning: Option<bool>,
    /// Drop unknown request fields instead of answering 400.
    pub allow_extra_request_fields: bool,
    /// Speculative decoding for every generation request, and its draft model
    /// (prompt lookup without one).
    pub speculation: Option<maxrun_engine::speculate::SpeculationConfig>,
    pub draft: Option<Arc<Artifact>>,
    /// How many `/v1/responses` responses are kept for `previous_response_id`.
    pub response_store: response_store::StoreLimits,
}

/// Waits for SIGTERM or SIGINT.
async fn signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (mut term, mut int) = match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(t), Ok(i)) => (t, i),
        _ => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// The model id served without `--served-model-name`: the artifact's model
/// name where it is an id clients and routers take as it is (printable ASCII
/// without spaces, as `SmolLM2-135M-Instruct` or `org/model`), else that name
/// made one (a GGUF's `general.name` such as `Smollm2 135M 8k Lc100K Mix1 Ep2`
/// becomes `smollm2-135m-8k-lc100k-mix1-ep2`), else the artifact's file stem.
pub fn default_served_name(model_name: &str, artifact: &std::path::Path) -> String {
    if !model_name.is_empty() && model_name.bytes().all(|b| b.is_ascii_graphic()) {
        return model_name.to_string();
    }
    let mut slug = String::new();
    for c in model_name.chars().flat_map(char::to_lowercase) {
        if c.is_ascii_alphanumeric() || matches!(c, '.' | '_') {
            slug.push(c);
        } else if !slug.is_empty() && !slug.ends_with('-') {
            slug.push('-');
        }
    }
    let slug = slug.trim_end_matches('-');
    if !slug.is_empty() {
        return slug.to_string();
    }
    let stem = artifact.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    if stem.is_empty() || !stem.bytes().all(|b| b.is_ascii_graphic()) {
        "model".to_string()
    } else {
        stem
    }
}

/// Serves `artifact` until a signal stops it.
pub fn serve(artifact: Artifact, opts: ServeOptions) -> anyhow::Result<()> {
    let h = &artifact.header;
    let tokenizer = maxrun_engine::load_tokenizer(&artifact).map_err(|e| anyhow!(e))?;
    let template = std::str::from_utf8(artifact.section(maxrun_runtime::format::SectionKind::ChatTemplate)).ok().filter(|t| !t.is_empty()).map(str::to_string);
    let token_text = |id: Option<u32>| id.and_then(|i| tokenizer.id_to_token(i)).unwrap_or_default();
    let tool_format = opts.tool_parser.unwrap_or_else(|| template.as_deref().map_or(maxrun_engine::constrain::tools::ToolFormat::Hermes, maxrun_engine::constrain::tools::ToolFormat::of_template));
    let reasoning = opts.reasoning.unwrap_or_else(|| template.as_deref().is_some_and(|t| t.contains("<think>") || t.contains("<|channel|>")));
    let info = ModelInfo {
        name: opts.served_model_name.clone().unwrap_or_else(|| default_served_name(&h.model.name, &artifact.path)),
        tool_format,
        reasoning,
        artifact: artifact.path.display().to_string(),
        created: std::fs::metadata(&artifact.path).and_then(|m| m.modified()).ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map_or(0, |d| d.as_secs()),
        max_length: h.max_length,
        vocab: h.model.vocab_size,
        bos_text: token_text(h.tokenizer.bos_token_id),
        eos_text: token_text(h.tokenizer.eos_token_ids.first().copied()),
        tokenizer: tokenizer.clone(),
        template,
        encoder: h.model.embedding_width.is_some(),
        embedding_width: h.model.embedding_width,
        defaults: h.generation.clone(),
    };
    let shared = Arc::new(Shared { metrics: metrics::Metrics::new(), in_flight: AtomicUsize::new(0), stats: Mutex::new(Default::default()) });
    let worker_opts = WorkerOptions { threads: opts.threads, device: opts.device, kv_cache_memory: opts.kv_cache_memory, speculation: opts.speculation.clone(), draft: opts.draft.clone() };
    let cpu_code = artifact.cpu_variant_note();
    let (jobs, worker, engine) = worker::spawn(artifact, worker_opts, shared.clone())?;
    let state = Arc::new(AppState {
        jobs: Mutex::new(jobs.clone()),
        shared,
        info,
        api_key: opts.api_key.clone(),
        max_queue: opts.max_queue,
        allow_extra_fields: opts.allow_extra_request_fields,
        next_id: AtomicU64::new(1),
        shutting_down: AtomicBool::new(false),
        responses: Mutex::new(response_store::ResponseStore::new(opts.response_store)),
    });
    let app = Router::new()
        .route("/v1/completions", post(routes::completions))
        .route("/v1/chat/completions", post(routes::chat))
        .route("/v1/embeddings", post(routes::embeddings))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/{id}", get(responses::retrieve).delete(responses::delete))
        .route("/tokenize", post(routes::tokenize))
        .route("/detokenize", post(routes::detokenize))
        .route("/v1/models", get(routes::models))
        .route("/health", get(routes::health))
        .route("/server_info", get(routes::server_info))
        .route("/get_server_info", get(routes::server_info))
        .route("/model_info", get(routes::model_info))
        .route("/get_model_info", get(routes::model_info))
        .route("/metrics", get(routes::metrics))
        .fallback(routes::not_found)
        .with_state(state.clone());
    // The HTTP side is I/O: two threads; the engine's thread does the work.
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().context("starting the HTTP runtime")?;
    let result = runtime.block_on(async {
        let addr: SocketAddr = format!("{}:{}", opts.host, opts.port)
            .parse()
            .or_else(|_| format!("[{}]:{}", opts.host, opts.port).parse())
            .map_err(|_| anyhow!("--host {}: not an IP address (give one, e.g. 127.0.0.1 or ::1)", opts.host))?;
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr()?;
        eprintln!("maxrun serve: {} on http://{local} ({engine}; {cpu_code})", state.info.name);
        let (stopping_tx, mut stopping_rx) = tokio::sync::watch::channel(false);
        let graceful = {
            let state = state.clone();
            async move {
                signal().await;
                eprintln!("maxrun serve: stopping: no new requests; {} in flight get up to {:?}", state.shared.in_flight.load(Ordering::Relaxed), opts.shutdown_timeout);
                state.shutting_down.store(true, Ordering::Relaxed);
                let _ = stopping_tx.send(true);
            }
        };
        let server = axum::serve(listener, app).with_graceful_shutdown(graceful);
        let deadline = async {
            let _ = stopping_rx.wait_for(|s| *s).await;
            tokio::time::sleep(opts.shutdown_timeout).await;
            // What did not finish in time is cancelled; its streams end.
            let _ = jobs.send(Job::CancelAll);
            tokio::time::sleep(Duration::from_secs(2)).await;
        };
        tokio::select! {
            r = server => r.context("serving")?,
            _ = deadline => {}
        }
        anyhow::Ok(())
    });
    let _ = state.jobs.lock().expect("never poisoned").send(Job::Stop);
    drop(state);
    let _ = worker.join();
    result?;
    eprintln!("maxrun serve: stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::default_served_name;
    use std::path::Path;

    #[test]
    fn the_default_served_name_is_an_id_without_spaces() {
        let p = Path::new("out/smollm2.mef");
        assert_eq!(default_served_name("SmolLM2-135M-Instruct", p), "SmolLM2-135M-Instruct");
        assert_eq!(default_served_name("HuggingFaceTB/SmolLM2-135M-Instruct", p), "HuggingFaceTB/SmolLM2-135M-Instruct");
        assert_eq!(default_served_name("Smollm2 135M 8k Lc100K Mix1 Ep2", p), "smollm2-135m-8k-lc100k-mix1-ep2");
        assert_eq!(default_served_name("  Qwen3 (30B-A3B) ", p), "qwen3-30b-a3b");
        assert_eq!(default_served_name("模型", p), "smollm2");
        assert_eq!(default_served_name("", Path::new("x/my model.mef")), "model");
    }
}
