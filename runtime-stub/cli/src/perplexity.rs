//! `maxrun perplexity`: the perplexity of a model over a text, and with a base
//! (another model, or the scored log-probabilities it saved) the KL divergence
//! and top-1 agreement against it, defined as llama.cpp's `llama-perplexity`
//! defines them, so that the figures compare with its.
//!
//! - **Chunks.** The tokenized text (special tokens added as the tokenizer adds
//!   them) is cut into `count = tokens / ctx` chunks of `ctx` tokens; the tail
//!   that does not fill a chunk is not used. Each chunk runs as a fresh sequence
//!   (positions from 0, nothing cached). When the tokenizer adds a BOS, the
//!   chunk's first token is replaced by BOS (llama.cpp does the same; the first
//!   chunk's first token already is one).
//! - **Scored positions.** Only the second half of a chunk: the logits at
//!   positions `first = ctx / 2` to `ctx - 2` each predict the next token of
//!   the chunk, `ctx - 1 - ctx / 2` tokens per chunk, so that every scored token
//!   has at least `ctx / 2` tokens of context.
//! - **Per position.** `nll = log sum_i exp(z_i) - z_target` in f64 (the row's
//!   maximum subtracted first). PPL `= exp(mean nll)`, with uncertainty
//!   `PPL * sqrt((mean(nll^2) - mean(nll)^2) / (N - 1))`. The KL divergence of a
//!   position is `KL(base || this) = sum_i p_i (log p_i - log q_i)` with `p` the
//!   base's softmax; "same top" counts positions whose argmax (the first of
//!   equal maxima) is the base's. Means carry `sqrt(var / (N - 1))`; percentiles
//!   interpolate linearly between sorted values at `fraction * (N - 1)`; the
//!   correlation and ratios of the two PPLs use the covariance of the two mean
//!   NLLs, all as llama.cpp's `kl_divergence` prints them (which, unlike here,
//!   needs more than 10 positions before it states an uncertainty, and 100
//!   before it prints the summary).
//!
//! The base file (`--kl-divergence-base FILE`, [`BaseWriter`] / [`BaseReader`]),
//! all little-endian:
//!
//! ```text
//! "MAXRUNKL"                  8 bytes, the magic
//! version                     u32, 1
//! header length H             u32
//! header                      H bytes of JSON: BaseHeader (ctx, chunks, vocab, first, bos, tokenizer hash, ...)
//! tokens                      chunks x ctx u32: the text's tokens, before BOS replacement
//! checksum                    u64, xxh3-64 of the header JSON and the tokens
//! per chunk:
//!   per scored position       24 + 2 x vocab bytes:
//!     nll                     f64, the base's exact -log p(next token)
//!     tail                    f64, the base's total probability outside the window
//!     top                     u32, the base's argmax
//!     window                  f32, w = min(24, max z - min z) of that row's logits z
//!     levels                  vocab x u16: 0 when z_i < max z - w (outside the window,
//!                             p_i < e^-24 p_max), else 1 + round((z_i - (max z - w)) x 65534 / w)
//!   checksum                  u64, xxh3-64 of the chunk's records
//! ```
//!
//! A reader takes level `k > 0` as `(k - 1) w / 65534` and normalizes those
//! values to log-probabilities summing to `1 - tail` (the offset cancels); the
//! entries outside the window count as one outcome of probability `tail` (so
//! the KL divergence is that of the two distributions with those entries
//! merged, short of the exact one by the KL within a tail of at most
//! `vocab e^-24 p_max`). The log-probability of an entry is off by at most
//! `w / 131068 <= 1.9e-4`, centred, and the KL divergence is off by
//! `sum_i p_i d_i (log(p_i / q_i) - KL)` for those errors `d_i`: below 1e-5 per
//! position and far below on a mean over many (SmolLM2 against its own base
//! file: a mean of 3e-9). The base's NLL and argmax are stored exactly,
//! so its PPL and "same top" are exact. Size: about `2 x vocab` bytes per
//! scored position (25 MB per 512-token chunk for a 49152-token vocabulary;
//! llama.cpp's file is the same size).
//!
//! The model is anything that gives the logits of a fresh sequence
//! ([`SequenceLogits`]); `maxrun` passes its runner.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

/// The default `--ctx`: llama-perplexity's own default (512), or the
/// artifact's maximum context where that is smaller.
pub const DEFAULT_CTX: usize = 512;

/// The widest logit window a base file keeps per position (natural log units):
/// entries more than this below the row's maximum count as probability 0.
pub const WINDOW: f32 = 24.0;

/// Steps between the lowest and the highest level of a base file's window
/// (levels 1..=65535; 0 marks an entry outside the window).
const STEPS: f64 = 65534.0;

const MAGIC: &[u8; 8] = b"MAXRUNKL";
const VERSION: u32 = 1;

/// Why a model could not give logits (the runner's error, boxed).
pub type ModelError = Box<dyn std::error::Error + Send + Sync>;

/// A model as perplexity sees it: the logits of a fresh sequence.
pub trait SequenceLogits {
    /// The width of a row of logits.
    fn vocab(&self) -> usize;
    /// The logits `[ids.len(), vocab]` of `ids` run as a new sequence from
    /// position 0, with nothing of an earlier call in its cache.
    fn logits(&mut self, ids: &[u32]) -> Result<&[f32], ModelError>;
}

/// What went wrong; each message names the file or flag and what to do.
#[derive(Debug, thiserror::Error)]
pub enum PerplexityError {
    #[error("{path}: {tokens} tokens, fewer than one chunk of --ctx {ctx} needs ({ctx}); give a longer text or a smaller --ctx")]
    TooFewTokens { path: PathBuf, tokens: usize, ctx: usize },
    #[error("--ctx {ctx}: {reason}")]
    Ctx { ctx: usize, reason: String },
    #[error("{path}: {reason}")]
    Input { path: PathBuf, reason: String },
    #[error("{path}: {reason}")]
    Base { path: PathBuf, reason: String },
    #[error("{path}: {what}: the file is damaged or was not written to the end; write it again with --kl-divergence-base")]
    CorruptBase { path: PathBuf, what: String },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{model}, chunk {chunk}: {source}")]
    Model { model: String, chunk: usize, source: ModelError },
    #[error(
        "{model}, chunk {chunk}, position {position}: the logits are not finite (NaN or infinity); run those tokens with `maxrun MODEL --token-ids ... --dump-logits F --check-nan` to find the kernel"
    )]
    NonFinite { model: String, chunk: usize, position: usize },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> PerplexityError + '_ {
    move |source| PerplexityError::Io { path: path.to_path_buf(), source }
}

// ---------------------------------------------------------------------------
// Chunks

/// How a token sequence is cut into the chunks that are run and scored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunks {
    /// Tokens per chunk.
    pub ctx: usize,
    /// Chunks used (the tail of the text that does not fill one is left out).
    pub count: usize,
    /// The BOS that replaces each chunk's first token, when the tokenizer adds one.
    pub bos: Option<u32>,
}

impl Chunks {
    /// The chunks of `tokens` tokens (read from `path`) at `ctx`, at most
    /// `max_chunks` of them.
    pub fn plan(path: &Path, tokens: usize, ctx: usize, max_chunks: Option<usize>, bos: Option<u32>) -> Result<Chunks, PerplexityError> {
        if ctx < 3 {
            return Err(PerplexityError::Ctx { ctx, reason: "a chunk needs at least 3 tokens (the second half is scored, each token predicted from the ones before)".into() });
        }
        if max_chunks == Some(0) {
            return Err(PerplexityError::Ctx { ctx, reason: "--chunks 0 scores nothing; give at least 1 (or leave it out for every chunk)".into() });
        }
        if tokens < ctx {
            return Err(PerplexityError::TooFewTokens { path: path.to_path_buf(), tokens, ctx });
        }
        let count = (tokens / ctx).min(max_chunks.unwrap_or(usize::MAX));
        Ok(Chunks { ctx, count, bos })
    }

    /// The first scored position of a chunk.
    pub fn first(&self) -> usize {
        self.ctx / 2
    }

