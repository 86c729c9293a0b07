//! The executor interface: what the engine asks of a device, and nothing more.
//!
//! The engine (scheduler, prefix cache, preemption, sampler, generation loop)
//! names no device. It drives an [`Executor`]: "run one ragged step of a batch
//! plan over a paged KV pool and return the requested logits rows". The CPU
//! ([`cpu::CpuExecutor`]), a mesh of CPU devices ([`mesh::MeshExecutor`]) and,
//! with the `cuda` feature, the GPU implement it; each owns its KV pool's memory
//! (host or device), while the engine's block pool decides which block holds
//! which positions. vLLM keeps the same line between its scheduler (`v1/core`)
//! and a model runner per device, and MAX between its pipelines and
//! `max.engine`.
//!
//! A step ([`BatchStep`]) is rows of many sequences concatenated: each row a
//! token at a position of one sequence, the KV slot its key and value go to,
//! and per sequence a block table; the rows whose logits come back are listed
//! ([`BatchStep::logit_rows`]), any rows at all up to the plan's limit, so a
//! request that wants every position's logits (prompt scoring, speculative
//! verification of k drafted tokens) takes them the same way as a decode row.
//! Rows carry an adapter id for LoRA adapters (0: the base model), which an
//! executor of an artifact without adapters refuses.
//!
//! Single-stream runs (`maxrun --prompt`, `--chat`, artifacts without batch
//! plans) go through [`SequenceExecutor`]: one sequence's prefill and decode
//! plans, which are the fastest way to run one sequence.
//!
//! Sentence encoders go through [`EncodeExecutor`]: "embed the whole inputs
//! of one step" ([`EncodeStep`]), no KV cache. The CPU runs an encoder's batch
//! plan ([`cpu_encoder::CpuEncoder`], many inputs per step); any
//! [`SequenceExecutor`] embeds one input per step ([`OnePerStep`]: the GPU, an
//! artifact without the plan). The engine's embedder (`maxrun_engine::embed`)
//! packs a request's inputs into steps over either.

pub mod cpu;
pub mod cpu_encoder;
pub mod gpu;
pub mod mesh;

use crate::artifact::ArtifactError;
use crate::code::CodeError;
use crate::format::{BatchLimits, Header};

/// Errors while preparing or running an artifact's plans, on any device.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
    #[error(transparent)]
    Code(#[from] CodeError),
    #[error("the sequence would reach {needed} tokens, beyond the artifact's maximum context length of {max} tokens")]
    ContextFull { needed: u64, max: u64 },
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    BadToken { id: u32, vocab: u64 },
    #[error("--check-nan: kernel `{kernel}` (launch {launch} of the {plan} plan) wrote {value} at output element {index}")]
    NonFinite { kernel: String, launch: usize, plan: &'static str, index: usize, value: f32 },
    #[error("GPU: {0}")]
    Gpu(String),
    #[error("cannot allocate the KV cache: {bytes} bytes for the artifact's {max_length} positions; recompile with a smaller `transformer.max_length` (--model-override transformer.max_length=N)")]
    KvCacheMemory { bytes: u64, max_length: u64 },
    #[error(
        "{path}: the artifact has no batch plans (it is a sentence encoder, or was compiled by a maxc without them); run requests one at a time, or recompile it with this maxc"
    )]
    NoBatchPlans { path: std::path::PathBuf },
    #[error("the KV cache memory ({bytes} bytes) holds {blocks} blocks of {block_size} positions ({block_bytes} bytes each); it needs at least {needed} to hold one sequence of the artifact's full context: give more memory (--kv-cache-memory), or recompile with a shorter context (--model-override transformer.max_length=N)")]
    PoolTooSmall { bytes: u64, blocks: u64, block_size: u64, block_bytes: u64, needed: u64 },
    #[error("row {row} asks for LoRA adapter {adapter}, but the artifact has no adapters")]
    NoAdapter { row: usize, adapter: u32 },
    #[error(
        "{path}: the artifact has no encoder batch plan (only sentence encoders compiled for one device have one); use a sentence encoder's artifact, or recompile the encoder with this maxc"
    )]
    NoEncodeBatch { path: std::path::PathBuf },
}

