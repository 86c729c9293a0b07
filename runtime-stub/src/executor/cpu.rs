//! The CPU executor: an artifact's batch plans on this machine's cores over a
//! paged KV pool in host memory.
//!
//! A step runs one plan: the decode plan when every row is a sequence's last
//! token (attention split over chunks of positions, as single-stream decode;
//! with one row, the plan with the single-stream decode's GEMVs), the mixed plan
//! otherwise. Both read each weight once per step for all rows and return the
//! logits of the step's logit rows.
//!
//! The KV pool holds, per layer, `blocks` blocks of keys and of values
//! (`[blocks, kv_heads, block_size, head_dim]`, f32 or f16 as the artifact says;
//! CPU kernels store each 16 key positions of a block transposed, their
//! business), sized once at start. On a device mesh ([`super::mesh`]) each
//! device's executor holds its own sub-model's plans, its share of the heads in
//! a pool of the same blocks, and exchanges activations with the others at the
//! plans' collectives.

use std::sync::Arc;

use super::{BatchStep, Executor, PoolLimits, ProfileRow, RunError};
use crate::artifact::Artifact;
use crate::code::LoadedCode;
use crate::collectives::MeshHub;
use crate::format::{BatchLimits, BatchPlans};
use crate::kv_cache::KvCache;
use crate::pool::ThreadPool;
use crate::session::{load_kernels, profile_rows, PlanState, Run, StepInputs};

/// One device's batch plans, threads and KV pool.
pub struct CpuExecutor<'a> {
    artifact: &'a Artifact,
    /// Which sub-model (device of a mesh) it runs.
    device: usize,
    /// The other devices of a mesh.
    hub: Option<Arc<MeshHub>>,
    _code: LoadedCode,
    pool: ThreadPool,
    mixed: PlanState,
    decode: PlanState,
    single: PlanState,
    kv: KvCache,
    limits: BatchLimits,
    blocks: u64,
    /// The plan the last step ran and its logits' floats.
    last: Option<(Which, usize)>,
}

impl<'a> CpuExecutor<'a> {
    /// The executor of a one-device artifact, with a KV pool of `kv_bytes` bytes
    /// (`None`: [`super::default_kv_bytes`]).
    pub fn new(artifact: &'a Artifact, threads: usize, kv_bytes: Option<u64>) -> Result<Self, RunError> {
        let limits = super::batch_limits(artifact)?;
        let blocks = super::pool_blocks(&artifact.header, &limits, kv_bytes)?;
        Self::on_device(artifact, threads, 0, None, blocks)
    }

    /// The executor of sub-model `device` with a pool of `blocks` blocks,
    /// exchanging activations with the other devices through `hub` (`None` on one device).
    pub fn on_device(artifact: &'a Artifact, threads: usize, device: usize, hub: Option<Arc<MeshHub>>, blocks: u64) -> Result<Self, RunError> {
        let h = &artifact.header;
        let limits = super::batch_limits(artifact)?;
        let plans = Self::plans_of(artifact, device);
        let (code, resolved) = load_kernels(artifact)?;
        let kv = KvCache::for_layout(&h.kv_cache, blocks.saturating_mul(limits.block_size), h.max_length)?;
        Ok(CpuExecutor {
            artifact,
            device,
            hub,
            pool: ThreadPool::new(threads),
            mixed: PlanState::new(artifact, &plans.mixed, &resolved, false),
            decode: PlanState::new(artifact, &plans.decode, &resolved, true),
            single: PlanState::new(artifact, &plans.single, &resolved, true),
            _code: code,
            kv,
            limits,
            blocks,
            last: None,
        })
    }

    fn plans_of(artifact: &Artifact, device: usize) -> &BatchPlans {
        artifact.header.sub_models[device].batch.as_ref().expect("batch_limits checked every sub-model")
    }

    /// Runs `step` on this device (on a mesh, while the others run theirs);
    /// [`CpuExecutor::last_logits`] then has its logits.
    pub fn run(&mut self, step: &BatchStep<'_>) -> Result<(), RunError> {
        step.check_adapters()?;
        let artifact = self.artifact;
        let plans = Self::plans_of(artifact, self.device);
        let rows = step.rows();
        let (which, plan, state, name) = match (step.decode_only, rows) {
            (true, 1) => (Which::Single, &plans.single, &mut self.single, "batch single"),
            (true, n) if n as u64 <= plans.decode.max_seq => (Which::Decode, &plans.decode, &mut self.decode, "batch decode"),
            _ => (Which::Mixed, &plans.mixed, &mut self.mixed, "batch mixed"),
        };
        let logit_rows = if which == Which::Mixed { self.limits.max_logit_rows } else { self.limits.max_sequences };
        assert!(rows as u64 <= plan.max_seq && step.logit_rows.len() as u64 <= logit_rows, "the scheduler keeps to the plan's rows");
        let inputs = StepInputs {
            tokens: step.tokens,
            positions: step.positions,
            slots: step.slots,
            row_sequences: step.row_sequences,
            block_tables: step.block_tables,
            logit_rows: step.logit_rows,
            sequence_starts: &[],
        };
        let mesh = self.hub.as_deref().map(|hub| (hub, self.device));
        self.last = None;
        let mut run = Run { artifact, pool: &self.pool, kv_cache: &mut self.kv, check_nan: false, plan_name: name, mesh };
        run.plan(plan, state, &inputs, [rows as i64, step.logit_rows.len() as i64])?;
        self.last = Some((which, step.logit_rows.len() * artifact.header.model.vocab_size as usize));
        Ok(())
    }

    /// The logits of the last step [`CpuExecutor::run`] ran, `[logit rows, vocab]`.
    pub fn last_logits(&mut self) -> &[f32] {
        let plans = Self::plans_of(self.artifact, self.device);
        let (which, n) = self.last.expect("a step ran");
        match which {
            Which::Single => self.single.output(&plans.single, n),
            Which::Decode => self.decode.output(&plans.decode, n),
            Which::Mixed => self.mixed.output(&plans.mixed, n),
        }
    }
}

/// Which batch plan a step ran.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Which {
    Mixed,
    Decode,
    Single,
}

impl Executor for CpuExecutor<'_> {
    fn limits(&self) -> PoolLimits {
        super::pool_limits(&self.limits, self.blocks)
    }

    fn step(&mut self, step: &BatchStep<'_>) -> Result<&[f32], RunError> {
        self.run(step)?;
        Ok(self.last_logits())
    }

    fn threads(&self) -> usize {
        self.pool.threads()
    }

    fn describe(&self) -> String {
        format!("threads: {}", self.pool.threads())
    }

    fn enable_profile(&mut self) {
        let plans = Self::plans_of(self.artifact, self.device);
        self.mixed.enable_profile(&plans.mixed);
        self.decode.enable_profile(&plans.decode);
        self.single.enable_profile(&plans.single);
    }

    /// Kernels of the mixed plan (`prefill`) and of the decode plans (`decode`), slowest first.
    fn profile(&self) -> Vec<ProfileRow> {
        let plans = Self::plans_of(self.artifact, self.device);
        let plans = [("prefill", &plans.mixed, &self.mixed), ("decode", &plans.decode, &self.decode), ("decode", &plans.single, &self.single)];
        profile_rows(&self.artifact.header, plans.into_iter())
    }
}
