//! The batched backend: the artifact's batch plans on the CPU over a paged KV
//! cache, stepping many requests together.
//!
//! Each step is formed by the [`Scheduler`] (decode rows first, then prompt
//! chunks, within the artifact's [`BatchLimits`]) and runs one plan: the
//! decode plan when every row is a sequence's last token (attention split over
//! chunks of positions, as single-stream decode; with one row, the plan with the
//! single-stream decode's GEMVs), the mixed plan otherwise. Both
//! read each weight once per step for all rows, and return the logits of the
//! rows the scheduler asked for (each sequence's last row; every row of a
//! request that wants all of its logits).
//!
//! The KV pool holds, per layer, `blocks` blocks of keys and of values
//! (`[blocks, kv_heads, block_size, head_dim]`, f32 or f16 as the artifact says;
//! CPU kernels store each 16 key positions of a block transposed, their business),
//! sized once at start (`kv_bytes`, else [`default_kv_bytes`]).

use super::scheduler::{AddError, Limits, PromptLogits, Scheduler, Step};
use super::{OutputRow, Request, RequestId, Stats, StepOutput};
use crate::artifact::Artifact;
use crate::code::LoadedCode;
use crate::format::BatchLimits;
use crate::kv_cache::KvCache;
use crate::pool::ThreadPool;
use crate::session::{load_kernels, PlanState, Run, SessionError, StepInputs};

/// Prompt rows per step at most (chunked prefill): a step with a prompt chunk
/// delays every running sequence's next token, by about the chunk's prefill
/// time. SmolLM2 on 2 cores, 8 streaming clients (scripts/load.py): a 240-row
/// cap gave inter-token latency p99 146-181 ms, 128 rows 122 ms, with time to
/// first token p99 510-635 ms and 708 ms (docs/performance.md, Serving).
pub const MAX_PROMPT_ROWS_PER_STEP: u64 = 128;

/// The most memory the default KV pool takes: this fraction of what the system
/// has available (1 / this).
pub const DEFAULT_KV_SHARE: u64 = 4;

/// Why the batched backend cannot run an artifact.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    #[error(
        "{path}: the artifact has no batch plans (it is split over a device mesh, is a sentence encoder, or was compiled by a maxc without them); recompile it for one device, or run requests one at a time"
    )]
    NoBatchPlans { path: std::path::PathBuf },
    #[error("the KV cache memory ({bytes} bytes) holds {blocks} blocks of {block_size} positions ({block_bytes} bytes each); it needs at least {needed} to hold one sequence of the artifact's full context: give more memory (--kv-cache-memory), or recompile with a shorter context (--model-override transformer.max_length=N)")]
    PoolTooSmall { bytes: u64, blocks: u64, block_size: u64, block_bytes: u64, needed: u64 },
    #[error(transparent)]
    Session(#[from] SessionError),
}

/// Bytes of a KV pool that holds every one of `limits.max_sequences` sequences
/// at the artifact's full context, but no more than [`DEFAULT_KV_SHARE`] of the
/// memory available (and at least one full-context sequence).
pub fn default_kv_bytes(artifact: &Artifact) -> u64 {
    let h = &artifact.header;
    let Some(b) = h.batch else { return 0 };
    let per_block = 2 * h.kv_cache.layers * b.block_bytes(&h.kv_cache).unwrap_or(u64::MAX / 4);
    let one = b.blocks_per_sequence * per_block;
    let all = one.saturating_mul(b.max_sequences);
    let share = crate::huge::available_memory().map_or(all, |a| a / DEFAULT_KV_SHARE);
    all.min(share).max(one)
}

/// The batched backend.
pub struct Batched<'a> {
    artifact: &'a Artifact,
    _code: LoadedCode,
    pool: ThreadPool,
    mixed: PlanState,
    decode: PlanState,
    single: PlanState,
    kv: KvCache,
    limits: BatchLimits,
    scheduler: Scheduler,
    tokens: Vec<i32>,
    positions: Vec<i32>,
    slots: Vec<i32>,
    row_sequences: Vec<i32>,
    block_tables: Vec<i32>,
    logit_rows: Vec<i32>,
}

