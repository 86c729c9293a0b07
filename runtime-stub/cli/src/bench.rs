//! `maxrun bench`: prefill (pp) and decode (tg) throughput in the style of llama-bench.
//!
//! pp: one forward pass over `prompt_tokens` tokens from an empty cache.
//! tg: `generated_tokens` single-token decode steps from an empty cache.
//! Each is repeated; the report gives mean and sample standard deviation of tokens/s.

use std::time::Instant;

use serde::Serialize;

use maxrun_runtime::runner::Runner;
use maxrun_runtime::executor::RunError;

/// Bench settings.
#[derive(Copy, Clone, Debug)]
pub struct BenchConfig {
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    pub repetitions: u32,
    /// Tokens already in the KV cache when each test starts (llama-bench's `-d`),
    /// written by an untimed prefill.
    pub depth: u64,
}

/// The token ids of the prompt test (content does not change the work).
fn prompt_ids(tokens: u64, vocab: u64) -> Vec<u32> {
    (0..tokens).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}

/// The token ids of an untimed prefill of `depth` tokens.
fn depth_ids(depth: u64, vocab: u64) -> Vec<u32> {
    (0..depth).map(|i| ((i * 104_729 + 7) % vocab) as u32).collect()
}

/// One untimed step of each kind: pages the weights in and spins the threads up.
fn warm_up(session: &mut Runner<'_>, prompt: &[u32]) -> Result<(), RunError> {
    session.reset();
    session.forward_last(&prompt[..prompt.len().min(16)])?;
    session.reset();
    session.forward(&[1])?;
    Ok(())
}

/// Empties the session's cache, then fills `depth` positions (untimed).
fn start(session: &mut Runner<'_>, depth: &[u32]) -> Result<(), RunError> {
    session.reset();
    if !depth.is_empty() {
        session.forward_last(depth)?;
    }
    Ok(())
}

/// Seconds for the prompt test from where the cache stands: as llama-bench, a
/// prompt's work up to the logits generation needs (the last token's).
fn prefill_seconds(session: &mut Runner<'_>, prompt: &[u32]) -> Result<f64, RunError> {
    let t = Instant::now();
    session.forward_last(prompt)?;
    Ok(t.elapsed().as_secs_f64())
}