/// One ragged step of a batch plan: per-row and per-sequence inputs, as the
/// artifact's batch plans read them (docs/mef.md, batch plans).
#[derive(Clone, Copy, Debug, Default)]
pub struct BatchStep<'s> {
    /// Per row: its token, its position in its sequence, the KV slot its key and
    /// value go to (block `slot / block_size`, offset `slot % block_size`), and
    /// its sequence's index in this step.
    pub tokens: &'s [i32],
    pub positions: &'s [i32],
    pub slots: &'s [i32],
    pub row_sequences: &'s [i32],
    /// Per row: its LoRA adapter (0: the base model); empty: every row the base model.
    pub adapters: &'s [u32],
    /// Per sequence of the step: `blocks_per_sequence` block ids.
    pub block_tables: &'s [i32],
    /// The rows whose logits come back, in the order they come back.
    pub logit_rows: &'s [i32],
    /// Every row is its sequence's last token (the decode plans, whose
    /// attention is split over chunks of positions).
    pub decode_only: bool,
}

impl BatchStep<'_> {
    pub fn rows(&self) -> usize {
        self.tokens.len()
    }

    /// Refuses rows that ask for an adapter (the artifacts have none yet).
    pub fn check_adapters(&self) -> Result<(), RunError> {
        match self.adapters.iter().position(|&a| a != 0) {
            Some(row) => Err(RunError::NoAdapter { row, adapter: self.adapters[row] }),
            None => Ok(()),
        }
    }
}

/// What an executor's plans and KV pool hold: the scheduler forms steps within these.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolLimits {
    /// Positions per KV block.
    pub block_size: usize,
    /// Entries of a block table: blocks one sequence can hold.
    pub blocks_per_sequence: usize,
    /// Blocks in the pool.
    pub blocks: usize,
    /// Rows per step (the mixed plan's).
    pub max_rows: usize,
    /// Sequences per step.
    pub max_sequences: usize,
    /// Rows whose logits come back per step.
    pub max_logit_rows: usize,
}

/// A device that runs an artifact's batch plans over a paged KV pool.
pub trait Executor {
    /// The steps it takes and the blocks its pool has.
    fn limits(&self) -> PoolLimits;

    /// Runs one step and returns the logits of its logit rows, `[logit rows, vocab]`.
    fn step(&mut self, step: &BatchStep<'_>) -> Result<&[f32], RunError>;

    /// CPU threads a step keeps busy (the engine leaves the others to grammar masks).
    fn threads(&self) -> usize;

    /// Where it runs, for stats lines.
    fn describe(&self) -> String;

    /// Starts timing every launch, where the device can.
    fn enable_profile(&mut self) {}

    /// The kernels' times so far, slowest first (empty where not profiled).
    fn profile(&self) -> Vec<ProfileRow> {
        Vec::new()
    }
}

/// One step of a sentence encoder: whole inputs, each a contiguous run of the
/// step's rows (docs/mef.md, the encoder batch plan).
#[derive(Clone, Copy, Debug, Default)]
pub struct EncodeStep<'s> {
    /// Per row: its token, its position within its own input (from 0), and
    /// its input's index in this step.
    pub tokens: &'s [i32],
    pub positions: &'s [i32],
    pub row_sequences: &'s [i32],
    /// `[inputs + 1]`: input `s` is rows `starts[s] .. starts[s + 1]`.
    pub sequence_starts: &'s [i32],
}

impl EncodeStep<'_> {
    pub fn rows(&self) -> usize {
        self.tokens.len()
    }

    pub fn sequences(&self) -> usize {
        self.sequence_starts.len().saturating_sub(1)
    }

    /// Input `s`'s rows.
    pub fn sequence(&self, s: usize) -> std::ops::Range<usize> {
        self.sequence_starts[s] as usize..self.sequence_starts[s + 1] as usize
    }
}

