//! The CPU encode executor: a sentence encoder's batch plan
//! ([`crate::format::EncodeBatch`]) on this machine's cores, many whole inputs
//! per step, one pass over the weights per step.
//!
//! A step's inputs are whole sequences, each a contiguous run of the step's
//! rows: their tokens, each row's position within its sequence, each row's
//! sequence, and the sequences' row starts (`SequenceStarts`, `i32[sequences +
//! 1]`). There is no KV cache: every row attends to its own sequence's rows of
//! the step (`attention_ragged`). The plan returns one pooled, normalized
//! embedding per sequence, `[sequences, width]`.

use super::{EncodeExecutor, EncodeLimits, EncodeStep, ProfileRow, RunError};
use crate::artifact::Artifact;
use crate::code::LoadedCode;
use crate::format::EncodeBatch;
use crate::kv_cache::KvCache;
use crate::pool::ThreadPool;
use crate::session::{load_kernels, profile_rows, PlanState, Run, StepInputs};

/// An encoder artifact's batch plan, its threads and its arena.
pub struct CpuEncoder<'a> {
    artifact: &'a Artifact,
    _code: LoadedCode,
    pool: ThreadPool,
    plan: &'a EncodeBatch,
    state: PlanState,
    /// The plan reads no KV cache; [`Run`] takes one (of no layers).
    kv: KvCache,
    width: usize,
    /// Scan every launch's output for NaN / Inf (`maxrun --check-nan`).
    pub check_nan: bool,
}

impl std::fmt::Debug for CpuEncoder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuEncoder").field("max_sequences", &self.plan.max_sequences).field("max_rows", &self.plan.max_rows).finish()
    }
}

impl<'a> CpuEncoder<'a> {
    /// Checks the CPU, loads the code and prepares the plan's arena; refuses an
    /// artifact without an encoder batch plan.
    pub fn new(artifact: &'a Artifact, threads: usize) -> Result<CpuEncoder<'a>, RunError> {
        let h = &artifact.header;
        let (Some(plan), Some(width)) = (h.main().encode_batch.as_ref(), h.model.embedding_width) else {
            return Err(RunError::NoEncodeBatch { path: artifact.path.clone() });
        };
        let (code, resolved) = load_kernels(artifact)?;
        let kv = KvCache::new(0, &[]).map_err(|bytes| RunError::KvCacheMemory { bytes, max_length: h.max_length })?;
        Ok(CpuEncoder {
            artifact,
            state: PlanState::new(artifact, &plan.plan, &resolved, false),
            _code: code,
            pool: ThreadPool::new(threads),
            plan,
            kv,
            width: width as usize,
            check_nan: false,
        })
    }
}

impl EncodeExecutor for CpuEncoder<'_> {
    fn limits(&self) -> EncodeLimits {
        EncodeLimits { max_rows: self.plan.max_rows as usize, max_sequences: self.plan.max_sequences as usize }
    }

    fn step(&mut self, step: &EncodeStep<'_>) -> Result<&[f32], RunError> {
        let (rows, sequences) = (step.rows(), step.sequences());
        assert!(
            rows as u64 <= self.plan.max_rows && sequences as u64 <= self.plan.max_sequences && step.positions.len() == rows && step.row_sequences.len() == rows,
            "the embedder keeps to the plan's limits"
        );
        let inputs = StepInputs { tokens: step.tokens, positions: step.positions, row_sequences: step.row_sequences, sequence_starts: step.sequence_starts, ..StepInputs::default() };
        let mut run = Run { artifact: self.artifact, pool: &self.pool, kv_cache: &mut self.kv, check_nan: self.check_nan, plan_name: "encode batch", mesh: None };
        // Launches over the sequences (the pooling on) see `dims[1]`.
        run.plan(&self.plan.plan, &mut self.state, &inputs, [rows as i64, sequences as i64])?;
        Ok(self.state.output(&self.plan.plan, sequences * self.width))
    }

    fn threads(&self) -> usize {
        self.pool.threads()
    }

    fn describe(&self) -> String {
        format!("threads: {}, batched embeddings: {} inputs x {} rows per step", self.pool.threads(), self.plan.max_sequences, self.plan.max_rows)
    }

    fn enable_profile(&mut self) {
        self.state.enable_profile(&self.plan.plan);
    }

    fn profile(&self) -> Vec<ProfileRow> {
        profile_rows(&self.artifact.header, [("encode batch", &self.plan.plan, &self.state)].into_iter())
    }
}