/// Seconds for `tokens` single-token decode steps from where the cache stands.
fn decode_seconds(session: &mut Runner<'_>, tokens: u64, vocab: u64) -> Result<f64, RunError> {
    let t = Instant::now();
    for i in 0..tokens {
        session.forward(&[((i * 31 + 7) % vocab) as u32])?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// The memory bandwidth a decode step can at best stream at, in GB/s: on the
/// CPU the weights read by the session's threads, on a GPU a device-to-device
/// copy (bytes read plus bytes written).
fn bandwidth(session: &Runner<'_>, weights: &[u8]) -> Result<f64, RunError> {
    match session {
        #[cfg(feature = "cuda")]
        Runner::Gpu(gpu) => gpu.copy_bandwidth().map_err(|e| RunError::Gpu(e.to_string())),
        _ => Ok(read_bandwidth(weights, session.threads())),
    }
}

/// Bench results (the `--json` object).
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub model: String,
    /// Where it ran: `threads: N`, `devices: N, threads: M` or `GPU: NAME`.
    pub device: String,
    pub threads: usize,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    pub repetitions: u32,
    /// Tokens in the KV cache before each test.
    pub depth: u64,
    pub prefill_tokens_per_s: f64,
    pub prefill_tokens_per_s_stddev: f64,
    pub decode_tokens_per_s: f64,
    pub decode_tokens_per_s_stddev: f64,
    /// Bytes of weights read per decode step (`Header::decode_weight_bytes`):
    /// every weight the decode plan reads once, but an untied input table (one
    /// row a token), and of a mixture of experts each routed layer's top-k.
    pub weight_bytes: u64,
    /// Where the weights were read from: "file mapping" (the default), "huge
    /// pages" (a private copy, `--huge-pages`) or "device memory" (a GPU).
    pub weights_memory: &'static str,
    /// Where the KV cache lives: "huge pages", "ordinary pages" (`kv_cache.rs`),
    /// "device memory" on a GPU, or "-" where the artifact runs on a CPU mesh.
    pub kv_cache_memory: &'static str,
    /// The KV cache's element type (`float32` or `float16`, the artifact's
    /// `kv_cache.encoding`).
    pub kv_cache_encoding: &'static str,
    /// Bandwidth measured just before each decode repetition (GB/s), the mean:
    /// on the CPU streaming the weights with `threads` threads, on a GPU a
    /// device-to-device copy counting bytes read and written.
    pub read_bandwidth_gb_s: f64,
    /// Decode tokens/s if every step only streamed the weights and the KV cache at that bandwidth.
    pub decode_roofline_tokens_per_s: f64,
    /// Decode tokens/s over the roofline, each repetition against the bandwidth
    /// measured just before it, averaged (about `decode_tokens_per_s /
    /// decode_roofline_tokens_per_s`).
    pub decode_roofline_fraction: f64,
}

/// Streams `bytes` with `threads` threads (summing 64-bit words so nothing is
/// optimized away) and returns the best pass in GB/s, over at least three passes
/// and a quarter of a second (a few passes of a small model are over in
/// milliseconds, where one slow moment of a shared VM decides the figure).
pub fn read_bandwidth(bytes: &[u8], threads: usize) -> f64 {
    let words = bytes.len() / 8;
    let mut best = 0.0f64;
    let started = Instant::now();
    let mut passes = 0;
    while passes < 3 || started.elapsed().as_secs_f64() < 0.25 {
        passes += 1;
        let t = Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|k| {
                    let (b, e) = (words * k / threads * 8, words * (k + 1) / threads * 8);
                    let part = &bytes[b..e];
                    s.spawn(move || {
                        let mut acc = [0u64; 8];
                        for chunk in part.chunks_exact(64) {
                            for (l, w) in chunk.chunks_exact(8).enumerate() {
                                acc[l] = acc[l].wrapping_add(u64::from_le_bytes(w.try_into().unwrap()));
                            }
                        }
                        acc.iter().fold(0u64, |a, &x| a.wrapping_add(x))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).fold(0, u64::wrapping_add)
        });
        std::hint::black_box(total);
        best = best.max(bytes.len() as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = if xs.len() > 1 { xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
    (mean, var.sqrt())
}

/// Runs the benchmark (`weights`: a section to measure read bandwidth on;
/// `weight_bytes`: what one decode step reads over all devices; `kv`: KV bytes per token over all devices and the cache encoding). Token ids are a fixed, valid sequence (content does not change the work).
pub fn run(
    session: &mut Runner<'_>,
    cfg: BenchConfig,
    model: &str,
    weights: &[u8],
    weight_bytes: u64,
    kv: (u64, &'static str),
    vocab: u64,
    weights_memory: &'static str,
) -> Result<BenchReport, RunError> {
    let (kv_bytes_per_token, kv_cache_encoding) = kv;
    let on_gpu = session.describe().starts_with("GPU");
    let kv_cache_memory = match session.cpu() {
        Some(cpu) if cpu.kv_cache_on_huge_pages() => "huge pages",
        Some(_) => "ordinary pages",
        None if on_gpu => "device memory",
        None => "-",
    };
    let weights_memory = if on_gpu { "device memory" } else { weights_memory };
    let ids = prompt_ids(cfg.prompt_tokens, vocab);
    let depth = depth_ids(cfg.depth, vocab);
    warm_up(session, &ids)?;
    let mut pp = Vec::new();
    let mut tg = Vec::new();
    let mut bws = Vec::new();
    for _ in 0..cfg.repetitions {
        if cfg.prompt_tokens > 0 {
            start(session, &depth)?;
            pp.push(cfg.prompt_tokens as f64 / prefill_seconds(session, &ids)?);
        }
        if cfg.generated_tokens > 0 {
            // The VM's bandwidth moves by tens of percent between minutes: each
            // decode repetition is compared with a bandwidth measured just before it.
            start(session, &depth)?;
            bws.push(bandwidth(session, weights)?);
            tg.push(cfg.generated_tokens as f64 / decode_seconds(session, cfg.generated_tokens, vocab)?);
        }
    }
    let (pm, ps) = if pp.is_empty() { (0.0, 0.0) } else { mean_std(&pp) };
    let (dm, ds) = if tg.is_empty() { (0.0, 0.0) } else { mean_std(&tg) };
    if bws.is_empty() {
        bws.push(bandwidth(session, weights)?);
    }
    let bw = bws.iter().sum::<f64>() / bws.len() as f64;
    // Bytes per decode step: all weights plus the KV cache up to the average position.
    let per_step = weight_bytes as f64 + kv_bytes_per_token as f64 * (cfg.depth as f64 + cfg.generated_tokens as f64 / 2.0);
    let roofline = bw * 1e9 / per_step;
    // Each repetition against its own bandwidth, averaged.
    let fraction = tg.iter().zip(&bws).map(|(t, b)| t * per_step / (b * 1e9)).sum::<f64>() / tg.len().max(1) as f64;
    Ok(BenchReport {
        model: model.to_string(),
        device: session.describe(),
        threads: session.threads(),
        prompt_tokens: cfg.prompt_tokens,
        generated_tokens: cfg.generated_tokens,
        repetitions: cfg.repetitions,
        depth: cfg.depth,
        prefill_tokens_per_s: pm,
        prefill_tokens_per_s_stddev: ps,
        decode_tokens_per_s: dm,
        decode_tokens_per_s_stddev: ds,
        weight_bytes,
        weights_memory,
        kv_cache_memory,
        kv_cache_encoding,
        read_bandwidth_gb_s: bw,
        decode_roofline_tokens_per_s: roofline,
        decode_roofline_fraction: fraction,
    })
}

/// Two artifacts measured turn about (`maxrun bench A --compare B`).
#[derive(Clone, Debug, Serialize)]
pub struct ComparisonReport {
    pub artifacts: [String; 2],
    pub threads: usize,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    pub repetitions: u32,
    pub depth: u64,
    /// Per artifact: mean and sample standard deviation of prefill tokens/s.
    pub prefill_tokens_per_s: [(f64, f64); 2],
    pub decode_tokens_per_s: [(f64, f64); 2],
    /// The first artifact's tokens/s over the second's, each from the summed times
    /// of all repetitions.
    pub prefill_ratio: f64,
    pub decode_ratio: f64,
}

/// Runs the benchmark on two sessions turn about: each repetition runs the
/// prefill and then the decode test on one artifact, then on the other, the order
/// alternating between repetitions (A B B A ...), so that a slow moment of the
/// machine falls on both.
pub fn compare(sessions: [&mut Runner<'_>; 2], cfg: BenchConfig, artifacts: [String; 2], vocab: u64) -> Result<ComparisonReport, RunError> {
    let ids = prompt_ids(cfg.prompt_tokens, vocab);
    let depth = depth_ids(cfg.depth, vocab);
    let mut sessions = sessions;
    for s in sessions.iter_mut() {
        warm_up(s, &ids)?;
    }
    let mut pp: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut tg: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for rep in 0..cfg.repetitions as usize {
        for turn in 0..2 {
            let which = if rep % 2 == 0 { turn } else { 1 - turn };
            let s = &mut sessions[which];
            if cfg.prompt_tokens > 0 {
                start(s, &depth)?;
                pp[which].push(prefill_seconds(s, &ids)?);
            }
            if cfg.generated_tokens > 0 {
                start(s, &depth)?;
                tg[which].push(decode_seconds(s, cfg.generated_tokens, vocab)?);
            }
        }
    }
    let rates = |times: &[f64], tokens: u64| -> (f64, f64) {
        if times.is_empty() {
            return (0.0, 0.0);
        }
        mean_std(&times.iter().map(|t| tokens as f64 / t).collect::<Vec<_>>())
    };
    let ratio = |times: &[Vec<f64>; 2]| {
        let (a, b) = (times[0].iter().sum::<f64>(), times[1].iter().sum::<f64>());
        if a > 0.0 {
            b / a
        } else {
            0.0
        }
    };
    Ok(ComparisonReport {
        artifacts,
        threads: sessions[0].threads(),
        prompt_tokens: cfg.prompt_tokens,
        generated_tokens: cfg.generated_tokens,
        repetitions: cfg.repetitions,
        depth: cfg.depth,
        prefill_tokens_per_s: [rates(&pp[0], cfg.prompt_tokens), rates(&pp[1], cfg.prompt_tokens)],
        decode_tokens_per_s: [rates(&tg[0], cfg.generated_tokens), rates(&tg[1], cfg.generated_tokens)],
        prefill_ratio: ratio(&pp),
        decode_ratio: ratio(&tg),
    })
}

/// The comparison table: one row per artifact, then the ratios.
pub fn render_comparison(r: &ComparisonReport) -> String {
    let width = r.artifacts.iter().map(String::len).max().unwrap_or(8).max(8);
    let mut s = String::new();
    let (pp, tg) = (format!("{} t/s", test_name("pp", r.prompt_tokens, r.depth)), format!("{} t/s", test_name("tg", r.generated_tokens, r.depth)));
    s.push_str(&format!("| {:<width$} | {:>7} | {:>20} | {:>20} |\n", "artifact", "threads", pp, tg));
    s.push_str(&format!("| {:-<width$} | {:->7} | {:->20} | {:->20} |\n", "", "", "", ""));
    for k in 0..2 {
        let (p, t) = (r.prefill_tokens_per_s[k], r.decode_tokens_per_s[k]);
        s.push_str(&format!(
            "| {:<width$} | {:>7} | {:>20} | {:>20} |\n",
            r.artifacts[k],
            r.threads,
            format!("{:.2} ± {:.2}", p.0, p.1),
            format!("{:.2} ± {:.2}", t.0, t.1)
        ));
    }
    s.push_str(&format!(
        "\nfirst / second (summed times, {} repetitions turn about): prefill {:.3}x, decode {:.3}x\n",
        r.repetitions, r.prefill_ratio, r.decode_ratio
    ));
    s
}

/// A test's name as llama-bench prints it: `pp512`, or `pp512 @ d1024` at a depth.
fn test_name(kind: &str, tokens: u64, depth: u64) -> String {
    if depth == 0 {
        format!("{kind}{tokens}")
    } else {
        format!("{kind}{tokens} @ d{depth}")
    }
}

/// The llama-bench style table.
pub fn render(r: &BenchReport) -> String {
    let mut s = String::new();
    s.push_str(&format!("| {:<28} | {:>7} | {:>14} | {:>20} |\n", "model", "threads", "test", "t/s"));
    s.push_str(&format!("| {:-<28} | {:->7} | {:->14} | {:->20} |\n", "", "", "", ""));
    if r.prompt_tokens > 0 {
        let t = format!("{:.2} ± {:.2}", r.prefill_tokens_per_s, r.prefill_tokens_per_s_stddev);
        s.push_str(&format!("| {:<28} | {:>7} | {:>14} | {:>20} |\n", r.model, r.threads, test_name("pp", r.prompt_tokens, r.depth), t));
    }
    if r.generated_tokens > 0 {
        let t = format!("{:.2} ± {:.2}", r.decode_tokens_per_s, r.decode_tokens_per_s_stddev);
        s.push_str(&format!("| {:<28} | {:>7} | {:>14} | {:>20} |\n", r.model, r.threads, test_name("tg", r.generated_tokens, r.depth), t));
        s.push_str(&format!(
            "\nweights on {}, {} KV cache on {}; {} bandwidth {:.1} GB/s ({}); decode roofline {:.1} tok/s; decode at {:.0}% of it\n",
            r.weights_memory,
            r.kv_cache_encoding,
            r.kv_cache_memory,
            if r.device.starts_with("GPU") { "device copy" } else { "read" },
            r.read_bandwidth_gb_s,
            r.device,
            r.decode_roofline_tokens_per_s,
            100.0 * r.decode_roofline_fraction
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_standard_deviation() {
        let (m, s) = mean_std(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
        assert_eq!(m, 5.0);
        assert!((s - 2.138).abs() < 1e-3);
    }
}

/// The batched engine under load (`maxrun bench --concurrency N`).
#[derive(Copy, Clone, Debug)]
pub struct ConcurrencyConfig {
    /// Sequences submitted together.
    pub sequences: usize,
    /// Prompt tokens of each (after the shared prefix).
    pub prompt_tokens: u64,
    /// Tokens each generates.
    pub generated_tokens: u64,
    /// Tokens every prompt starts with (the prefix-cache case; 0: none).
    pub shared_prefix: u64,
    pub repetitions: u32,
}

/// Results of a concurrency run (the `--json` object).
#[derive(Clone, Debug, Serialize)]
pub struct ConcurrencyReport {
    pub model: String,
    pub device: String,
    pub sequences: usize,
    pub prompt_tokens: u64,
    pub shared_prefix: u64,
    pub generated_tokens: u64,
    pub repetitions: u32,
    /// Generated tokens of all sequences over the decode-only steps' time: the
    /// aggregate decode rate while every sequence decodes.
    pub decode_tokens_per_s: f64,
    pub decode_tokens_per_s_stddev: f64,
    /// The aggregate over the number of sequences.
    pub decode_tokens_per_s_per_sequence: f64,
    /// Mean wall time of a decode-only step (one token for every running sequence), ms.
    pub decode_step_ms: f64,
    /// All prompt tokens over the time until the last sequence's first token.
    pub prefill_tokens_per_s: f64,
    /// Time to first token over all sequences of all repetitions, ms.
    pub time_to_first_token_ms_mean: f64,
    pub time_to_first_token_ms_max: f64,
    /// Prompt tokens found in the prefix cache over those looked up.
    pub prefix_hit_tokens: u64,
    pub prefix_queried_tokens: u64,
    pub preemptions: u64,
}

/// Runs `cfg.sequences` requests together on `engine`, `cfg.repetitions` times.
/// Each prompt is a distinct sequence of valid ids (after `shared_prefix` ids
/// common to all); each generates `generated_tokens` greedily with end-of-sequence
/// suppressed.
pub fn concurrency(engine: &mut maxrun_engine::Engine<'_>, cfg: ConcurrencyConfig, model: &str, vocab: u64) -> Result<ConcurrencyReport, maxrun_engine::EngineError> {
    use maxrun_engine::{Event, GenerationParams, Request};
    let prefix = depth_ids(cfg.shared_prefix, vocab);
    let (mut rates, mut step_ms, mut ttft, mut prefill_rates) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let params = GenerationParams { max_tokens: cfg.generated_tokens as usize, ignore_eos: true, ..GenerationParams::default() };
    let before = engine.stats();
    for rep in 0..cfg.repetitions {
        let start = Instant::now();
        for s in 0..cfg.sequences {
            // Distinct prompts (so that only the shared prefix is shared), and new
            // ones each repetition (so that it is not served from the prefix cache).
            let salt = (rep as u64 * cfg.sequences as u64 + s as u64) * 7_919 + 1;
            let own: Vec<u32> = (0..cfg.prompt_tokens).map(|i| ((i * 104_723 + salt * 31 + 11) % vocab) as u32).collect();
            let prompt = [prefix.clone(), own].concat();
            engine.submit(Request::new(prompt, params.clone())).map_err(maxrun_engine::EngineError::Submit)?;
        }
        let (mut decode_time, mut decode_tokens, mut decode_steps) = (0.0f64, 0u64, 0u64);
        let mut started = 0usize;
        let mut prefill_done = None;
        while engine.has_work() {
            let prompt_rows = engine.stats().prompt_rows;
            let t = Instant::now();
            let events = engine.step()?;
            let dt = t.elapsed().as_secs_f64();
            let tokens = events.iter().filter(|e| matches!(e, Event::Token { .. })).count() as u64;
            for e in &events {
                if let Event::Finished { usage, .. } = e {
                    ttft.push(usage.time_to_first_token * 1e3);
                }
            }
            if engine.stats().prompt_rows == prompt_rows && started == cfg.sequences {
                decode_time += dt;
                decode_tokens += tokens;
                decode_steps += 1;
            }
            started += events.iter().filter(|e| matches!(e, Event::Token { .. })).count().min(cfg.sequences - started.min(cfg.sequences));
            if started >= cfg.sequences && prefill_done.is_none() {
                prefill_done = Some(start.elapsed().as_secs_f64());
            }
        }
        if decode_time > 0.0 {
            rates.push(decode_tokens as f64 / decode_time);
            step_ms.push(decode_time * 1e3 / decode_steps as f64);
        }
        if let Some(p) = prefill_done {
            prefill_rates.push((cfg.prompt_tokens + cfg.shared_prefix) as f64 * cfg.sequences as f64 / p);
        }
    }
    let after = engine.stats();
    let (rate, sd) = if rates.is_empty() { (0.0, 0.0) } else { mean_std(&rates) };
    let mean = |x: &[f64]| if x.is_empty() { 0.0 } else { x.iter().sum::<f64>() / x.len() as f64 };
    Ok(ConcurrencyReport {
        model: model.to_string(),
        device: engine.describe(),
        sequences: cfg.sequences,
        prompt_tokens: cfg.prompt_tokens,
        shared_prefix: cfg.shared_prefix,
        generated_tokens: cfg.generated_tokens,
        repetitions: cfg.repetitions,
        decode_tokens_per_s: rate,
        decode_tokens_per_s_stddev: sd,
        decode_tokens_per_s_per_sequence: rate / cfg.sequences as f64,
        decode_step_ms: mean(&step_ms),
        prefill_tokens_per_s: mean(&prefill_rates),
        time_to_first_token_ms_mean: mean(&ttft),
        time_to_first_token_ms_max: ttft.iter().copied().fold(0.0, f64::max),
        prefix_hit_tokens: after.prefix_hit_tokens - before.prefix_hit_tokens,
        prefix_queried_tokens: after.prefix_queried_tokens - before.prefix_queried_tokens,
        preemptions: after.preemptions - before.preemptions,
    })
}

/// The concurrency table.
pub fn render_concurrency(r: &ConcurrencyReport) -> String {
    let mut s = String::new();
    s.push_str(&format!("| {:<28} | {:>4} | {:>14} | {:>20} | {:>9} | {:>10} | {:>9} |\n", "model", "seqs", "test", "decode t/s (all)", "per seq", "step ms", "TTFT ms"));
    s.push_str(&format!("| {:-<28} | {:->4} | {:->14} | {:->20} | {:->9} | {:->10} | {:->9} |\n", "", "", "", "", "", "", ""));
    let test = if r.shared_prefix > 0 { format!("pp{}+{} tg{}", r.shared_prefix, r.prompt_tokens, r.generated_tokens) } else { format!("pp{} tg{}", r.prompt_tokens, r.generated_tokens) };
    s.push_str(&format!(
        "| {:<28} | {:>4} | {:>14} | {:>20} | {:>9.2} | {:>10.2} | {:>9.1} |\n",
        r.model,
        r.sequences,
        test,
        format!("{:.2} ± {:.2}", r.decode_tokens_per_s, r.decode_tokens_per_s_stddev),
        r.decode_tokens_per_s_per_sequence,
        r.decode_step_ms,
        r.time_to_first_token_ms_mean
    ));
    s.push_str(&format!(
        "\n{}; prefill {:.1} tok/s over all prompts; TTFT max {:.1} ms; prefix cache {} of {} prompt tokens; {} preemptions\n",
        r.device, r.prefill_tokens_per_s, r.time_to_first_token_ms_max, r.prefix_hit_tokens, r.prefix_queried_tokens, r.preemptions
    ));
    s
}