/// The steps an [`EncodeExecutor`] takes: every input whole in one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EncodeLimits {
    /// Rows (tokens of all its inputs) per step; at least the longest input.
    pub max_rows: usize,
    /// Inputs per step.
    pub max_sequences: usize,
}

/// A device that embeds sentences: each step's inputs whole, no KV cache.
pub trait EncodeExecutor {
    fn limits(&self) -> EncodeLimits;

    /// Runs one step within [`Self::limits`] and returns one embedding per
    /// input, `[inputs, width]`.
    fn step(&mut self, step: &EncodeStep<'_>) -> Result<&[f32], RunError>;

    /// CPU threads a step keeps busy.
    fn threads(&self) -> usize;

    /// Where it runs and how many inputs a step takes, for stats lines.
    fn describe(&self) -> String;

    fn enable_profile(&mut self) {}

    fn profile(&self) -> Vec<ProfileRow> {
        Vec::new()
    }
}

/// An encoder's inputs one per step through a [`SequenceExecutor`]'s
/// single-sequence plans: for devices and artifacts without an encoder batch
/// plan (the GPU session, artifacts of an older maxc).
pub struct OnePerStep<S> {
    inner: S,
    max_length: usize,
    ids: Vec<u32>,
}

impl<S: SequenceExecutor> OnePerStep<S> {
    /// Embeds through `inner`, inputs of up to `max_length` tokens.
    pub fn new(inner: S, max_length: u64) -> Self {
        OnePerStep { inner, max_length: max_length as usize, ids: Vec::new() }
    }
}

impl<S: SequenceExecutor> EncodeExecutor for OnePerStep<S> {
    fn limits(&self) -> EncodeLimits {
        EncodeLimits { max_rows: self.max_length, max_sequences: 1 }
    }

    fn step(&mut self, step: &EncodeStep<'_>) -> Result<&[f32], RunError> {
        assert!(step.sequences() == 1 && step.rows() == step.sequence(0).len(), "the embedder keeps to one input per step");
        self.ids.clear();
        self.ids.extend(step.tokens.iter().map(|&t| t as u32));
        self.inner.reset();
        self.inner.forward(&self.ids)
    }

    fn threads(&self) -> usize {
        self.inner.threads()
    }

    fn describe(&self) -> String {
        format!("{}, one input per step", self.inner.describe())
    }

    fn enable_profile(&mut self) {
        self.inner.enable_profile();
    }

    fn profile(&self) -> Vec<ProfileRow> {
        self.inner.profile()
    }
}

/// How often each single-stream plan ran (tests use it to show decode is O(1)
/// tokens per step).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct RunCounts {
    pub prefill: u64,
    pub decode: u64,
}

/// One sequence through an artifact's single-stream plans (prefill in chunks,
/// the last-row prefill, decode), on any device.
pub trait SequenceExecutor {
    /// Appends `ids` to the sequence and returns their logits, `[ids.len(), vocab]`
    /// (an encoder: the sentence embedding).
    fn forward(&mut self, ids: &[u32]) -> Result<&[f32], RunError>;

    /// Appends `ids` and returns the logits of the last one only, `[vocab]`.
    fn forward_last(&mut self, ids: &[u32]) -> Result<&[f32], RunError>;

    /// Keeps only the first `len` tokens of the sequence.
    fn truncate(&mut self, len: u64);

    /// Forgets the sequence.
    fn reset(&mut self);

    fn counts(&self) -> RunCounts;

    /// CPU threads a step keeps busy.
    fn threads(&self) -> usize;

    /// Where it runs, for stats lines.
    fn describe(&self) -> String;

    fn enable_profile(&mut self) {}

    fn profile(&self) -> Vec<ProfileRow> {
        Vec::new()
    }
}

