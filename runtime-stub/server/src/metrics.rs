//! `GET /metrics`: the server's counters, gauges and histograms in Prometheus
//! text format (the `prometheus` crate's registry and encoder).
//!
//! Beside maxrun's own (`maxrun_*`), the gauges that routers read from a model
//! server under vLLM's names, which the Gateway API Inference Extension's model
//! server protocol takes as its defaults and llm-d's endpoint picker, the
//! SGLang / vLLM routers and KEDA / HPA examples scrape: `vllm:num_requests_waiting`,
//! `vllm:num_requests_running`, `vllm:kv_cache_usage_perc` (a fraction, 1 = full,
//! as vLLM's) and `vllm:cache_config_info` (the KV block size and count as labels).

use prometheus::{Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder};

use maxrun_engine::Stats;

/// Every metric of one server.
pub struct Metrics {
    registry: Registry,
    /// Requests answered, by endpoint and HTTP status.
    pub requests: IntCounterVec,
    pub prompt_tokens: IntCounter,
    pub generated_tokens: IntCounter,
    /// Requests waiting for room in the engine, and sequences running.
    pub queue_depth: IntGauge,
    pub running: IntGauge,
    pub kv_blocks_used: IntGauge,
    pub kv_blocks_free: IntGauge,
    pub prefix_queried_tokens: IntGauge,
    pub prefix_hit_tokens: IntGauge,
    pub prefix_hit_rate: Gauge,
    pub preemptions: IntGauge,
    pub cancelled: IntCounter,
    /// Inputs embedded, and the model steps that embedded them (a batched
    /// encoder runs many inputs per step; without its batch plan, one each).
    pub embedding_inputs: IntCounter,
    pub embedding_steps: IntCounter,
    /// Generated tokens per second over the last steps (the engine's rate).
    pub tokens_per_second: Gauge,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub request_duration: Histogram,
    /// Speculative decoding (vLLM's `spec_decode` metrics in spirit): drafted
    /// tokens verified, those that stood, verification steps, and each
    /// verification's accepted drafts.
    pub draft_tokens: IntCounter,
    pub accepted_tokens: IntCounter,
    pub verifications: IntCounter,
    pub accepted_length: Histogram,
    /// The router-facing gauges under vLLM's names (the module's doc).
    pub router_waiting: Gauge,
    pub router_running: Gauge,
    pub router_kv_usage: Gauge,
    pub router_cache_config: GaugeVec,
    /// The (block size, blocks) `router_cache_config` carries, once set.
    cache_config_seen: std::sync::Mutex<(usize, usize)>,
    /// The engine's speculation counts already published (the engine's are cumulative).
    spec_seen: std::sync::Mutex<(u64, u64, u64, [u64; maxrun_engine::speculate::MAX_DRAFTS + 1])>,
}