    /// Scored positions per chunk.
    pub fn scored(&self) -> usize {
        self.ctx - 1 - self.first()
    }

    /// The tokens of every chunk, before BOS replacement.
    pub fn used<'t>(&self, tokens: &'t [u32]) -> &'t [u32] {
        &tokens[..self.count * self.ctx]
    }

    /// Chunk `i` as it runs: its tokens with the first replaced by BOS where
    /// the tokenizer adds one.
    pub fn ids(&self, tokens: &[u32], i: usize) -> Vec<u32> {
        let mut ids = tokens[i * self.ctx..(i + 1) * self.ctx].to_vec();
        if let Some(bos) = self.bos {
            ids[0] = bos;
        }
        ids
    }
}

/// The BOS id the tokenizer puts before a text, if it adds one (then every
/// chunk starts with it, as llama.cpp's `llama_vocab_get_add_bos` decides).
pub fn added_bos(tokenizer: &tokenizers::Tokenizer, bos: Option<u32>) -> Option<u32> {
    let bos = bos?;
    let with = tokenizer.encode("a", true).ok()?;
    let without = tokenizer.encode("a", false).ok()?;
    (with.get_ids().first() == Some(&bos) && without.get_ids().first() != Some(&bos)).then_some(bos)
}

/// Token ids from a `--token-ids-file`: decimal numbers separated by
/// whitespace or commas, each below `vocab`.
pub fn parse_token_ids(path: &Path, text: &str, vocab: usize) -> Result<Vec<u32>, PerplexityError> {
    let mut ids = Vec::new();
    for (n, item) in text.split(|c: char| c == ',' || c.is_whitespace()).filter(|s| !s.is_empty()).enumerate() {
        let bad = |reason: String| PerplexityError::Input { path: path.to_path_buf(), reason };
        let id: u32 = item.parse().map_err(|_| bad(format!("item {} (`{item}`) is not a token id; the file holds decimal ids separated by spaces, newlines or commas", n + 1)))?;
        if id as usize >= vocab {
            return Err(bad(format!("item {} is token id {id}, outside the artifact's vocabulary of {vocab} tokens", n + 1)));
        }
        ids.push(id);
    }
    Ok(ids)
}

// ---------------------------------------------------------------------------
// The math of one position

/// `log sum_i exp(z_i)` of a row of logits in f64 (the maximum subtracted
/// first), and the row's argmax (the first of equal maxima). Not finite when
/// a logit is NaN or infinite.
pub fn log_sum_exp(row: &[f32]) -> (f64, usize) {
    let (mut top, mut max) = (0, f32::NEG_INFINITY);
    for (i, &z) in row.iter().enumerate() {
        if z > max {
            (top, max) = (i, z);
        }
    }
    let m = max as f64;
    let sum: f64 = row.iter().map(|&z| (z as f64 - m).exp()).sum();
    (m + sum.ln(), top)
}

/// `KL(p || q) = sum_i p_i (log p_i - log q_i)` of the softmaxes of two rows of
/// logits, given each row's [`log_sum_exp`].
pub fn kl_divergence(base: &[f32], base_lse: f64, row: &[f32], lse: f64) -> f64 {
    base.iter()
        .zip(row)
        .map(|(&b, &z)| {
            let lp = b as f64 - base_lse;
            let p = lp.exp();
            if p == 0.0 {
                0.0
            } else {
                p * (lp - (z as f64 - lse))
            }
        })
        .sum()
}

/// The bytes of one scored position in a base file.
pub fn record_bytes(vocab: usize) -> usize {
    24 + 2 * vocab
}

/// Appends the base-file record of a row (the module doc's layout) to `out`:
/// `nll` and `top` as given (`lse`: the row's [`log_sum_exp`]), the row's
/// logits as levels in its window, and the probability outside it.
pub fn encode_record(row: &[f32], lse: f64, nll: f64, top: usize, out: &mut Vec<u8>) {
    let max = row[top] as f64;
    let min = row.iter().fold(f32::INFINITY, |m, &z| m.min(z)) as f64;
    let window = ((max - min) as f32).min(WINDOW);
    let w = window as f64;
    let lo = max - w;
    let scale = if w > 0.0 { STEPS / w } else { 0.0 };
    // Values within half a step below the window's floor (the float rounding
    // of `window`) still take its lowest level.
    let floor = lo - 0.5 / scale.max(f64::MIN_POSITIVE);
    let outside = |z: f64| w > 0.0 && z < floor;
    let tail: f64 = row.iter().map(|&z| z as f64).filter(|&z| outside(z)).map(|z| (z - lse).exp()).sum();
    out.extend(nll.to_le_bytes());
    out.extend(tail.to_le_bytes());
    out.extend((top as u32).to_le_bytes());
    out.extend(window.to_le_bytes());
    out.extend(row.iter().flat_map(|&z| {
        let z = z as f64;
        let level = if outside(z) { 0 } else { 1 + ((z - lo) * scale).round().clamp(0.0, STEPS) as u16 };
        level.to_le_bytes()
    }));
}

/// One scored position of a base file.
#[derive(Clone, Debug, PartialEq)]
pub struct BaseRecord {
    pub nll: f64,
    /// The base's probability outside the window, in total.
    pub tail: f64,
    pub top: u32,
    pub window: f32,
    pub levels: Vec<u16>,
}

impl BaseRecord {
    /// Reads a record of `vocab` entries from `bytes` (exactly [`record_bytes`] long).
    pub fn parse(bytes: &[u8], vocab: usize) -> BaseRecord {
        let word = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
        let double = |at: usize| f64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        BaseRecord {
            nll: double(0),
            tail: double(8),
            top: word(16),
            window: f32::from_bits(word(20)),
            levels: bytes[24..24 + 2 * vocab].chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect(),
        }
    }

    /// The base's log-probabilities as the levels give them, normalized to
    /// `1 - tail` (`-inf` outside the window).
    pub fn log_probs(&self) -> Vec<f64> {
        let step = self.window as f64 / STEPS;
        let y = |k: u16| (k - 1) as f64 * step;
        let top = self.levels.iter().copied().filter(|&k| k > 0).max().map_or(0.0, y);
        let sum: f64 = self.levels.iter().filter(|&&k| k > 0).map(|&k| (y(k) - top).exp()).sum();
        let lse = top + sum.ln() - (1.0 - self.tail).ln();
        self.levels.iter().map(|&k| if k == 0 { f64::NEG_INFINITY } else { y(k) - lse }).collect()
    }

    /// `KL(base || this)` for this row of logits with its [`log_sum_exp`]: over
    /// the window's entries one by one, and the entries outside it as one
    /// (their total probability under each model).
    pub fn kl_divergence(&self, row: &[f32], lse: f64) -> f64 {
        let (mut kl, mut q_tail) = (0.0, 0.0);
        for (lp, &z) in self.log_probs().into_iter().zip(row) {
            let lq = z as f64 - lse;
            if lp.is_finite() {
                kl += lp.exp() * (lp - lq);
            } else {
                q_tail += lq.exp();
            }
        }
        if self.tail > 0.0 {
            kl += self.tail * (self.tail.ln() - q_tail.max(f64::MIN_POSITIVE).ln());
        }
        kl
    }
}

// ---------------------------------------------------------------------------
// Statistics

/// Running sums of a quantity: its mean and the uncertainty of that mean.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Moments {
    pub n: usize,
    pub sum: f64,
    pub sum2: f64,
}

impl Moments {
    pub fn add(&mut self, x: f64) {
        self.n += 1;
        self.sum += x;
        self.sum2 += x * x;
    }

    pub fn mean(&self) -> f64 {
        if self.n == 0 {
            0.0
        } else {
            self.sum / self.n as f64
        }
    }

    /// The standard error of the mean, `sqrt((mean(x^2) - mean(x)^2) / (n - 1))`
    /// (0 for fewer than two values or no spread).
    pub fn uncertainty(&self) -> f64 {
        let var = self.sum2 / self.n as f64 - self.mean() * self.mean();
        if self.n < 2 || var <= 0.0 {
            0.0
        } else {
            (var / (self.n - 1) as f64).sqrt()
        }
    }
}

