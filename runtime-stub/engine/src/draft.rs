//! A draft model for speculative decoding: a second, smaller or coarser
//! artifact with the target's vocabulary (`maxrun --draft small.mef`), run on
//! its own batched executor and KV pool beside the target's.
//!
//! For every speculating sequence the draft keeps a sequence of its own: the
//! target's tokens, then its drafts. Before each target step, [`DraftModel::propose`]
//! brings every sequence up to the target's tokens (rolling back the drafts
//! the target rejected, computing what the target accepted and sampled since)
//! and decodes `k` tokens greedily, all the sequences together in the draft's
//! batch steps. The drafts are a deterministic function of the tokens before
//! them, so the target's verification (`speculate.rs`) keeps the output
//! distribution exactly what plain decoding gives.
//!
//! The draft's blocks never join a prefix cache: its sequences are rolled back
//! to wherever the target's verification says.

use std::collections::HashMap;

use super::batch::Batched;
use super::RequestId;
use maxrun_runtime::executor::{DraftExecutor, Executor, RunError};

/// The draft model and its sequences.
pub struct DraftModel<'a> {
    backend: Batched<'a>,
    vocab: usize,
    /// A draft step's cost relative to a target decode step (their weights'
    /// bytes: decoding is bound by reading them): what a drafted token costs
    /// besides its verification row.
    pub relative_cost: f64,
    /// Draft steps run so far.
    pub steps: u64,
}

impl std::fmt::Debug for DraftModel<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftModel").field("vocab", &self.vocab).field("steps", &self.steps).finish()
    }
}

/// Index of the largest logit (the lowest index among equals).
fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

impl<'a> DraftModel<'a> {
    /// A draft model on `executor` (its batch plans and KV pool), whose
    /// vocabulary of `vocab` tokens is the target's; a step of it costs
    /// `relative_cost` target decode steps.
    pub fn new(executor: Box<dyn Executor + 'a>, vocab: u64, relative_cost: f64) -> DraftModel<'a> {
        DraftModel { backend: Batched::with_prefix_cache(executor, false), vocab: vocab as usize, relative_cost, steps: 0 }
    }

    /// The draft model on what the runtime's `runner::open_draft_executor`
    /// opened (which checked that it may draft for the target).
    pub fn of(draft: DraftExecutor<'a>) -> DraftModel<'a> {
        DraftModel::new(draft.executor, draft.vocab, draft.relative_cost)
    }

    pub fn describe(&self) -> String {
        self.backend.describe()
    }

    /// Forgets request `id` (finished, cancelled).
    pub fn remove(&mut self, id: RequestId) {
        self.backend.remove(id);
    }

    /// Computes the prompts of requests `prompts` (whose target prompt was just
    /// computed) in the draft's batch steps, so that their first drafts need
    /// only the tokens sampled since: the draft's share of prompt processing
    /// is done with the target's, before the first token.
    pub fn prefill(&mut self, prompts: &[(RequestId, Vec<u32>)]) -> Result<(), RunError> {
        let mut pending: Vec<RequestId> = Vec::new();
        for (id, tokens) in prompts {
            if !self.backend.knows(*id) && self.backend.add_tokens(*id, tokens.clone()).is_ok() {
                pending.push(*id);
            }
        }
        let mut steps = 0;
        while !pending.is_empty() && self.backend.has_work() {
            let out = self.step(&mut steps)?;
            // Other sequences' rows (a last draft) run too; their logits are not needed.
            for row in out.rows.iter().filter(|r| r.next) {
                pending.retain(|&id| id != row.id);
            }
        }
        Ok(())
    }

    /// One draft step, counted here and in `steps`, the caller's loop.
    fn step(&mut self, steps: &mut u32) -> Result<super::StepOutput, RunError> {
        let out = self.backend.step()?;
        self.steps += 1;
        *steps += 1;
        // A prompt longer than the pool's chunks takes several steps; a
        // sequence the pool cannot hold would never finish.
        assert!(*steps < 100_000, "the draft model does not advance");
        Ok(out)
    }

    /// Up to `k` greedy drafts after `tokens` for each `(id, tokens, k)`,
    /// decoded together; a sequence the draft cannot hold (longer than its
    /// context, or than its pool) gets none.
    pub fn propose(&mut self, wants: &[(RequestId, &[u32], usize)]) -> Result<HashMap<RequestId, Vec<u32>>, RunError> {
        let mut drafts: HashMap<RequestId, Vec<u32>> = HashMap::new();
        for &(id, tokens, k) in wants {
            if k == 0 || !self.sync(id, tokens) {
                continue;
            }
            drafts.insert(id, Vec::with_capacity(k));
        }
        let want = |id: RequestId| wants.iter().find(|w| w.0 == id).map_or(0, |w| w.2);
        // Each step gives every sequence one token (prompt chunks: at their
        // end); sequences that have their drafts still run until all have.
        let mut steps = 0;
        while drafts.iter().any(|(&id, d)| d.len() < want(id)) && self.backend.has_work() {
            let out = self.step(&mut steps)?;
            for (i, row) in out.rows.iter().enumerate() {
                if !row.next {
                    continue;
                }
                let token = argmax(&out.logits[i * self.vocab..(i + 1) * self.vocab]);
                if let Some(d) = drafts.get_mut(&row.id) {
                    d.push(token);
                    self.backend.append(row.id, token);
                }
            }
        }
        for (&id, d) in drafts.iter_mut() {
            d.truncate(want(id));
        }
        Ok(drafts)
    }

    /// Makes the draft's sequence `id` hold `tokens` (its drafts past what the
    /// target accepted rolled back, what the target added appended); `false`
    /// when the draft cannot hold it.
    fn sync(&mut self, id: RequestId, tokens: &[u32]) -> bool {
        if !self.backend.knows(id) {
            return self.backend.add_tokens(id, tokens.to_vec()).is_ok();
        }
        let have: &[u32] = self.backend.tokens(id).unwrap_or_default();
        let common = have.iter().zip(tokens).take_while(|(a, b)| a == b).count();
        // The draft's scheduler keeps no prefix cache: a rollback always holds.
        if self.backend.rollback(id, common).is_err() {
            self.backend.remove(id);
            return self.backend.add_tokens(id, tokens.to_vec()).is_ok();
        }
        for &t in &tokens[common..] {
            self.backend.append(id, t);
        }
        true
    }
}