fn histogram(name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets)).expect("a valid histogram")
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let requests = IntCounterVec::new(Opts::new("maxrun_requests_total", "HTTP requests answered, by endpoint and status"), &["endpoint", "status"]).expect("valid");
        let int = |name: &str, help: &str| IntGauge::new(name, help).expect("valid");
        let counter = |name: &str, help: &str| IntCounter::new(name, help).expect("valid");
        let latency = vec![0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];
        let m = Metrics {
            requests,
            prompt_tokens: counter("maxrun_prompt_tokens_total", "prompt tokens of finished requests"),
            generated_tokens: counter("maxrun_generated_tokens_total", "tokens generated"),
            queue_depth: int("maxrun_queue_depth", "requests waiting for room in the engine"),
            running: int("maxrun_running_sequences", "sequences in the engine's running batch"),
            kv_blocks_used: int("maxrun_kv_blocks_used", "KV cache blocks held by sequences"),
            kv_blocks_free: int("maxrun_kv_blocks_free", "KV cache blocks free or holding only cached prefixes"),
            prefix_queried_tokens: int("maxrun_prefix_cache_queried_tokens", "prompt tokens looked up in the prefix cache"),
            prefix_hit_tokens: int("maxrun_prefix_cache_hit_tokens", "prompt tokens found in the prefix cache"),
            prefix_hit_rate: Gauge::new("maxrun_prefix_cache_hit_rate", "prompt tokens found over those looked up").expect("valid"),
            preemptions: int("maxrun_preemptions", "sequences preempted for KV blocks (recomputed later)"),
            cancelled: counter("maxrun_cancelled_requests_total", "requests ended because the client went away or the server shut down"),
            embedding_inputs: counter("maxrun_embedding_inputs_total", "inputs embedded by /v1/embeddings"),
            embedding_steps: counter("maxrun_embedding_steps_total", "model steps run for /v1/embeddings (a step embeds many inputs with an encoder batch plan, one without)"),
            tokens_per_second: Gauge::new("maxrun_generation_tokens_per_second", "tokens generated per second over the last steps").expect("valid"),
            time_to_first_token: histogram("maxrun_time_to_first_token_seconds", "seconds from a request's arrival to its first token", latency.clone()),
            inter_token_latency: histogram("maxrun_inter_token_latency_seconds", "seconds between a request's consecutive tokens", latency.clone()),
            request_duration: histogram("maxrun_request_duration_seconds", "seconds from a request's arrival to its end", latency),
            draft_tokens: counter("maxrun_spec_decode_draft_tokens_total", "drafted tokens verified by speculative decoding"),
            accepted_tokens: counter("maxrun_spec_decode_accepted_tokens_total", "drafted tokens that stood (speculative decoding)"),
            verifications: counter("maxrun_spec_decode_verifications_total", "verification steps of a sequence (each gives its accepted drafts and one token more)"),
            accepted_length: histogram("maxrun_spec_decode_accepted_length", "drafted tokens that stood per verification step", (0..=maxrun_engine::speculate::MAX_DRAFTS).map(|n| n as f64).collect()),
            router_waiting: Gauge::new("vllm:num_requests_waiting", "requests waiting for room in the engine (vLLM's name, read by routers)").expect("valid"),
            router_running: Gauge::new("vllm:num_requests_running", "requests in the engine's running batch (vLLM's name, read by routers)").expect("valid"),
            router_kv_usage: Gauge::new("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = every block held by a sequence (vLLM's name, read by routers)").expect("valid"),
            router_cache_config: GaugeVec::new(Opts::new("vllm:cache_config_info", "the KV cache's configuration, as labels (vLLM's name)"), &["block_size", "num_gpu_blocks"]).expect("valid"),
            cache_config_seen: std::sync::Mutex::new((0, 0)),
            spec_seen: std::sync::Mutex::new((0, 0, 0, [0; maxrun_engine::speculate::MAX_DRAFTS + 1])),
            registry,
        };
        let collectors: Vec<Box<dyn prometheus::core::Collector>> = vec![
            Box::new(m.requests.clone()),
            Box::new(m.prompt_tokens.clone()),
            Box::new(m.generated_tokens.clone()),
            Box::new(m.queue_depth.clone()),
            Box::new(m.running.clone()),
            Box::new(m.kv_blocks_used.clone()),
            Box::new(m.kv_blocks_free.clone()),
            Box::new(m.prefix_queried_tokens.clone()),
            Box::new(m.prefix_hit_tokens.clone()),
            Box::new(m.prefix_hit_rate.clone()),
            Box::new(m.preemptions.clone()),
            Box::new(m.cancelled.clone()),
            Box::new(m.embedding_inputs.clone()),
            Box::new(m.embedding_steps.clone()),
            Box::new(m.tokens_per_second.clone()),
            Box::new(m.time_to_first_token.clone()),
            Box::new(m.inter_token_latency.clone()),
            Box::new(m.request_duration.clone()),
            Box::new(m.draft_tokens.clone()),
            Box::new(m.accepted_tokens.clone()),
            Box::new(m.verifications.clone()),
            Box::new(m.accepted_length.clone()),
            Box::new(m.router_waiting.clone()),
            Box::new(m.router_running.clone()),
            Box::new(m.router_kv_usage.clone()),
            Box::new(m.router_cache_config.clone()),
        ];
        for c in collectors {
            m.registry.register(c).expect("each metric is registered once");
        }
        m
    }

    /// Copies the engine's counters into the gauges.
    pub fn observe_engine(&self, s: &Stats) {
        self.queue_depth.set(s.waiting as i64);
        self.running.set(s.running as i64);
        self.kv_blocks_used.set(s.kv_blocks_used as i64);
        self.kv_blocks_free.set(s.kv_blocks_total.saturating_sub(s.kv_blocks_used) as i64);
        self.prefix_queried_tokens.set(s.prefix_queried_tokens as i64);
        self.prefix_hit_tokens.set(s.prefix_hit_tokens as i64);
        self.prefix_hit_rate.set(if s.prefix_queried_tokens > 0 { s.prefix_hit_tokens as f64 / s.prefix_queried_tokens as f64 } else { 0.0 });
        self.preemptions.set(s.preemptions as i64);
        self.router_waiting.set(s.waiting as f64);
        self.router_running.set(s.running as f64);
        self.router_kv_usage.set(if s.kv_blocks_total > 0 { s.kv_blocks_used as f64 / s.kv_blocks_total as f64 } else { 0.0 });
        // The labels change only with the pool: set them when they do, not every step.
        let config = (s.kv_block_size, s.kv_blocks_total);
        let mut seen_config = self.cache_config_seen.lock().expect("the metrics lock is never poisoned");
        if s.kv_blocks_total > 0 && *seen_config != config {
            self.router_cache_config.reset();
            self.router_cache_config.with_label_values(&[&config.0.to_string(), &config.1.to_string()]).set(1.0);
            *seen_config = config;
        }
        drop(seen_config);
        let mut seen = self.spec_seen.lock().expect("the metrics lock is never poisoned");
        self.draft_tokens.inc_by(s.draft_tokens.saturating_sub(seen.0));
        self.accepted_tokens.inc_by(s.accepted_tokens.saturating_sub(seen.1));
        self.verifications.inc_by(s.verifications.saturating_sub(seen.2));
        for (len, (&now, before)) in s.accepted_lengths.iter().zip(seen.3.iter_mut()).enumerate() {
            for _ in *before..now {
                self.accepted_length.observe(len as f64);
            }
            *before = now;
        }
        (seen.0, seen.1, seen.2) = (s.draft_tokens, s.accepted_tokens, s.verifications);
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut out).expect("text encoding of gathered metrics");
        String::from_utf8(out).expect("the text format is UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