/// The covariance of the means of two quantities measured together,
/// `(mean(ab) - mean(a) mean(b)) / (n - 1)`, from their sums and `sum_ab`.
pub fn covariance_of_means(a: &Moments, b: &Moments, sum_ab: f64) -> f64 {
    if a.n < 2 {
        return 0.0;
    }
    let n = a.n as f64;
    (sum_ab / n - a.mean() * b.mean()) / (n - 1.0)
}

/// The value at `fraction` of sorted `values`, interpolated linearly between
/// neighbours at `fraction * (n - 1)` (0 of none).
pub fn percentile(sorted: &[f64], fraction: f64) -> f64 {
    match sorted {
        [] => 0.0,
        _ if fraction <= 0.0 => sorted[0],
        _ if fraction >= 1.0 => sorted[sorted.len() - 1],
        _ => {
            let at = fraction * (sorted.len() - 1) as f64;
            let (i, t) = (at.floor() as usize, at - at.floor());
            (1.0 - t) * sorted[i] + t * sorted[(i + 1).min(sorted.len() - 1)]
        }
    }
}

/// A distribution's extremes and percentiles.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub max: f64,
    pub p99_9: f64,
    pub p99: f64,
    pub p95: f64,
    pub p90: f64,
    pub p75: f64,
    pub median: f64,
    pub p25: f64,
    pub p10: f64,
    pub p5: f64,
    pub p1: f64,
    pub p0_1: f64,
    pub min: f64,
}

impl Percentiles {
    pub fn of(mut values: Vec<f64>) -> Percentiles {
        values.sort_by(f64::total_cmp);
        let p = |f| percentile(&values, f);
        Percentiles {
            max: p(1.0),
            p99_9: p(0.999),
            p99: p(0.99),
            p95: p(0.95),
            p90: p(0.90),
            p75: p(0.75),
            median: p(0.5),
            p25: p(0.25),
            p10: p(0.10),
            p5: p(0.05),
            p1: p(0.01),
            p0_1: p(0.001),
            min: p(0.0),
        }
    }
}

/// What `maxrun perplexity` reports (`--json` prints it as it is).
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub model: String,
    pub ctx: usize,
    pub chunks: usize,
    pub tokens_scored: usize,
    /// `exp(mean nll)`.
    pub ppl: f64,
    /// Its standard error.
    pub ppl_stderr: f64,
    pub mean_nll: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl: Option<KlReport>,
}

/// The comparison with a base (`--kl-divergence`, `--base`).
#[derive(Clone, Debug, Serialize)]
pub struct KlReport {
    /// The base file or artifact.
    pub base: String,
    pub ppl_base: f64,
    pub ppl_base_stderr: f64,
    /// Correlation of the two mean NLLs (of `ln PPL`).
    pub ln_ppl_correlation: f64,
    pub ln_ppl_ratio: f64,
    pub ln_ppl_ratio_stderr: f64,
    pub ppl_ratio: f64,
    pub ppl_ratio_stderr: f64,
    pub ppl_diff: f64,
    pub ppl_diff_stderr: f64,
    /// Mean `KL(base || this)` per position.
    pub mean_kld: f64,
    pub mean_kld_stderr: f64,
    pub kld: Percentiles,
    /// The fraction of positions whose argmax is the base's.
    pub same_top: f64,
    pub same_top_stderr: f64,
    /// `p(next token) - p_base(next token)`.
    pub mean_delta_p: f64,
    pub mean_delta_p_stderr: f64,
    pub rms_delta_p: f64,
    pub rms_delta_p_stderr: f64,
    pub delta_p: Percentiles,
}

/// The sums behind a [`Report`], position by position in chunk order.
#[derive(Debug, Default)]
struct Tally {
    nll: Moments,
    base: Option<BaseTally>,
}

#[derive(Debug, Default)]
struct BaseTally {
    nll: Moments,
    nll_cross: f64,
    kld: Moments,
    delta_p: Moments,
    delta_p2: Moments,
    same_top: usize,
    kld_values: Vec<f64>,
    delta_p_values: Vec<f64>,
}

/// One scored position.
#[derive(Clone, Copy, Debug)]
struct Scored {
    nll: f64,
    top: usize,
    base: Option<VsBase>,
}

#[derive(Clone, Copy, Debug)]
struct VsBase {
    nll: f64,
    top: usize,
    kld: f64,
}

impl Tally {
    fn add(&mut self, s: &Scored) {
        self.nll.add(s.nll);
        if let Some(b) = &s.base {
            let t = self.base.get_or_insert_with(BaseTally::default);
            t.nll.add(b.nll);
            t.nll_cross += s.nll * b.nll;
            t.kld.add(b.kld);
            t.kld_values.push(b.kld);
            let dp = (-s.nll).exp() - (-b.nll).exp();
            t.delta_p.add(dp);
            t.delta_p2.add(dp * dp);
            t.delta_p_values.push(dp);
            t.same_top += (s.top == b.top) as usize;
        }
    }

    fn ppl(&self) -> f64 {
        self.nll.mean().exp()
    }

    fn report(self, model: &str, base: &str, chunks: &Chunks) -> Report {
        let ppl = self.ppl();
        let ppl_stderr = ppl * self.nll.uncertainty();
        let kl = self.base.map(|t| {
            let (u, ub) = (self.nll.uncertainty(), t.nll.uncertainty());
            let ppl_base = t.nll.mean().exp();
            let cov = covariance_of_means(&self.nll, &t.nll, t.nll_cross);
            let ln_ratio = self.nll.mean() - t.nll.mean();
            let ln_ratio_stderr = (u * u + ub * ub - 2.0 * cov).max(0.0).sqrt();
            let (ppl_base_stderr, ppl_cov) = (ppl_base * ub, ppl * ppl_base * cov);
            let n = t.kld.n as f64;
            let same_top = t.same_top as f64 / n;
            let rms = t.delta_p2.mean().sqrt();
            KlReport {
                base: base.to_string(),
                ppl_base,
                ppl_base_stderr,
                ln_ppl_correlation: if u * ub > 0.0 { cov / (u * ub) } else { 0.0 },
                ln_ppl_ratio: ln_ratio,
                ln_ppl_ratio_stderr: ln_ratio_stderr,
                ppl_ratio: ln_ratio.exp(),
                ppl_ratio_stderr: ln_ratio.exp() * ln_ratio_stderr,
                ppl_diff: ppl - ppl_base,
                ppl_diff_stderr: (ppl_stderr * ppl_stderr + ppl_base_stderr * ppl_base_stderr - 2.0 * ppl_cov).max(0.0).sqrt(),
                mean_kld: t.kld.mean(),
                mean_kld_stderr: t.kld.uncertainty(),
                kld: Percentiles::of(t.kld_values),
                same_top,
                same_top_stderr: if n > 1.0 { (same_top * (1.0 - same_top) / (n - 1.0)).sqrt() } else { 0.0 },
                mean_delta_p: t.delta_p.mean(),
                mean_delta_p_stderr: t.delta_p.uncertainty(),
                rms_delta_p: rms,
                rms_delta_p_stderr: if rms > 0.0 { 0.5 / rms * t.delta_p2.uncertainty() } else { 0.0 },
                delta_p: Percentiles::of(t.delta_p_values),
            }
        });
        Report {
            model: model.to_string(),
            ctx: chunks.ctx,
            chunks: chunks.count,
            tokens_scored: self.nll.n,
            ppl,
            ppl_stderr,
            mean_nll: self.nll.mean(),
            kl,
        }
    }
}

// ---------------------------------------------------------------------------
// Base files