/// One row of a kernel profile: a kernel's launches within one plan, summed.
#[derive(Clone, Debug, PartialEq)]
pub struct ProfileRow {
    pub plan: &'static str,
    pub kernel: String,
    pub family: String,
    pub calls: u64,
    pub seconds: f64,
    /// Weights read plus outputs written, summed over calls.
    pub bytes: u64,
}

/// The CPUs this process may use (its affinity mask and CPU quota).
pub fn usable_cpus() -> usize {
    crate::pool::usable_cpus()
}

/// The artifact's batch limits, or why it has none.
pub fn batch_limits(artifact: &crate::artifact::Artifact) -> Result<BatchLimits, RunError> {
    let h = &artifact.header;
    match (h.batch, h.sub_models.iter().all(|m| m.batch.is_some())) {
        (Some(limits), true) => Ok(limits),
        _ => Err(RunError::NoBatchPlans { path: artifact.path.clone() }),
    }
}

/// The most memory the default KV pool takes: this fraction of what the system
/// has available (1 / this).
pub const DEFAULT_KV_SHARE: u64 = 4;

/// Bytes of one KV block of every layer, keys and values, on one device.
pub fn block_bytes_all_layers(h: &Header, limits: &BatchLimits) -> u64 {
    2 * h.kv_cache.layers.max(1) * limits.block_bytes(&h.kv_cache).unwrap_or(u64::MAX / 4)
}

/// Bytes of a KV pool (all devices together) that holds every one of
/// `limits.max_sequences` sequences at the artifact's full context, but no more
/// than [`DEFAULT_KV_SHARE`] of the host memory available (and at least one
/// full-context sequence). A device mesh splits the cache's heads, so the
/// pool's bytes are spread over its devices.
pub fn default_kv_bytes(h: &Header) -> u64 {
    let Some(b) = h.batch else { return 0 };
    let per_block = block_bytes_all_layers(h, &b).saturating_mul(h.sub_models.len() as u64);
    let one = b.blocks_per_sequence.saturating_mul(per_block);
    let all = one.saturating_mul(b.max_sequences);
    let share = crate::huge::available_memory().map_or(all, |a| a / DEFAULT_KV_SHARE);
    all.min(share).max(one)
}

/// The blocks a pool of `kv_bytes` bytes (all devices; `None`: [`default_kv_bytes`])
/// holds, or why it is too small for one full-context sequence.
pub fn pool_blocks(h: &Header, limits: &BatchLimits, kv_bytes: Option<u64>) -> Result<u64, RunError> {
    let bytes = kv_bytes.unwrap_or_else(|| default_kv_bytes(h));
    let per_block = block_bytes_all_layers(h, limits).saturating_mul(h.sub_models.len() as u64);
    let blocks = bytes / per_block.max(1);
    if blocks < limits.blocks_per_sequence {
        return Err(RunError::PoolTooSmall { bytes, blocks, block_size: limits.block_size, block_bytes: per_block, needed: limits.blocks_per_sequence });
    }
    Ok(blocks)
}

/// The limits of a pool of `blocks` blocks under the artifact's batch plans.
pub fn pool_limits(limits: &BatchLimits, blocks: u64) -> PoolLimits {
    PoolLimits {
        block_size: limits.block_size as usize,
        blocks_per_sequence: limits.blocks_per_sequence as usize,
        blocks: blocks as usize,
        max_rows: limits.max_rows as usize,
        max_sequences: limits.max_sequences as usize,
        max_logit_rows: limits.max_logit_rows as usize,
    }
}
/// A draft model's executor for speculative decoding, checked against its
/// target (same vocabulary and tokenizer, batch plans): what the engine's
/// draft model runs on.
pub struct DraftExecutor<'a> {
    pub executor: Box<dyn Executor + 'a>,
    /// The vocabulary's size (the target's).
    pub vocab: u64,
    /// What one of its decode steps costs in target decode steps (weight bytes
    /// over weight bytes: decode steps are bound by reading the weights).
    pub relative_cost: f64,
}

