//! The batched backend: many requests stepped together through an
//! [`Executor`] (CPU, a CPU mesh, the GPU) over its paged KV pool.
//!
//! Each step is formed by the [`Scheduler`] (decode rows first, then prompt
//! chunks, within the executor's [`PoolLimits`]) and handed to the executor as
//! one [`BatchStep`]: rows of many sequences, their KV slots and block tables,
//! and the rows whose logits come back (each sequence's last row; every row of
//! a request that wants all of its logits). The executor reads each weight once
//! per step for all rows; which plan runs a step is its business.

use super::scheduler::{AddError, Limits, PromptLogits, Scheduler, Step};
use super::{OutputRow, Request, RequestId, Stats, StepOutput};
use maxrun_runtime::executor::{BatchStep, Executor, ProfileRow, RunError};

/// Prompt rows per step at most (chunked prefill): a step with a prompt chunk
/// delays every running sequence's next token, by about the chunk's prefill
/// time. SmolLM2 on 2 cores, 8 streaming clients (scripts/load.py): a 240-row
/// cap gave inter-token latency p99 146-181 ms, 128 rows 122 ms, with time to
/// first token p99 510-635 ms and 708 ms (docs/performance-log.md, Serving).
pub const MAX_PROMPT_ROWS_PER_STEP: u64 = 128;

/// The batched backend.
pub struct Batched<'a> {
    executor: Box<dyn Executor + 'a>,
    scheduler: Scheduler,
    tokens: Vec<i32>,
    positions: Vec<i32>,
    slots: Vec<i32>,
    row_sequences: Vec<i32>,
    block_tables: Vec<i32>,
    logit_rows: Vec<i32>,
}

impl<'a> Batched<'a> {
    /// A scheduler over `executor`'s pool and plans.
    pub fn new(executor: Box<dyn Executor + 'a>) -> Batched<'a> {
        Self::with_prefix_cache(executor, true)
    }

    /// [`Batched::new`], its full blocks in the prefix cache or not (a draft
    /// model's sequences are rolled back anywhere).
    pub fn with_prefix_cache(executor: Box<dyn Executor + 'a>, caches_prefixes: bool) -> Batched<'a> {
        let l = executor.limits();
        let make = if caches_prefixes { Scheduler::new } else { Scheduler::without_prefix_cache };
        let scheduler = make(
            Limits {
                block_size: l.block_size,
                blocks_per_sequence: l.blocks_per_sequence,
                max_rows: l.max_rows,
                max_sequences: l.max_sequences,
                max_logit_rows: l.max_logit_rows,
                // A step keeps room for every running sequence's decode row.
                max_prompt_rows: (l.max_rows as u64 - l.max_sequences as u64).clamp(1, MAX_PROMPT_ROWS_PER_STEP) as usize,
            },
            l.blocks,
        );
        Batched {
            executor,
            scheduler,
            tokens: Vec::new(),
            positions: Vec::new(),
            slots: Vec::new(),
            row_sequences: Vec::new(),
            block_tables: Vec::new(),
            logit_rows: Vec::new(),
        }
    }

    pub fn threads(&self) -> usize {
        self.executor.threads()
    }

    pub fn describe(&self) -> String {
        let l = self.scheduler.limits();
        format!(
            "{}, batched: {} sequences x {} rows per step, KV pool {} blocks of {}",
            self.executor.describe(),
            l.max_sequences,
            l.max_rows,
            self.scheduler.pool.capacity(),
            l.block_size
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

    /// The tokens of request `id` (prompt and generated), drafts not included.
    pub fn tokens(&self, id: RequestId) -> Option<&[u32]> {
        let tokens = self.scheduler.tokens(id)?;
        Some(&tokens[..tokens.len() - self.scheduler.drafts(id).len()])
    }

    /// Drafts `drafts` after the last token of `id` ([`Scheduler::set_drafts`]).
    pub fn set_drafts(&mut self, id: RequestId, drafts: &[u32]) -> usize {
        self.scheduler.set_drafts(id, drafts)
    }

    /// The drafts of `id` its next step verifies.
    pub fn drafts(&self, id: RequestId) -> &[u32] {
        self.scheduler.drafts(id)
    }

    /// Keeps only the first `n` drafts of `id`, before its step runs.
    pub fn keep_drafts(&mut self, id: RequestId, n: usize) {
        let Some(len) = self.scheduler.tokens(id).map(<[u32]>::len) else { return };
        let drafts = self.scheduler.drafts(id).len();
        let _ = self.scheduler.rollback(id, len - drafts + n.min(drafts));
    }

    /// Keeps the first `keep` tokens of `id` ([`Scheduler::rollback`]).
    pub fn rollback(&mut self, id: RequestId, keep: usize) -> Result<(), usize> {
        self.scheduler.rollback(id, keep)
    }

    /// Whether any sequence is waiting or running.
    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
    }

    /// Whether `id` is scheduled (waiting or running).
    pub fn knows(&self, id: RequestId) -> bool {
        self.scheduler.tokens(id).is_some()
    }

    /// Queues a sequence of `tokens` whose last position's logits come back.
    pub fn add_tokens(&mut self, id: RequestId, tokens: Vec<u32>) -> Result<(), AddError> {
        self.scheduler.add(id, tokens, PromptLogits::Last)
    }

    /// Keeps the first `accepted` drafts of `id` after their step ran.
    pub fn accept(&mut self, id: RequestId, accepted: usize) {
        self.scheduler.accept(id, accepted);
    }

    pub fn fill_stats(&self, s: &mut Stats) {
        let p = &self.scheduler.pool;
        s.waiting = self.scheduler.waiting();
        s.running = self.scheduler.running();
        s.kv_blocks_total = p.capacity();
        s.kv_blocks_used = p.used();
        s.kv_block_size = p.block_size();
        s.preemptions = self.scheduler.preemptions;
        s.prefix_queried_tokens = p.stats.queried_blocks * p.block_size() as u64;
        s.prefix_hit_tokens = p.stats.hit_blocks * p.block_size() as u64;
    }

    pub fn enable_profile(&mut self) {
        self.executor.enable_profile();
    }

    pub fn profile(&self) -> Vec<ProfileRow> {
        self.executor.profile()
    }

    /// Runs the next step the scheduler forms.
    pub fn step(&mut self) -> Result<StepOutput, RunError> {
        let Some(step) = self.scheduler.schedule() else { return Ok(StepOutput::default()) };
        let logits = self.run(&step)?;
        self.scheduler.complete(&step);
        let rows = step
            .outputs
            .iter()
            .map(|o| OutputRow { id: o.seq, position: o.position, next: o.next, verifies: o.verifies, cached_tokens: self.scheduler.cached_tokens(o.seq) })
            .collect();
        let decode_rows = if step.decode_only { step.rows.len() } else { step.rows.len() - step.prompt_rows };
        Ok(StepOutput { rows, logits, prompt_rows: step.prompt_rows, decode_rows })
    }

    /// Runs `step` on the executor and returns the logits of its logit rows.
    fn run(&mut self, step: &Step) -> Result<Vec<f32>, RunError> {
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
        let batch = BatchStep {
            tokens: &self.tokens,
            positions: &self.positions,
            slots: &self.slots,
            row_sequences: &self.row_sequences,
            adapters: &[],
            block_tables: &self.block_tables,
            logit_rows: &self.logit_rows,
            decode_only: step.decode_only,
        };
        Ok(self.executor.step(&batch)?.to_vec())
    }
}