/// The JSON header of a base file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BaseHeader {
    /// Tokens per chunk.
    pub ctx: usize,
    pub chunks: usize,
    pub vocab: usize,
    /// The first scored position of a chunk (`ctx / 2`); `ctx - 1 - first` per chunk.
    pub first: usize,
    /// The BOS that replaced each chunk's first token, if any.
    pub bos: Option<u32>,
    /// [`tokenizer_fingerprint`](maxrun_runtime::artifact::tokenizer_fingerprint) of the base artifact's tokenizer.
    pub tokenizer: String,
    /// The base artifact's model name and file, and the text's file (for people).
    pub model: String,
    pub artifact: String,
    pub text: String,
}

impl BaseHeader {
    fn scored(&self) -> usize {
        self.ctx - 1 - self.first
    }

    fn chunk_bytes(&self) -> u64 {
        (self.scored() * record_bytes(self.vocab)) as u64 + 8
    }

    /// The size of a whole file with this header of `json_len` bytes.
    fn file_len(&self, json_len: usize) -> u64 {
        16 + json_len as u64 + 4 * (self.chunks * self.ctx) as u64 + 8 + self.chunks as u64 * self.chunk_bytes()
    }
}

/// Writes a base file through a temporary file, renamed into place by [`BaseWriter::finish`].
pub struct BaseWriter {
    out: BufWriter<File>,
    temp: maxrun_runtime::output::TempFile,
    path: PathBuf,
}

impl BaseWriter {
    /// Starts `path` with `header` and the chunks' `tokens`.
    pub fn create(path: &Path, header: &BaseHeader, tokens: &[u32]) -> Result<BaseWriter, PerplexityError> {
        assert_eq!(tokens.len(), header.chunks * header.ctx, "the base's tokens are its chunks'");
        let temp = maxrun_runtime::output::TempFile::new(path);
        let file = File::create(temp.path()).map_err(io(path))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        let json = serde_json::to_vec(header).expect("the header serializes");
        let token_bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let mut hash = Xxh3::new();
        hash.update(&json);
        hash.update(&token_bytes);
        let mut write = || -> std::io::Result<()> {
            out.write_all(MAGIC)?;
            out.write_all(&VERSION.to_le_bytes())?;
            out.write_all(&(json.len() as u32).to_le_bytes())?;
            out.write_all(&json)?;
            out.write_all(&token_bytes)?;
            out.write_all(&hash.digest().to_le_bytes())
        };
        write().map_err(io(path))?;
        Ok(BaseWriter { out, temp, path: path.to_path_buf() })
    }

    /// Appends one chunk's records.
    fn write_chunk(&mut self, records: &[u8]) -> Result<(), PerplexityError> {
        self.out.write_all(records).and_then(|_| self.out.write_all(&xxh3_64(records).to_le_bytes())).map_err(io(&self.path))
    }

    /// Flushes, syncs and renames the file into place.
    pub fn finish(self) -> Result<(), PerplexityError> {
        let path = self.path;
        let file = self.out.into_inner().map_err(|e| PerplexityError::Io { path: path.clone(), source: e.into_error() })?;
        file.sync_all().map_err(io(&path))?;
        self.temp.commit().map_err(io(&path))
    }
}

/// Reads a base file, checking what it says against the run that uses it.
pub struct BaseReader {
    input: BufReader<File>,
    path: PathBuf,
    pub header: BaseHeader,
    /// The chunks' tokens (before BOS replacement).
    pub tokens: Vec<u32>,
    /// Where the first chunk's records start.
    records_at: u64,
}

impl BaseReader {
    /// Opens `path` and checks its magic, version, header, tokens and size.
    pub fn open(path: &Path) -> Result<BaseReader, PerplexityError> {
        let corrupt = |what: String| PerplexityError::CorruptBase { path: path.to_path_buf(), what };
        let not_base = |reason: String| PerplexityError::Base { path: path.to_path_buf(), reason };
        let file = File::open(path).map_err(io(path))?;
        let len = file.metadata().map_err(io(path))?.len();
        let mut input = BufReader::with_capacity(1 << 20, file);
        let mut prelude = [0u8; 16];
        if len < 16 || input.read_exact(&mut prelude).is_err() {
            return Err(not_base(format!("{len} bytes, too short for a KL-divergence base; write one with `maxrun perplexity BASE.mef -f TEXT --kl-divergence-base FILE`")));
        }
        if &prelude[..8] != MAGIC {
            let what = if &prelude[..8] == b"_logits_" { "a llama.cpp logits file, which maxrun does not read" } else { "not a maxrun KL-divergence base (no `MAXRUNKL` magic)" };
            return Err(not_base(format!("{what}; write one with `maxrun perplexity BASE.mef -f TEXT --kl-divergence-base FILE`")));
        }
        let version = u32::from_le_bytes(prelude[8..12].try_into().expect("4 bytes"));
        if version != VERSION {
            return Err(not_base(format!("format version {version}, and this maxrun reads version {VERSION}; write the base again with this maxrun")));
        }
        let json_len = u32::from_le_bytes(prelude[12..16].try_into().expect("4 bytes")) as usize;
        if json_len as u64 > len.saturating_sub(16).min(1 << 20) {
            return Err(corrupt(format!("its header length ({json_len} bytes) does not fit the file")));
        }
        let mut json = vec![0u8; json_len];
        input.read_exact(&mut json).map_err(io(path))?;
        let header: BaseHeader = serde_json::from_slice(&json).map_err(|e| corrupt(format!("its header does not read ({e})")))?;
        if header.ctx < 3 || header.first != header.ctx / 2 || header.vocab == 0 || header.chunks == 0 {
            return Err(corrupt(format!("its header describes no valid chunks (ctx {}, first {}, chunks {}, vocab {})", header.ctx, header.first, header.chunks, header.vocab)));
        }
        let expected = header.file_len(json_len);
        if len != expected {
            let how = if len < expected { "short of" } else { "more than" };
            return Err(corrupt(format!("{len} bytes, {how} the {expected} its header describes ({} chunks of {} tokens)", header.chunks, header.ctx)));
        }
        let mut token_bytes = vec![0u8; 4 * header.chunks * header.ctx];
        let mut sum = [0u8; 8];
        input.read_exact(&mut token_bytes).and_then(|_| input.read_exact(&mut sum)).map_err(io(path))?;
        let mut hash = Xxh3::new();
        hash.update(&json);
        hash.update(&token_bytes);
        if hash.digest() != u64::from_le_bytes(sum) {
            return Err(corrupt("the checksum of its header and tokens does not match".into()));
        }
        let tokens: Vec<u32> = token_bytes.chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes"))).collect();
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= header.vocab) {
            return Err(corrupt(format!("token id {t} is outside its vocabulary of {} tokens", header.vocab)));
        }
        let records_at = 16 + json_len as u64 + token_bytes.len() as u64 + 8;
        Ok(BaseReader { input, path: path.to_path_buf(), header, tokens, records_at })
    }

    /// Checks the base against this run: the model's `vocab` and `tokenizer`
    /// fingerprint, its `bos`, the `--ctx` and `--chunks` flags, and, when a
    /// text was given (`text`: its file and tokens), that the text's tokens are
    /// the base's. Returns the chunks to compare and their tokens.
    pub fn plan(
        &self,
        vocab: usize,
        tokenizer: &str,
        bos: Option<u32>,
        ctx: Option<usize>,
        chunks: Option<usize>,
        text: Option<(&Path, &[u32])>,
    ) -> Result<(Chunks, Vec<u32>), PerplexityError> {
        let h = &self.header;
        let refuse = |reason: String| Err(PerplexityError::Base { path: self.path.clone(), reason });
        if h.vocab != vocab {
            return refuse(format!("the base's vocabulary has {} tokens and this artifact's {vocab}: it was written by another model family; compare artifacts of one tokenizer", h.vocab));
        }
        if let Some(c) = ctx.filter(|&c| c != h.ctx) {
            return refuse(format!("the base was written with --ctx {}, and this run asks for --ctx {c}: leave --ctx out (the base's is used) or write the base again with --ctx {c}", h.ctx));
        }
        if let Some(k) = chunks.filter(|&k| k > h.chunks) {
            return refuse(format!("the base holds {} chunks, and --chunks asks for {k}: ask for at most {} or write the base over more", h.chunks, h.chunks));
        }
        if h.bos != bos {
            let show = |b: Option<u32>| b.map_or("no BOS".to_string(), |b| format!("BOS {b}"));
            return refuse(format!(
                "the base started each chunk with {}, and this artifact's tokenizer gives {}: it is another tokenizer; compare artifacts of one tokenizer",
                show(h.bos),
                show(bos)
            ));
        }
        let other_tokenizer = h.tokenizer != tokenizer;
        let count = chunks.unwrap_or(h.chunks);
        let plan = Chunks { ctx: h.ctx, count, bos: h.bos };
        let wanted = &self.tokens[..count * h.ctx];
        match text {
            Some((file, tokens)) => {
                if tokens.len() < wanted.len() {
                    return refuse(format!(
                        "the base covers {} tokens ({count} chunks of {}), and {} gives only {}: it was written from another text; give the same text (or leave -f out to use the base's tokens)",
                        wanted.len(),
                        h.ctx,
                        file.display(),
                        tokens.len()
                    ));
                }
                if let Some(i) = (0..wanted.len()).find(|&i| tokens[i] != wanted[i]) {
                    let why = if other_tokenizer { "this artifact's tokenizer is not the base's" } else { "it was written from another text (or another --token-ids-file)" };
                    return refuse(format!(
                        "token {i} of {} is {} here and {} in the base: {why}; give the base's text and an artifact of its tokenizer",
                        file.display(),
                        tokens[i],
                        wanted[i]
                    ));
                }
            }
            None if other_tokenizer => {
                return refuse(format!(
                    "the base was written with another tokenizer (fingerprint {}, this artifact's {tokenizer}); give the text with -f so that its tokens can be compared",
                    h.tokenizer
                ))
            }
            None => {}
        }
        Ok((plan, wanted.to_vec()))
    }

    /// The records of chunk `i`, checked against their checksum.
    fn read_chunk(&mut self, i: usize) -> Result<Vec<u8>, PerplexityError> {
        let h = &self.header;
        let size = h.chunk_bytes();
        let path = self.path.clone();
        self.input.seek(SeekFrom::Start(self.records_at + i as u64 * size)).map_err(io(&path))?;
        let mut bytes = vec![0u8; size as usize];
        self.input.read_exact(&mut bytes).map_err(io(&path))?;
        let (records, sum) = bytes.split_at(size as usize - 8);
        if xxh3_64(records) != u64::from_le_bytes(sum.try_into().expect("8 bytes")) {
            return Err(PerplexityError::CorruptBase { path, what: format!("chunk {} does not match its checksum", i + 1) });
        }
        bytes.truncate(size as usize - 8);
        Ok(bytes)
    }
}