impl<'a> Batched<'a> {
    /// Loads the code, sizes the KV pool (`kv_bytes` bytes, else
    /// [`default_kv_bytes`]) and prepares both plans.
    pub fn new(artifact: &'a Artifact, threads: usize, kv_bytes: Option<u64>) -> Result<Batched<'a>, BatchError> {
        let h = &artifact.header;
        let (Some(limits), Some(plans)) = (h.batch, h.main().batch.as_ref()) else {
            return Err(BatchError::NoBatchPlans { path: artifact.path.clone() });
        };
        let (code, resolved) = load_kernels(artifact)?;
        let block_bytes = limits.block_bytes(&h.kv_cache).expect("validated at open");
        let bytes = kv_bytes.unwrap_or_else(|| default_kv_bytes(artifact));
        let per_block = 2 * h.kv_cache.layers.max(1) * block_bytes;
        let blocks = bytes / per_block.max(1);
        if blocks < limits.blocks_per_sequence {
            return Err(BatchError::PoolTooSmall { bytes, blocks, block_size: limits.block_size, block_bytes: per_block, needed: limits.blocks_per_sequence });
        }
        let layer_bytes = usize::try_from(blocks * block_bytes).map_err(|_| SessionError::KvCacheMemory { bytes, max_length: h.max_length })?;
        let kv = KvCache::new(h.kv_cache.layers as usize, layer_bytes).map_err(|bytes| SessionError::KvCacheMemory { bytes, max_length: h.max_length })?;
        let scheduler = Scheduler::new(
            Limits {
                block_size: limits.block_size as usize,
                blocks_per_sequence: limits.blocks_per_sequence as usize,
                max_rows: limits.max_rows as usize,
                max_sequences: limits.max_sequences as usize,
                max_logit_rows: limits.max_sequences as usize,
                // A step keeps room for every running sequence's decode row.
                max_prompt_rows: (limits.max_rows - limits.max_sequences).clamp(1, MAX_PROMPT_ROWS_PER_STEP) as usize,
            },
            blocks as usize,
        );
        Ok(Batched {
            artifact,
            pool: ThreadPool::new(threads),
            mixed: PlanState::new(artifact, &plans.mixed, &resolved, false),
            decode: PlanState::new(artifact, &plans.decode, &resolved, true),
            single: PlanState::new(artifact, &plans.single, &resolved, true),
            _code: code,
            kv,
            limits,
            scheduler,
            tokens: Vec::new(),
            positions: Vec::new(),
            slots: Vec::new(),
            row_sequences: Vec::new(),
            block_tables: Vec::new(),
            logit_rows: Vec::new(),
        })
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    pub fn describe(&self) -> String {
        format!(
            "threads: {}, batched: {} sequences x {} rows per step, KV pool {} blocks of {}",
            self.pool.threads(),
            self.limits.max_sequences,
            self.limits.max_rows,
            self.scheduler.pool.capacity(),
            self.limits.block_size
        )
    }

    pub fn add(&mut self, id: RequestId, request: &Request) -> Result<(), AddError> {
        let logits = if request.params.prompt_logprobs.is_some() {
            PromptLogits::Every
        } else if request.all_logits {
            PromptLogits::Computed
        } else {
            PromptLogits::Last
        };
        self.scheduler.add(id, request.prompt.clone(), logits)
    }

    pub fn append(&mut self, id: RequestId, token: u32) {
        self.scheduler.append(id, token);
    }

    pub fn remove(&mut self, id: RequestId) {
        self.scheduler.remove(id);
    }

    pub fn fill_stats(&self, s: &mut Stats) {
        let p = &self.scheduler.pool;
        s.waiting = self.scheduler.waiting();
        s.running = self.scheduler.running();
        s.kv_blocks_total = p.capacity();
        s.kv_blocks_used = p.used();
        s.preemptions = self.scheduler.preemptions;
        s.prefix_queried_tokens = p.stats.queried_blocks * p.block_size() as u64;
        s.prefix_hit_tokens = p.stats.hit_blocks * p.block_size() as u64;
    }

    /// Starts timing every launch of both plans.
    pub fn enable_profile(&mut self) {
        let plans = self.artifact.header.main().batch.as_ref().expect("checked at start");
        self.mixed.enable_profile(&plans.mixed);
        self.decode.enable_profile(&plans.decode);
        self.single.enable_profile(&plans.single);
    }

    /// The profile so far: kernels of the mixed plan (`prefill`) and of the
    /// decode plan (`decode`), slowest first.
    pub fn profile(&self) -> Vec<crate::session::ProfileRow> {
        let plans = self.artifact.header.main().batch.as_ref().expect("checked at start");
        let plans = [("prefill", &plans.mixed, &self.mixed), ("decode", &plans.decode, &self.decode), ("decode", &plans.single, &self.single)];
        crate::session::profile_rows(&self.artifact.header, plans.into_iter())
    }

    /// Runs the next step the scheduler forms.
    pub fn step(&mut self) -> Result<StepOutput, SessionError> {
        let Some(step) = self.scheduler.schedule() else { return Ok(StepOutput::default()) };
        let logits = self.run(&step)?;
        self.scheduler.complete(&step);
        let rows = step
            .outputs
            .iter()
            .map(|o| OutputRow { id: o.seq, position: o.position, next: o.next, cached_tokens: self.scheduler.cached_tokens(o.seq) })
            .collect();
        let decode_rows = if step.decode_only { step.rows.len() } else { step.rows.len() - step.prompt_rows };
        Ok(StepOutput { rows, logits, prompt_rows: step.prompt_rows, decode_rows })
    }

    /// Runs `step`'s plan and returns the logits of its logit rows.
    fn run(&mut self, step: &Step) -> Result<Vec<f32>, SessionError> {
        let h = &self.artifact.header;
        let plans = h.main().batch.as_ref().expect("checked at start");
        self.tokens.clear();
        self.positions.clear();
        self.slots.clear();
        self.row_sequences.clear();
        for r in &step.rows {
            self.tokens.push(r.token as i32);
            self.positions.push(r.position as i32);
            self.slots.push(r.slot as i32);
            self.row_sequences.push(r.seq as i32);
        }
        self.block_tables.clear();
        self.block_tables.extend_from_slice(&step.tables);
        self.logit_rows.clear();
        self.logit_rows.extend(step.logit_rows.iter().map(|&r| r as i32));
        let (plan, state, name) = match (step.decode_only, step.rows.len()) {
            (true, 1) => (&plans.single, &mut self.single, "batch single"),
            (true, n) if n as u64 <= plans.decode.max_seq => (&plans.decode, &mut self.decode, "batch decode"),
            _ => (&plans.mixed, &mut self.mixed, "batch mixed"),
        };
        assert!(step.rows.len() as u64 <= plan.max_seq && step.logit_rows.len() as u64 <= self.limits.max_sequences, "the scheduler keeps to the plan's rows");
        let inputs = StepInputs {
            tokens: &self.tokens,
            positions: &self.positions,
            slots: &self.slots,
            row_sequences: &self.row_sequences,
            block_tables: &self.block_tables,
            logit_rows: &self.logit_rows,
        };
        let mut run = Run { artifact: self.artifact, pool: &self.pool, kv_cache: &mut self.kv, check_nan: false, plan_name: name };
        let dims = [step.rows.len() as i64, step.logit_rows.len() as i64];
        run.plan(plan, state, &inputs, dims, &mut |_, c| panic!("collective {c:?} in a batch plan, which is for one device"))?;
        let n = step.logit_rows.len() * h.model.vocab_size as usize;
        Ok(state.output(plan, n).to_vec())
    }
}