// ---------------------------------------------------------------------------
// The run

/// What this model is measured against.
pub enum Base<'m> {
    /// Nothing: perplexity only.
    None,
    /// Save this model's scored positions as a base file.
    Save(&'m mut BaseWriter),
    /// A base file.
    File(&'m mut BaseReader),
    /// Another model (its name for messages), run on the same chunks.
    Model(String, &'m mut dyn SequenceLogits),
}

/// `f(0..n)` on up to `threads` scoped threads, each a contiguous range, in order.
fn par_map<T: Send>(n: usize, threads: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let threads = threads.clamp(1, n.max(1));
    if threads == 1 {
        return (0..n).map(f).collect();
    }
    let per = n.div_ceil(threads);
    std::thread::scope(|s| {
        let f = &f;
        let parts: Vec<_> = (0..threads).map(|t| s.spawn(move || (t * per..((t + 1) * per).min(n)).map(f).collect::<Vec<T>>())).collect();
        parts.into_iter().flat_map(|p| p.join().expect("scoring threads do not panic")).collect()
    })
}

/// Checks that `logits` hold `rows` rows of `vocab`.
fn check_rows(model: &str, chunk: usize, logits: &[f32], rows: usize, vocab: usize) -> Result<(), PerplexityError> {
    if logits.len() != rows * vocab {
        let reason = format!("gave {} logits for {rows} tokens of a {vocab}-token vocabulary; perplexity needs every position's logits", logits.len());
        return Err(PerplexityError::Model { model: model.to_string(), chunk, source: reason.into() });
    }
    Ok(())
}

/// Runs `model` (named `name`) over `chunks` of `tokens` and scores them,
/// against `base` if one is given, on `threads` threads; `progress(done,
/// ppl so far)` after each chunk.
pub fn evaluate(
    name: &str,
    model: &mut dyn SequenceLogits,
    tokens: &[u32],
    chunks: &Chunks,
    mut base: Base<'_>,
    threads: usize,
    progress: &mut dyn FnMut(usize, f64),
) -> Result<Report, PerplexityError> {
    let vocab = model.vocab();
    let (first, scored) = (chunks.first(), chunks.scored());
    let mut tally = Tally::default();
    let base_name = match &base {
        Base::File(r) => r.path.display().to_string(),
        Base::Model(n, _) => n.clone(),
        Base::None | Base::Save(_) => String::new(),
    };
    for c in 0..chunks.count {
        let ids = chunks.ids(tokens, c);
        let logits = model.logits(&ids).map_err(|source| PerplexityError::Model { model: name.to_string(), chunk: c + 1, source })?;
        check_rows(name, c + 1, logits, ids.len(), vocab)?;
        let row = |j: usize| &logits[(first + j) * vocab..(first + j + 1) * vocab];
        let non_finite = |who: &str, j: usize| PerplexityError::NonFinite { model: who.to_string(), chunk: c + 1, position: first + j };
        // Position first + j predicts the chunk's token first + j + 1.
        let own = |j: usize| -> Result<(f64, f64, usize), PerplexityError> {
            let (lse, top) = log_sum_exp(row(j));
            let nll = lse - row(j)[ids[first + j + 1] as usize] as f64;
            if !nll.is_finite() {
                return Err(non_finite(name, j));
            }
            Ok((lse, nll, top))
        };
        let scores: Vec<Scored> = match &mut base {
            Base::None => par_map(scored, threads, |j| own(j).map(|(_, nll, top)| Scored { nll, top, base: None })).into_iter().collect::<Result<_, _>>()?,
            Base::Save(writer) => {
                let rows = par_map(scored, threads, |j| {
                    own(j).map(|(lse, nll, top)| {
                        let mut record = Vec::with_capacity(record_bytes(vocab));
                        encode_record(row(j), lse, nll, top, &mut record);
                        (Scored { nll, top, base: None }, record)
                    })
                });
                let mut records = Vec::with_capacity(scored * record_bytes(vocab));
                let mut scores = Vec::with_capacity(scored);
                for r in rows {
                    let (s, record) = r?;
                    records.extend(record);
                    scores.push(s);
                }
                writer.write_chunk(&records)?;
                scores
            }
            Base::File(reader) => {
                let records = reader.read_chunk(c)?;
                let size = record_bytes(vocab);
                par_map(scored, threads, |j| {
                    let (lse, nll, top) = own(j)?;
                    let record = BaseRecord::parse(&records[j * size..(j + 1) * size], vocab);
                    let kld = record.kl_divergence(row(j), lse);
                    Ok(Scored { nll, top, base: Some(VsBase { nll: record.nll, top: record.top as usize, kld }) })
                })
                .into_iter()
                .collect::<Result<_, PerplexityError>>()?
            }
            Base::Model(base_name, other) => {
                let base_logits = other.logits(&ids).map_err(|source| PerplexityError::Model { model: base_name.clone(), chunk: c + 1, source })?;
                check_rows(base_name, c + 1, base_logits, ids.len(), vocab)?;
                let base_row = |j: usize| &base_logits[(first + j) * vocab..(first + j + 1) * vocab];
                par_map(scored, threads, |j| {
                    let (lse, nll, top) = own(j)?;
                    let (base_lse, base_top) = log_sum_exp(base_row(j));
                    let base_nll = base_lse - base_row(j)[ids[first + j + 1] as usize] as f64;
                    if !base_nll.is_finite() {
                        return Err(non_finite(base_name, j));
                    }
                    let kld = kl_divergence(base_row(j), base_lse, row(j), lse);
                    Ok(Scored { nll, top, base: Some(VsBase { nll: base_nll, top: base_top, kld }) })
                })
                .into_iter()
                .collect::<Result<_, PerplexityError>>()?
            }
        };
        scores.iter().for_each(|s| tally.add(s));
        progress(c + 1, tally.ppl());
    }
    Ok(tally.report(name, &base_name, chunks))
}

/// The report as text: llama-perplexity's final lines and, with a base, its
/// statistics blocks.
pub fn render(r: &Report) -> String {
    let mut out = format!(
        "{}: {} chunks of {} tokens, {} tokens scored (the second half of each chunk)\n",
        r.model, r.chunks, r.ctx, r.tokens_scored
    );
    let Some(k) = &r.kl else {
        out.push_str(&format!("Final estimate: PPL = {:.4} +/- {:.5}\n", r.ppl, r.ppl_stderr));
        return out;
    };
    out.push_str(&format!("base: {}\n\n====== Perplexity statistics ======\n", k.base));
    let pm = |out: &mut String, label: &str, v: f64, u: f64| out.push_str(&format!("{label:<30}: {v:10.6} ± {u:10.6}\n"));
    pm(&mut out, "Mean PPL(Q)", r.ppl, r.ppl_stderr);
    pm(&mut out, "Mean PPL(base)", k.ppl_base, k.ppl_base_stderr);
    out.push_str(&format!("{:<30}: {:6.2}%\n", "Cor(ln(PPL(Q)), ln(PPL(base)))", 100.0 * k.ln_ppl_correlation));
    pm(&mut out, "Mean ln(PPL(Q)/PPL(base))", k.ln_ppl_ratio, k.ln_ppl_ratio_stderr);
    pm(&mut out, "Mean PPL(Q)/PPL(base)", k.ppl_ratio, k.ppl_ratio_stderr);
    pm(&mut out, "Mean PPL(Q)-PPL(base)", k.ppl_diff, k.ppl_diff_stderr);
    out.push_str("\n====== KL divergence statistics ======\n");
    // llama.cpp's six decimals, except for values they would show as zeros
    // (a KL of 1e-6 between two encodings of the same weights is a finding).
    let kld = |v: f64| if v == 0.0 || v.abs() >= 1e-3 { format!("{v:10.6}") } else { format!("{v:10.3e}") };
    out.push_str(&format!("Mean    KLD: {} ± {}\n", kld(k.mean_kld), kld(k.mean_kld_stderr)));
    let d = &k.kld;
    for (label, v) in [
        ("Maximum", d.max),
        ("99.9%  ", d.p99_9),
        ("99.0%  ", d.p99),
        ("95.0%  ", d.p95),
        ("90.0%  ", d.p90),
        ("Median ", d.median),
        ("10.0%  ", d.p10),
        (" 5.0%  ", d.p5),
        (" 1.0%  ", d.p1),
        (" 0.1%  ", d.p0_1),
        ("Minimum", d.min),
    ] {
        out.push_str(&format!("{label} KLD: {}\n", kld(v)));
    }
    out.push_str("\n====== Token probability statistics ======\n");
    out.push_str(&format!("Mean    Δp: {:6.3} ± {:5.3} %\n", 100.0 * k.mean_delta_p, 100.0 * k.mean_delta_p_stderr));
    let p = &k.delta_p;
    for (label, v) in [
        ("Maximum", p.max),
        ("99.9%  ", p.p99_9),
        ("99.0%  ", p.p99),
        ("95.0%  ", p.p95),
        ("90.0%  ", p.p90),
        ("75.0%  ", p.p75),
        ("Median ", p.median),
        ("25.0%  ", p.p25),
        ("10.0%  ", p.p10),
        (" 5.0%  ", p.p5),
        (" 1.0%  ", p.p1),
        (" 0.1%  ", p.p0_1),
        ("Minimum", p.min),
    ] {
        out.push_str(&format!("{label} Δp: {:6.3}%\n", 100.0 * v));
    }
    out.push_str(&format!("RMS Δp    : {:6.3} ± {:5.3} %\n", 100.0 * k.rms_delta_p, 100.0 * k.rms_delta_p_stderr));
    out.push_str(&format!("Same top p: {:6.3} ± {:5.3} %\n", 100.0 * k.same_top, 100.0 * k.same_top_stderr));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model whose logits at a position depend on the token there and the
    /// position (so chunk contents and positions both matter), scaled by `gain`.
    struct Toy {
        vocab: usize,
        gain: f32,
        calls: Vec<Vec<u32>>,
        out: Vec<f32>,
    }

    impl Toy {
        fn new(vocab: usize, gain: f32) -> Toy {
            Toy { vocab, gain, calls: Vec::new(), out: Vec::new() }
        }

        fn row(&self, token: u32, position: usize) -> Vec<f32> {
            (0..self.vocab).map(|v| self.gain * (((v as u32 * 7 + token * 13 + position as u32 * 3) % 17) as f32 * 0.5 - 2.0)).collect()
        }
    }

    impl SequenceLogits for Toy {
        fn vocab(&self) -> usize {
            self.vocab
        }
        fn logits(&mut self, ids: &[u32]) -> Result<&[f32], ModelError> {
            self.calls.push(ids.to_vec());
            self.out = ids.iter().enumerate().flat_map(|(p, &t)| self.row(t, p)).collect();
            Ok(&self.out)
        }
    }

    /// A fresh path for `name`: a folder of this process and this call (a
    /// process id can come again, and a file left by an earlier run must not
    /// be read as this one's).
    fn temp(name: &str) -> PathBuf {
        static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!("maxrun-perplexity-{}-{call}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(name)
    }

    /// The NLL of `target` under `row`, the textbook way: probabilities, then a log.
    fn naive_nll(row: &[f32], target: u32) -> f64 {
        let p: Vec<f64> = row.iter().map(|&z| (z as f64).exp()).collect();
        -(p[target as usize] / p.iter().sum::<f64>()).ln()
    }

    #[test]
    fn log_sum_exp_and_the_argmax_of_a_row() {
        let (lse, top) = log_sum_exp(&[0.0, 3f32.ln(), 3f32.ln()]);
        assert!((lse - 7f64.ln()).abs() < 1e-7, "{lse}");
        assert_eq!(top, 1, "the first of equal maxima");
        // Large logits do not overflow: the maximum is subtracted first.
        let (lse, _) = log_sum_exp(&[1000.0, 1000.0]);
        assert!((lse - (1000.0 + 2f64.ln())).abs() < 1e-9);
        assert!(!log_sum_exp(&[0.0, f32::NAN]).0.is_finite());
    }

    #[test]
    fn kl_divergence_of_two_known_distributions() {
        // p = (1/2, 1/2), q = (1/4, 3/4).
        let (p, q) = ([0.0f32, 0.0], [0.0f32, 3f32.ln()]);
        let (lp, lq) = (log_sum_exp(&p).0, log_sum_exp(&q).0);
        let expected = 0.5 * (0.5f64 / 0.25).ln() + 0.5 * (0.5f64 / 0.75).ln();
        assert!((kl_divergence(&p, lp, &q, lq) - expected).abs() < 1e-7);
        // The other direction differs: KL is not symmetric.
        let reverse = 0.25 * (0.25f64 / 0.5).ln() + 0.75 * (0.75f64 / 0.5).ln();
        assert!((kl_divergence(&q, lq, &p, lp) - reverse).abs() < 1e-7 && (expected - reverse).abs() > 1e-2);
        assert_eq!(kl_divergence(&q, lq, &q, lq), 0.0);
    }

    #[test]
    fn chunks_score_the_second_half_and_replace_the_first_token_with_bos() {
        let path = Path::new("text.txt");
        let c = Chunks::plan(path, 10, 4, None, Some(99)).unwrap();
        assert_eq!((c.count, c.first(), c.scored()), (2, 2, 1), "10 tokens make 2 chunks of 4; 2 are left over");
        let tokens: Vec<u32> = (0..10).collect();
        assert_eq!(c.ids(&tokens, 1), [99, 5, 6, 7]);
        assert_eq!(Chunks::plan(path, 10, 4, None, None).unwrap().ids(&tokens, 1), [4, 5, 6, 7]);
        assert_eq!(Chunks::plan(path, 100, 4, Some(3), None).unwrap().count, 3);
        let c = Chunks::plan(path, 512, 512, None, None).unwrap();
        assert_eq!((c.first(), c.scored()), (256, 255), "llama-perplexity scores 255 of 512");
        let e = Chunks::plan(path, 300, 512, None, None).unwrap_err().to_string();
        assert!(e.contains("text.txt") && e.contains("300 tokens") && e.contains("needs (512)") && e.contains("smaller --ctx"), "{e}");
        assert!(Chunks::plan(path, 10, 2, None, None).unwrap_err().to_string().contains("--ctx 2"));
        assert!(Chunks::plan(path, 10, 4, Some(0), None).unwrap_err().to_string().contains("--chunks 0"));
    }

    #[test]
    fn token_ids_files_are_numbers_below_the_vocabulary() {
        let p = Path::new("ids.txt");
        assert_eq!(parse_token_ids(p, "1, 2,3\n4\t5 ", 10).unwrap(), [1, 2, 3, 4, 5]);
        let e = parse_token_ids(p, "1 2 x", 10).unwrap_err().to_string();
        assert!(e.contains("ids.txt") && e.contains("item 3") && e.contains("`x`"), "{e}");
        let e = parse_token_ids(p, "1 10", 10).unwrap_err().to_string();
        assert!(e.contains("token id 10") && e.contains("10 tokens"), "{e}");
    }

    #[test]
    fn moments_uncertainty_and_percentiles() {
        let mut m = Moments::default();
        [1.0, 2.0, 3.0, 4.0].iter().for_each(|&x| m.add(x));
        assert_eq!(m.mean(), 2.5);
        // Population variance 1.25, over n - 1 = 3.
        assert!((m.uncertainty() - (1.25f64 / 3.0).sqrt()).abs() < 1e-12);
        let mut one = Moments::default();
        one.add(5.0);
        assert_eq!(one.uncertainty(), 0.0);
        let v = [0.0, 1.0, 2.0, 3.0, 4.0];
        assert!((percentile(&v, 0.999) - 3.996).abs() < 1e-12);
        assert_eq!((percentile(&v, 0.5), percentile(&v, 0.0), percentile(&v, 1.0)), (2.0, 0.0, 4.0));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 0.5), 2.5, "the median of an even count averages the middle two");
        // Perfectly correlated: the covariance of the means is the variance of the mean.
        assert!((covariance_of_means(&m, &m, 1.0 + 4.0 + 9.0 + 16.0) - m.uncertainty().powi(2)).abs() < 1e-12);
    }

    #[test]
    fn records_keep_log_probabilities_to_a_fraction_of_a_step() {
        let vocab = 3000;
        let row: Vec<f32> = (0..vocab).map(|i| ((i * 7919) % 1000) as f32 * 0.03 - 15.0).collect();
        let (lse, top) = log_sum_exp(&row);
        let mut bytes = Vec::new();
        encode_record(&row, lse, 1.25, top, &mut bytes);
        assert_eq!(bytes.len(), record_bytes(vocab));
        let r = BaseRecord::parse(&bytes, vocab);
        assert_eq!((r.nll, r.top as usize, r.window), (1.25, top, WINDOW));
        let lp = r.log_probs();
        let mut tail = 0.0;
        for (i, &z) in row.iter().enumerate() {
            let exact = z as f64 - lse;
            if lp[i].is_finite() {
                assert!((lp[i] - exact).abs() < 2.0 * WINDOW as f64 / STEPS, "entry {i}: {} vs {exact}", lp[i]);
            } else {
                tail += exact.exp();
                assert!(exact < (row[top] as f64 - lse) - WINDOW as f64 + 1e-3, "entry {i} dropped inside the window");
            }
        }
        assert!(tail > 0.0, "the row spans 30 > 24, so some entries fall outside");
        assert!((r.tail - tail).abs() <= 1e-12 * tail, "the tail's probability is kept: {} vs {tail}", r.tail);
        let kept: f64 = lp.iter().filter(|l| l.is_finite()).map(|l| l.exp()).sum();
        assert!((kept + r.tail - 1.0).abs() < 1e-12, "{kept} + {}", r.tail);
        // Against the exact distribution, the stored one is off by far less than 1e-5 in KL.
        let kl = r.kl_divergence(&row, lse);
        assert!((0.0..1e-8).contains(&kl), "{kl}");
        // A narrow row keeps every entry, the smallest one too.
        let narrow = [0.5f32, 0.25, 0.0];
        let mut bytes = Vec::new();
        encode_record(&narrow, log_sum_exp(&narrow).0, 0.0, 0, &mut bytes);
        let r = BaseRecord::parse(&bytes, 3);
        assert_eq!((r.levels.as_slice(), r.tail), ([65535, 32768, 1].as_slice(), 0.0));
        // A flat row is uniform.
        let mut bytes = Vec::new();
        encode_record(&[2.0, 2.0], log_sum_exp(&[2.0, 2.0]).0, 0.0, 0, &mut bytes);
        let lp = BaseRecord::parse(&bytes, 2).log_probs();
        assert!(lp.iter().all(|&l| (l - 0.5f64.ln()).abs() < 1e-12), "{lp:?}");
    }

    #[test]
    fn perplexity_is_the_exp_of_the_mean_nll_of_the_second_halves() {
        let tokens: Vec<u32> = (0..27).map(|i| (i * 5 + 1) % 11).collect();
        let chunks = Chunks::plan(Path::new("t"), tokens.len(), 8, None, Some(0)).unwrap();
        let mut toy = Toy::new(11, 1.0);
        let mut seen = Vec::new();
        let r = evaluate("toy", &mut toy, &tokens, &chunks, Base::None, 3, &mut |done, ppl| seen.push((done, ppl))).unwrap();
        assert_eq!((r.chunks, r.ctx, r.tokens_scored), (3, 8, 9));
        assert_eq!(toy.calls, [vec![0, 6, 0, 5, 10, 4, 9, 3], vec![0, 2, 7, 1, 6, 0, 5, 10], vec![0, 9, 3, 8, 2, 7, 1, 6]], "BOS first, then the chunk");
        // Positions 4, 5, 6 of each chunk predict tokens 5, 6, 7.
        let mut nlls = Vec::new();
        for ids in &toy.calls {
            for p in 4..7 {
                nlls.push(naive_nll(&toy.row(ids[p], p), ids[p + 1]));
            }
        }
        let mean = nlls.iter().sum::<f64>() / 9.0;
        assert!((r.ppl - mean.exp()).abs() < 1e-9 * r.ppl, "{} vs {}", r.ppl, mean.exp());
        let var = nlls.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 9.0;
        assert!((r.ppl_stderr - r.ppl * (var / 8.0).sqrt()).abs() < 1e-9);
        assert_eq!(seen.len(), 3);
        assert!((seen[2].1 - r.ppl).abs() < 1e-12);
        // The thread count changes nothing.
        let again = evaluate("toy", &mut Toy::new(11, 1.0), &tokens, &chunks, Base::None, 1, &mut |_, _| {}).unwrap();
        assert_eq!((again.ppl, again.ppl_stderr), (r.ppl, r.ppl_stderr));
    }

    #[test]
    fn a_base_file_round_trips_and_agrees_with_the_base_model_run_beside() {
        let tokens: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 23).collect();
        let chunks = Chunks::plan(Path::new("t"), tokens.len(), 10, None, None).unwrap();
        let path = temp("base.kld");
        let header = BaseHeader {
            ctx: 10,
            chunks: chunks.count,
            vocab: 23,
            first: 5,
            bos: None,
            tokenizer: "abc".into(),
            model: "toy".into(),
            artifact: "toy.mef".into(),
            text: "t".into(),
        };
        let mut writer = BaseWriter::create(&path, &header, chunks.used(&tokens)).unwrap();
        let base = evaluate("toy", &mut Toy::new(23, 1.0), &tokens, &chunks, Base::Save(&mut writer), 2, &mut |_, _| {}).unwrap();
        writer.finish().unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), header.file_len(serde_json::to_vec(&header).unwrap().len()));

        let mut reader = BaseReader::open(&path).unwrap();
        assert_eq!(reader.header, header);
        let (plan, used) = reader.plan(23, "abc", None, None, None, Some((Path::new("t"), &tokens))).unwrap();
        assert_eq!((plan.clone(), used.as_slice()), (chunks.clone(), chunks.used(&tokens)));
        // Against itself: the same PPL, the same tops, KL at the levels' rounding.
        let same = evaluate("toy", &mut Toy::new(23, 1.0), &used, &plan, Base::File(&mut reader), 2, &mut |_, _| {}).unwrap();
        let k = same.kl.unwrap();
        assert_eq!((k.ppl_base, same.ppl, k.same_top, k.ln_ppl_ratio), (base.ppl, base.ppl, 1.0, 0.0));
        assert!(k.mean_kld.abs() < 1e-8 && k.kld.max < 1e-7, "{k:?}");

        // Another model: the file and the model run beside agree.
        let mut reader = BaseReader::open(&path).unwrap();
        let from_file = evaluate("q", &mut Toy::new(23, 1.3), &used, &plan, Base::File(&mut reader), 2, &mut |_, _| {}).unwrap().kl.unwrap();
        let mut base_model = Toy::new(23, 1.0);
        let beside = evaluate("q", &mut Toy::new(23, 1.3), &used, &plan, Base::Model("base".into(), &mut base_model), 2, &mut |_, _| {}).unwrap();
        let exact = beside.kl.unwrap();
        assert!(exact.mean_kld > 1e-3, "gain 1.3 is a different model: {}", exact.mean_kld);
        // KL(base || this), from probabilities, the textbook way; the other direction differs.
        let probs = |row: Vec<f32>| {
            let e: Vec<f64> = row.iter().map(|&z| (z as f64).exp()).collect();
            let s: f64 = e.iter().sum();
            e.into_iter().map(move |x| x / s)
        };
        let (p_model, q_model) = (Toy::new(23, 1.0), Toy::new(23, 1.3));
        let (mut direct, mut reverse) = (0.0, 0.0);
        for c in 0..plan.count {
            let ids = plan.ids(&used, c);
            for pos in 5..9 {
                let pairs: Vec<(f64, f64)> = probs(p_model.row(ids[pos], pos)).zip(probs(q_model.row(ids[pos], pos))).collect();
                direct += pairs.iter().map(|(p, q)| p * (p / q).ln()).sum::<f64>() / 16.0;
                reverse += pairs.iter().map(|(p, q)| q * (q / p).ln()).sum::<f64>() / 16.0;
            }
        }
        assert!((exact.mean_kld - direct).abs() < 1e-12 && (direct - reverse).abs() > 1e-4, "{} vs {direct} (reverse {reverse})", exact.mean_kld);
        // The levels' rounding (steps of 8 / 65534 here: these rows span 8) moves
        // a position's KL by up to 1e-4 at these log-ratios; the mean of 16 less.
        assert!((from_file.mean_kld - exact.mean_kld).abs() < 1e-5, "{} vs {}", from_file.mean_kld, exact.mean_kld);
        assert!((from_file.kld.max - exact.kld.max).abs() < 1e-5);
        assert_eq!((from_file.ppl_base, from_file.same_top, exact.same_top), (exact.ppl_base, 1.0, 1.0), "a gain keeps the argmax");
    }

    #[test]
    fn base_files_that_do_not_fit_the_run_are_refused_by_name() {
        let tokens: Vec<u32> = (0..20).collect();
        let chunks = Chunks::plan(Path::new("t"), 20, 10, None, None).unwrap();
        let path = temp("fit.kld");
        let header = BaseHeader { ctx: 10, chunks: 2, vocab: 23, first: 5, bos: None, tokenizer: "abc".into(), model: "m".into(), artifact: "a".into(), text: "t".into() };
        let mut w = BaseWriter::create(&path, &header, &tokens).unwrap();
        evaluate("m", &mut Toy::new(23, 1.0), &tokens, &chunks, Base::Save(&mut w), 1, &mut |_, _| {}).unwrap();
        w.finish().unwrap();
        let r = BaseReader::open(&path).unwrap();
        let text = Path::new("other.txt");
        let err = |e: PerplexityError| e.to_string();
        assert!(err(r.plan(24, "abc", None, None, None, None).unwrap_err()).contains("23 tokens and this artifact's 24"));
        assert!(err(r.plan(23, "abc", None, Some(8), None, None).unwrap_err()).contains("--ctx 10, and this run asks for --ctx 8"));
        assert!(err(r.plan(23, "abc", None, None, Some(3), None).unwrap_err()).contains("holds 2 chunks"));
        assert!(err(r.plan(23, "abc", Some(1), None, None, None).unwrap_err()).contains("BOS 1"));
        assert!(err(r.plan(23, "xyz", None, None, None, None).unwrap_err()).contains("another tokenizer"));
        let mut other: Vec<u32> = tokens.clone();
        other[13] = 0;
        let e = err(r.plan(23, "abc", None, None, None, Some((text, &other))).unwrap_err());
        assert!(e.contains("fit.kld") && e.contains("token 13 of other.txt is 0 here and 13 in the base") && e.contains("another text"), "{e}");
        assert!(err(r.plan(23, "abc", None, None, None, Some((text, &tokens[..15]))).unwrap_err()).contains("gives only 15"));
        assert_eq!(r.plan(23, "abc", None, None, Some(1), Some((text, &tokens))).unwrap().0.count, 1);

        // Damaged files: a flipped byte in a record, a truncated file, another format.
        let good = std::fs::read(&path).unwrap();
        let mut bad = good.clone();
        let at = bad.len() - 100;
        bad[at] ^= 1;
        std::fs::write(&path, &bad).unwrap();
        let mut r = BaseReader::open(&path).unwrap();
        let e = evaluate("m", &mut Toy::new(23, 1.0), &tokens, &chunks, Base::File(&mut r), 1, &mut |_, _| {}).unwrap_err().to_string();
        assert!(e.contains("chunk 2 does not match its checksum") && e.contains("write it again with --kl-divergence-base"), "{e}");
        std::fs::write(&path, &good[..good.len() - 1]).unwrap();
        let e = err(BaseReader::open(&path).err().unwrap());
        assert!(e.contains("short") && e.contains("fit.kld"), "{e}");
        let mut bad = good.clone();
        bad[20] ^= 1;
        std::fs::write(&path, &bad).unwrap();
        assert!(BaseReader::open(&path).is_err());
        std::fs::write(&path, b"_logits_\0\0\0\0\0\0\0\0").unwrap();
        assert!(err(BaseReader::open(&path).err().unwrap()).contains("llama.cpp logits file"));
        std::fs::write(&path, b"hello").unwrap();
        assert!(err(BaseReader::open(&path).err().unwrap()).contains("too short"));
    }

    #[test]
    fn non_finite_logits_are_an_error_naming_the_position() {
        struct Nan;
        impl SequenceLogits for Nan {
            fn vocab(&self) -> usize {
                2
            }
            fn logits(&mut self, _: &[u32]) -> Result<&[f32], ModelError> {
                Ok(&[0.0, 0.0, 0.0, 0.0, f32::NAN, 0.0, 0.0, 0.0])
            }
        }
        let chunks = Chunks::plan(Path::new("t"), 4, 4, None, None).unwrap();
        let e = evaluate("nan.mef", &mut Nan, &[0, 1, 0, 1], &chunks, Base::None, 1, &mut |_, _| {}).unwrap_err().to_string();
        assert!(e.contains("nan.mef, chunk 1, position 2") && e.contains("--check-nan"), "{e}");
    }
}
