//! Continuous batching: which rows each step of the batched engine runs.
//!
//! Sequences join and leave between steps. A step is filled in this order,
//! within the artifact's limits (rows per step, sequences per step, rows whose
//! logits come back) and a cap on prompt rows per step, so that one long prompt
//! cannot stall the others' decoding:
//!
//! 1. every running sequence with one token left to compute (a decode row),
//!    oldest first;
//! 2. the next chunk of each running sequence still in its prompt (chunked
//!    prefill), oldest first;
//! 3. waiting sequences, first come first served, while the step has room: each
//!    first takes the cached blocks of its longest cached prefix, then a chunk of
//!    what is left.
//!
//! A running sequence may carry drafted tokens (speculative decoding,
//! [`Scheduler::set_drafts`]): its decode row is then its last confirmed token
//! followed by the drafts, every one of them with logits, so that one step
//! verifies them all; [`Scheduler::accept`] keeps the drafts the engine
//! accepted and forgets the rest. Drafted positions never enter the prefix
//! cache until they are accepted.
//!
//! Positions live in blocks of the [`BlockPool`]. A decode row that needs a new
//! block when none is free preempts the newest running sequence: its blocks are
//! given back (its full blocks stay cached, so its prefix is likely still there
//! when it runs again), and it goes back to the front of the queue to compute
//! its tokens again (vLLM's preemption by recomputation). Prompt chunks never
//! preempt; they shrink to the blocks there are, or wait.

use std::collections::{HashMap, VecDeque};

use super::blocks::{chain_hash, BlockHash, BlockId, BlockPool};

/// A sequence's id (the engine's request id).
pub type SeqId = u64;

/// What the artifact's batch plans and the pool allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Positions per KV block.
    pub block_size: usize,
    /// Entries of a block table: blocks one sequence can hold.
    pub blocks_per_sequence: usize,
    /// Rows per step (the mixed plan's rows).
    pub max_rows: usize,
    /// Sequences per step, and running sequences at once.
    pub max_sequences: usize,
    /// Rows whose logits come back per step.
    pub max_logit_rows: usize,
    /// Prompt rows per step.
    pub max_prompt_rows: usize,
}

/// Why a sequence was refused.
/// Which prompt positions' logits a sequence wants back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PromptLogits {
    /// Only the last position's (the next token's).
    Last,
    /// Every position it computes: a cached prefix is skipped (tests compare them).
    Computed,
    /// Every position from the first (prompt scoring): it takes no cached prefix.
    Every,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AddError {
    #[error("the prompt is empty")]
    Empty,
    #[error("{tokens} tokens need {blocks} KV blocks of {block_size} positions, more than a sequence can hold ({max})")]
    TooLong { tokens: usize, blocks: usize, block_size: usize, max: usize },
    #[error("{tokens} tokens need {blocks} KV blocks of {block_size} positions, but the KV pool has {capacity}; give the engine more KV cache memory")]
    PoolTooSmall { tokens: usize, blocks: usize, block_size: usize, capacity: usize },
    #[error("a sequence with id {0} is already scheduled")]
    Duplicate(SeqId),
}

struct Sequence {
    /// The prompt, then every token generated so far.
    tokens: Vec<u32>,
    /// Positions whose keys and values are in the cache.
    computed: usize,
    blocks: Vec<BlockId>,
    /// The keys of its first full blocks (computed, or computed by the step
    /// being formed), a chain.
    keys: Vec<BlockHash>,
    /// Logits of every position it computes come back, not just the next token's.
    all_logits: bool,
    /// It takes no cached prefix (every prompt position's logits are wanted).
    from_start: bool,
    /// When it was last admitted: the newest is preempted first.
    admitted: u64,
    /// Prompt positions it found in the prefix cache when last admitted.
    cached: usize,
    /// Drafted tokens at the end of `tokens`, not yet verified.
    drafts: usize,
}

impl Sequence {
    fn remaining(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// Tokens that stand: the prompt and the generated tokens, drafts not included.
    fn confirmed(&self) -> usize {
        self.tokens.len() - self.drafts
    }

    /// Its next rows are its last token and its drafts (a decode row, or a
    /// verification step).
    fn decoding(&self) -> bool {
        self.remaining() == 1 + self.drafts
    }
}

/// One row of a step: a token at a position of a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    pub token: u32,
    pub position: u32,
    /// Where its key and value go: block `slot / block_size`, offset `slot % block_size`.
    pub slot: u32,
    /// Its sequence's index in [`Step::seqs`] (and row of [`Step::tables`]).
    pub seq: u32,
}

/// A row whose logits come back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogitRow {
    pub seq: SeqId,
    pub position: usize,
    /// The sequence's last token: its logits give the next token.
    pub next: bool,
    /// A row of a verification step: its logits check the draft after it (or,
    /// for the last, give the token after every draft).
    pub verifies: bool,
}

/// The work of one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    pub rows: Vec<Row>,
    pub seqs: Vec<SeqId>,
    /// Per sequence of the step, its block table: `blocks_per_sequence` entries
    /// (those past its blocks are 0).
    pub tables: Vec<i32>,
    /// Indices into `rows` whose logits come back, with what they are.
    pub logit_rows: Vec<u32>,
    pub outputs: Vec<LogitRow>,
    /// Every row is a sequence's only remaining token.
    pub decode_only: bool,
    /// Rows of prompts (or of recomputation after a preemption).
    pub prompt_rows: usize,
}

/// The scheduler: the pool, the queue and the running sequences.
pub struct Scheduler {
    limits: Limits,
    pub pool: BlockPool,
    seqs: HashMap<SeqId, Sequence>,
    waiting: VecDeque<SeqId>,
    /// In admission order.
    running: Vec<SeqId>,
    admissions: u64,
    /// Sequences preempted so far.
    pub preemptions: u64,
    /// Full blocks join the prefix cache (off for a draft model's sequences,
    /// whose tokens are rolled back to wherever the target's verification says).
    caches_prefixes: bool,
}

impl Scheduler {
    pub fn new(limits: Limits, blocks: usize) -> Scheduler {
        assert!(limits.max_sequences > 0 && limits.max_rows >= limits.max_sequences && limits.max_logit_rows >= limits.max_sequences && limits.max_prompt_rows > 0);
        Scheduler { limits, pool: BlockPool::new(blocks, limits.block_size), seqs: HashMap::new(), waiting: VecDeque::new(), running: Vec::new(), admissions: 0, preemptions: 0, caches_prefixes: true }
    }

    /// A scheduler whose blocks never join the prefix cache, so that any
    /// sequence can be rolled back to any length.
    pub fn without_prefix_cache(limits: Limits, blocks: usize) -> Scheduler {
        Scheduler { caches_prefixes: false, ..Scheduler::new(limits, blocks) }
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Queues a sequence of `tokens` (its prompt).
    pub fn add(&mut self, id: SeqId, tokens: Vec<u32>, logits: PromptLogits) -> Result<(), AddError> {
        if tokens.is_empty() {
            return Err(AddError::Empty);
        }
        if self.seqs.contains_key(&id) {
            return Err(AddError::Duplicate(id));
        }
        let bs = self.limits.block_size;
        let blocks = tokens.len().div_ceil(bs);
        if blocks > self.limits.blocks_per_sequence {
            return Err(AddError::TooLong { tokens: tokens.len(), blocks, block_size: bs, max: self.limits.blocks_per_sequence });
        }
        if blocks > self.pool.capacity() {
            return Err(AddError::PoolTooSmall { tokens: tokens.len(), blocks, block_size: bs, capacity: self.pool.capacity() });
        }
        self.seqs.insert(id, Sequence { tokens, computed: 0, blocks: vec![], keys: vec![], all_logits: logits != PromptLogits::Last, from_start: logits == PromptLogits::Every, admitted: 0, cached: 0, drafts: 0 });
        self.waiting.push_back(id);
        Ok(())
    }

    /// Appends a generated token to a sequence (computed by a later step).
    pub fn append(&mut self, id: SeqId, token: u32) {
        if let Some(s) = self.seqs.get_mut(&id) {
            s.tokens.push(token);
        }
    }

    /// Whether `id` can take one more token: its blocks would still fit a table.
    pub fn can_grow(&self, id: SeqId) -> bool {
        self.seqs.get(&id).is_some_and(|s| s.tokens.len() < self.limits.blocks_per_sequence * self.limits.block_size)
    }

    /// Drafts `drafts` after the last token of `id`, a running sequence with
    /// one token left to compute: its next step computes that token and the
    /// drafts, each with logits (as many as its table has room for). Returns
    /// how many it took (0 when `id` is not decoding, or has drafts already).
    pub fn set_drafts(&mut self, id: SeqId, drafts: &[u32]) -> usize {
        let room = self.limits.blocks_per_sequence * self.limits.block_size;
        let Some(s) = self.seqs.get_mut(&id) else { return 0 };
        if s.drafts != 0 || s.remaining() != 1 {
            return 0;
        }
        let n = drafts.len().min(room.saturating_sub(s.tokens.len()));
        s.tokens.extend_from_slice(&drafts[..n]);
        s.drafts = n;
        n
    }

    /// The drafts of `id` not yet verified.
    pub fn drafts(&self, id: SeqId) -> &[u32] {
        self.seqs.get(&id).map_or(&[], |s| &s.tokens[s.confirmed()..])
    }

    /// Keeps the first `accepted` drafts of `id` (they become its tokens) and
    /// forgets the others: their positions are computed again when tokens come
    /// in their place, and blocks holding only them go back to the pool.
    pub fn accept(&mut self, id: SeqId, accepted: usize) {
        let Some(s) = self.seqs.get_mut(&id) else { return };
        let keep = s.confirmed() + accepted.min(s.drafts);
        s.drafts = 0;
        // Drafted positions never join the prefix cache, so nothing past the
        // confirmed tokens is shared.
        self.rollback(id, keep).expect("drafts are never cached");
    }

    /// Keeps only the first `keep` tokens of `id` (the prompt and generated
    /// tokens that stand; speculative tokens that were rejected go): its blocks
    /// past them go back to the pool, and what it computed past them is
    /// forgotten, so they are computed again when tokens come in their place.
    /// Blocks in the prefix cache may be shared, so a rollback stops at the last
    /// one: `Err` with the first position it may keep otherwise.
    pub fn rollback(&mut self, id: SeqId, keep: usize) -> Result<(), usize> {
        let bs = self.limits.block_size;
        let Some(s) = self.seqs.get_mut(&id) else { return Ok(()) };
        let cached = s.keys.len() * bs;
        if keep < cached {
            return Err(cached);
        }
        s.drafts = s.drafts.min(keep.saturating_sub(s.confirmed()));
        s.tokens.truncate(keep);
        s.computed = s.computed.min(keep);
        let held = keep.div_ceil(bs).max(s.computed.div_ceil(bs));
        let gone: Vec<BlockId> = if s.blocks.len() > held { s.blocks.split_off(held) } else { vec![] };
        for b in gone {
            self.pool.release(b);
        }
        Ok(())
    }

    /// Ends a sequence (finished or cancelled) and gives its blocks back.
    pub fn remove(&mut self, id: SeqId) -> bool {
        let Some(s) = self.seqs.remove(&id) else { return false };
        for b in s.blocks {
            self.pool.release(b);
        }
        self.waiting.retain(|&w| w != id);
        self.running.retain(|&r| r != id);
        true
    }

    /// Sequences waiting to be admitted (preempted ones included).
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Sequences admitted and holding blocks.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Whether any sequence is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.seqs.is_empty()
    }

    /// Positions of `id` that came from the prefix cache when it was last admitted.
    pub fn cached_tokens(&self, id: SeqId) -> usize {
        self.seqs.get(&id).map_or(0, |s| s.cached)
    }

    /// The tokens of a sequence (prompt and generated).
    pub fn tokens(&self, id: SeqId) -> Option<&[u32]> {
        self.seqs.get(&id).map(|s| s.tokens.as_slice())
    }

    /// Gives back every block of `id` and puts it at the front of the queue.
    fn preempt(&mut self, id: SeqId) {
        let s = self.seqs.get_mut(&id).expect("a running sequence");
        // Its drafts go: it recomputes only the tokens that stand.
        let confirmed = s.confirmed();
        s.tokens.truncate(confirmed);
        s.drafts = 0;
        for b in s.blocks.drain(..) {
            self.pool.release(b);
        }
        s.keys.clear();
        s.computed = 0;
        self.running.retain(|&r| r != id);
        self.waiting.push_front(id);
        self.preemptions += 1;
    }

    /// Makes sure `id` holds the blocks for its first `upto` positions, taking
    /// free ones; `None` if the pool has too few.
    fn reserve(&mut self, id: SeqId, upto: usize) -> Option<()> {
        let need = upto.div_ceil(self.limits.block_size);
        let s = self.seqs.get(&id).expect("a scheduled sequence");
        let more = need.saturating_sub(s.blocks.len());
        if more > self.pool.available() {
            return None;
        }
        let taken: Vec<BlockId> = (0..more).map(|_| self.pool.allocate().expect("counted above")).collect();
        self.seqs.get_mut(&id).expect("a scheduled sequence").blocks.extend(taken);
        Some(())
    }

    /// The positions `id` can cover with the blocks it holds plus those free.
    fn coverable(&self, id: SeqId) -> usize {
        let s = &self.seqs[&id];
        (s.blocks.len() + self.pool.available()) * self.limits.block_size
    }

    /// Forms the next step; `None` when there is nothing to run.
    pub fn schedule(&mut self) -> Option<Step> {
        let l = self.limits;
        let mut plan: Vec<(SeqId, usize)> = Vec::new();
        let (mut rows_left, mut logits_left) = (l.max_rows, l.max_logit_rows);
        // 1. Decode rows, oldest first; a missing block preempts the newest.
        let order = self.running.clone();
        for id in order {
            if !self.running.contains(&id) || !self.seqs[&id].decoding() {
                continue;
            }
            if plan.len() == l.max_sequences || rows_left == 0 || logits_left == 0 {
                break;
            }
            // Drafts the step has no room for are dropped.
            let n = self.seqs[&id].remaining().min(rows_left).min(logits_left);
            let s = self.seqs.get_mut(&id).expect("running");
            if n < s.remaining() {
                let keep = s.computed + n;
                s.drafts -= s.tokens.len() - keep;
                s.tokens.truncate(keep);
            }
            loop {
                let s = &self.seqs[&id];
                let (upto, confirmed) = (s.computed + n, s.confirmed());
                if self.reserve(id, upto).is_some() {
                    self.register_full(id, upto.min(confirmed));
                    plan.push((id, n));
                    rows_left -= n;
                    logits_left -= n;
                    break;
                }
                let victim = self.running.iter().copied().filter(|r| !plan.iter().any(|p| p.0 == *r)).max_by_key(|r| self.seqs[r].admitted).expect("the sequence itself is running");
                self.preempt(victim);
                if victim == id {
                    break;
                }
            }
        }
        // 2. Prompt chunks of running sequences, then 3. admissions, in what
        // the decode rows left of the step.
        let mut prompt_left = rows_left.min(l.max_prompt_rows);
        let order = self.running.clone();
        for id in order {
            if prompt_left == 0 || logits_left == 0 {
                break;
            }
            if plan.iter().any(|p| p.0 == id) || self.seqs[&id].remaining() <= 1 || self.seqs[&id].decoding() {
                continue;
            }
            if let Some(n) = self.chunk(id, prompt_left, logits_left) {
                prompt_left -= n;
                logits_left -= self.logits_of(id, n);
                plan.push((id, n));
            }
        }
        while prompt_left > 0 && logits_left > 0 && self.running.len() < l.max_sequences && plan.len() < l.max_sequences {
            let Some(&id) = self.waiting.front() else { break };
            // The longest cached prefix, leaving at least one token to compute
            // (its logits are what the sequence needs next); none for a
            // sequence that wants every position's logits.
            let s = &self.seqs[&id];
            let most = if s.from_start { 0 } else { (s.tokens.len() - 1) / l.block_size };
            let (blocks, keys) = self.pool.take_prefix(&s.tokens, most);
            let s = self.seqs.get_mut(&id).expect("waiting");
            s.computed = blocks.len() * l.block_size;
            s.cached = s.computed;
            s.blocks = blocks;
            s.keys = keys;
            match self.chunk(id, prompt_left, logits_left) {
                Some(n) => {
                    self.waiting.pop_front();
                    self.admissions += 1;
                    self.seqs.get_mut(&id).expect("admitted").admitted = self.admissions;
                    self.running.push(id);
                    prompt_left -= n;
                    logits_left -= self.logits_of(id, n);
                    plan.push((id, n));
                }
                None => {
                    // Not even one block: it stays first in line, its prefix given back.
                    let s = self.seqs.get_mut(&id).expect("waiting");
                    let blocks = std::mem::take(&mut s.blocks);
                    s.keys.clear();
                    s.computed = 0;
                    for b in blocks {
                        self.pool.release(b);
                    }
                    break;
                }
            }
        }
        if plan.is_empty() {
            return None;
        }
        Some(self.build(&plan))
    }

    /// Rows with logits among the next `n` rows of `id`.
    fn logits_of(&self, id: SeqId, n: usize) -> usize {
        let s = &self.seqs[&id];
        if s.all_logits {
            n
        } else {
            usize::from(n == s.remaining())
        }
    }

    /// The next chunk of `id`: at most `rows` rows (and `logits` rows with logits
    /// for an all-logits sequence), shrunk to the blocks it can get, which it
    /// takes. `None` when not one row fits.
    fn chunk(&mut self, id: SeqId, rows: usize, logits: usize) -> Option<usize> {
        let s = &self.seqs[&id];
        let mut n = s.remaining().min(rows);
        if s.all_logits {
            n = n.min(logits);
        }
        let start = s.computed;
        n = n.min(self.coverable(id).saturating_sub(start));
        if n == 0 {
            return None;
        }
        self.reserve(id, start + n).expect("fits what is coverable");
        self.register_full(id, start + n);
        Some(n)
    }

    /// Puts the blocks of `id` that its first `upto` positions fill into the
    /// prefix cache. A chunk's blocks join when it is scheduled, not when it has
    /// run: a sequence admitted later in the same step (a request's other
    /// choices, the same system prompt twice) takes them at once, since each
    /// layer stores every row's key and value before any row attends.
    fn register_full(&mut self, id: SeqId, upto: usize) {
        if !self.caches_prefixes {
            return;
        }
        let bs = self.limits.block_size;
        let s = self.seqs.get_mut(&id).expect("a scheduled sequence");
        while s.keys.len() < upto / bs {
            let b = s.keys.len();
            let key = chain_hash(s.keys.last().copied(), &s.tokens[b * bs..(b + 1) * bs]);
            self.pool.register(s.blocks[b], key);
            s.keys.push(key);
        }
    }

    fn build(&self, plan: &[(SeqId, usize)]) -> Step {
        let l = self.limits;
        let mut step = Step { decode_only: true, ..Step::default() };
        for (index, &(id, n)) in plan.iter().enumerate() {
            let s = &self.seqs[&id];
            step.seqs.push(id);
            let mut table = vec![0i32; l.blocks_per_sequence];
            for (t, &b) in table.iter_mut().zip(&s.blocks) {
                *t = b as i32;
            }
            step.tables.extend(table);
            if n != 1 || s.remaining() != 1 {
                step.decode_only = false;
                if s.drafts == 0 {
                    step.prompt_rows += n;
                }
            }
            for p in s.computed..s.computed + n {
                let last = p + 1 == s.tokens.len();
                // The last confirmed token's row and every draft's row verify.
                let verifies = s.drafts > 0 && p + 1 >= s.confirmed();
                if s.all_logits || last || verifies {
                    step.logit_rows.push(step.rows.len() as u32);
                    step.outputs.push(LogitRow { seq: id, position: p, next: last, verifies });
                }
                let slot = s.blocks[p / l.block_size] as usize * l.block_size + p % l.block_size;
                step.rows.push(Row { token: s.tokens[p], position: p as u32, slot: slot as u32, seq: index as u32 });
            }
        }
        step
    }

    /// Records that `step` ran: its rows are in the cache.
    pub fn complete(&mut self, step: &Step) {
        let mut rows = vec![0usize; step.seqs.len()];
        for r in &step.rows {
            rows[r.seq as usize] += 1;
        }
        for (&id, &n) in step.seqs.iter().zip(&rows) {
            // A sequence removed or preempted since is not advanced.
            let Some(s) = self.seqs.get_mut(&id) else { continue };
            if !self.running.contains(&id) {
                continue;
            }
            s.computed += n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits { block_size: 4, blocks_per_sequence: 8, max_rows: 16, max_sequences: 4, max_logit_rows: 4, max_prompt_rows: 8 }
    }

    /// Runs steps until `id` has no token left to compute, appending `next` each
    /// time the sequence's next token is due; returns the steps.
    fn drive(s: &mut Scheduler, steps: usize, next: u32) -> Vec<Step> {
        let mut out = Vec::new();
        for _ in 0..steps {
            let Some(step) = s.schedule() else { break };
            s.complete(&step);
            for o in step.outputs.iter().filter(|o| o.next) {
                s.append(o.seq, next);
            }
            out.push(step);
        }
        out
    }

    #[test]
    fn a_prompt_runs_in_chunks_then_decodes() {
        let mut s = Scheduler::new(limits(), 16);
        s.add(1, (0..20).collect(), PromptLogits::Last).unwrap();
        let steps = drive(&mut s, 4, 99);
        // 20 prompt tokens at 8 per step: 8, 8, 4 (the last chunk ends the prompt
        // and returns its last row's logits), then a decode row.
        assert_eq!(steps.iter().map(|st| st.rows.len()).collect::<Vec<_>>(), vec![8, 8, 4, 1]);
        assert_eq!(steps.iter().map(|st| st.logit_rows.clone()).collect::<Vec<_>>(), vec![vec![], vec![], vec![3], vec![0]]);
        assert!(steps[3].decode_only && !steps[2].decode_only);
        assert_eq!(steps[3].rows[0], Row { token: 99, position: 20, slot: steps[3].rows[0].slot, seq: 0 });
        // Slots follow the block table.
        for st in &steps {
            for r in &st.rows {
                let table = &st.tables[r.seq as usize * 8..][..8];
                assert_eq!(r.slot as usize, table[r.position as usize / 4] as usize * 4 + r.position as usize % 4);
            }
        }
    }

    #[test]
    fn decodes_come_first_and_prompts_share_what_is_left() {
        let mut s = Scheduler::new(limits(), 32);
        s.add(1, vec![1, 2], PromptLogits::Last).unwrap();
        drive(&mut s, 1, 7);
        s.add(2, (0..30).collect(), PromptLogits::Last).unwrap();
        s.add(3, vec![5; 3], PromptLogits::Last).unwrap();
        let st = s.schedule().unwrap();
        // Sequence 1's decode row, then 8 prompt rows of sequence 2 (the cap);
        // sequence 3 waits for the next step.
        assert_eq!(st.seqs, vec![1, 2]);
        assert_eq!(st.rows.len(), 9);
        assert_eq!(st.prompt_rows, 8);
        s.complete(&st);
        assert_eq!(s.waiting(), 1);
    }

    #[test]
    fn a_shared_prefix_is_computed_once() {
        let mut s = Scheduler::new(limits(), 32);
        let prefix: Vec<u32> = (100..112).collect();
        s.add(1, [prefix.clone(), vec![1, 2]].concat(), PromptLogits::Last).unwrap();
        drive(&mut s, 3, 0);
        // Three full blocks of the first prompt are cached; the second prompt
        // takes them and computes only its own two tokens.
        s.add(2, [prefix, vec![3, 4]].concat(), PromptLogits::Last).unwrap();
        let st = s.schedule().unwrap();
        let rows: Vec<_> = st.rows.iter().filter(|r| st.seqs[r.seq as usize] == 2).collect();
        assert_eq!(rows.iter().map(|r| r.position).collect::<Vec<_>>(), vec![12, 13]);
        assert_eq!(s.pool.stats.hit_blocks, 3);
        assert_eq!(&st.tables[st.seqs.iter().position(|&x| x == 2).unwrap() * 8..][..3], &st.tables[st.seqs.iter().position(|&x| x == 1).unwrap() * 8..][..3]);
    }

    #[test]
    fn sequences_admitted_in_one_step_share_the_blocks_it_computes() {
        // Two choices of one prompt, queued together: the second takes the full
        // blocks the first computes in this very step and computes only the
        // last partial block itself.
        let mut s = Scheduler::new(limits(), 32);
        let prompt: Vec<u32> = (0..6).collect();
        s.add(1, prompt.clone(), PromptLogits::Last).unwrap();
        s.add(2, prompt, PromptLogits::Last).unwrap();
        let st = s.schedule().unwrap();
        let of = |id| st.rows.iter().filter(|r| st.seqs[r.seq as usize] == id).map(|r| r.position).collect::<Vec<_>>();
        assert_eq!(of(1), vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(of(2), vec![4, 5]);
        let table = |id| st.tables[st.seqs.iter().position(|&x| x == id).unwrap() * 8..][..2].to_vec();
        assert_eq!(table(1)[0], table(2)[0], "block 0 is shared");
        assert_ne!(table(1)[1], table(2)[1], "each holds its own last block");
        assert_eq!(s.cached_tokens(2), 4);
        assert_eq!(s.pool.refs(table(1)[0] as u32), 2);
    }

    #[test]
    fn a_sequence_that_scores_its_whole_prompt_takes_no_cached_prefix() {
        let mut s = Scheduler::new(limits(), 32);
        s.add(1, (0..9).collect(), PromptLogits::Last).unwrap();
        drive(&mut s, 2, 0);
        // Its blocks stay cached after it ends.
        s.remove(1);
        s.add(2, (0..9).collect(), PromptLogits::Every).unwrap();
        let st = s.schedule().unwrap();
        let mine: Vec<u32> = st.rows.iter().filter(|r| st.seqs[r.seq as usize] == 2).map(|r| r.position).collect();
        assert_eq!(mine, vec![0, 1, 2, 3], "from position 0, within the 4 logit rows");
        assert_eq!(s.cached_tokens(2), 0);
    }

    #[test]
    fn a_whole_cached_prompt_still_computes_its_last_token() {
        let mut s = Scheduler::new(limits(), 32);
        s.add(1, (0..8).collect(), PromptLogits::Last).unwrap();
        drive(&mut s, 1, 0);
        s.add(2, (0..8).collect(), PromptLogits::Last).unwrap();
        let st = s.schedule().unwrap();
        let mine: Vec<u32> = st.rows.iter().filter(|r| st.seqs[r.seq as usize] == 2).map(|r| r.position).collect();
        assert_eq!(mine, vec![4, 5, 6, 7], "block 0 is reused, block 1 holds the last token and is computed");
    }

    #[test]
    fn a_full_pool_preempts_the_newest_and_it_recomputes_later() {
        // Two blocks of 4: two sequences of 4-token prompts fill them; the first
        // decode row needs a third block, so the newest sequence is preempted.
        let mut s = Scheduler::new(limits(), 2);
        s.add(1, vec![1; 4], PromptLogits::Last).unwrap();
        s.add(2, vec![2; 4], PromptLogits::Last).unwrap();
        drive(&mut s, 1, 9);
        assert_eq!(s.running(), 2);
        let st = s.schedule().unwrap();
        assert_eq!(s.preemptions, 1);
        assert_eq!(st.seqs, vec![1], "sequence 1 decodes; sequence 2 went back to the queue");
        assert_eq!(s.waiting(), 1);
        s.complete(&st);
        // Once sequence 1 ends, sequence 2 runs again from its first token,
        // including the token it had generated.
        s.remove(1);
        let st = s.schedule().unwrap();
        assert_eq!(st.rows.iter().map(|r| r.token).collect::<Vec<_>>(), vec![2, 2, 2, 2, 9]);
        assert_eq!(st.outputs, vec![LogitRow { seq: 2, position: 4, next: true, verifies: false }]);
    }

    #[test]
    fn a_rollback_gives_back_the_blocks_past_what_it_keeps() {
        let mut s = Scheduler::new(limits(), 16);
        s.add(1, (0..6).collect(), PromptLogits::Last).unwrap();
        // The prompt (6 tokens, block 0 full and cached), then 7 more decoded
        // tokens: 13 positions in 4 blocks.
        drive(&mut s, 8, 50);
        assert_eq!((s.tokens(1).unwrap().len(), s.pool.used()), (14, 4));
        // Blocks 0-2 filled up and joined the prefix cache; block 3 holds
        // position 12. Back to 12 tokens: block 3 goes, and a token put in place
        // of the dropped ones runs at position 12.
        assert_eq!(s.rollback(1, 12), Ok(()));
        assert_eq!((s.tokens(1).unwrap().len(), s.pool.used()), (12, 3));
        s.append(1, 77);
        let st = s.schedule().unwrap();
        assert_eq!(st.rows.iter().map(|r| (r.position, r.token)).collect::<Vec<_>>(), vec![(12, 77)]);
        assert!(st.decode_only);
        s.complete(&st);
        // Cached blocks may be shared: a rollback into them is refused.
        assert_eq!(s.rollback(1, 11), Err(12));
    }

    /// Drafts after a decoding sequence's last token run as rows of one step,
    /// every one with logits that verify; accepting some keeps them as its
    /// tokens and forgets the rest (their blocks go back, their positions are
    /// computed again); drafted positions never enter the prefix cache, and a
    /// preemption recomputes only the tokens that stand.
    #[test]
    fn drafts_run_in_one_step_and_only_accepted_ones_stay() {
        let mut s = Scheduler::new(Limits { max_logit_rows: 8, ..limits() }, 16);
        s.add(1, (0..6).collect(), PromptLogits::Last).unwrap();
        drive(&mut s, 1, 50);
        // 7 tokens (position 6 to compute), 5 drafts: positions 6-11.
        assert_eq!(s.set_drafts(1, &[60, 61, 62, 63, 64]), 5);
        assert_eq!(s.set_drafts(1, &[9]), 0, "drafts already set");
        let st = s.schedule().unwrap();
        assert_eq!(st.rows.iter().map(|r| (r.position, r.token)).collect::<Vec<_>>(), vec![(6, 50), (7, 60), (8, 61), (9, 62), (10, 63), (11, 64)]);
        assert_eq!(st.outputs.iter().map(|o| (o.position, o.verifies, o.next)).collect::<Vec<_>>(), vec![(6, true, false), (7, true, false), (8, true, false), (9, true, false), (10, true, false), (11, true, true)]);
        assert!(!st.decode_only && st.prompt_rows == 0, "a verification step, not a prompt chunk");
        s.complete(&st);
        // Blocks 0 (positions 0-3) is cached; block 1 (4-7) holds the drafted
        // position 7 and stays out of the cache; block 2 (8-11) all drafts.
        assert_eq!(s.pool.used(), 3);
        // Two drafts stood: 60 61; the rest goes, and block 2 with them.
        s.accept(1, 2);
        assert_eq!(s.tokens(1).unwrap(), &[0, 1, 2, 3, 4, 5, 50, 60, 61]);
        assert!(s.drafts(1).is_empty());
        assert_eq!(s.pool.used(), 3, "position 8 (block 2) stands");
        s.append(1, 70);
        let st = s.schedule().unwrap();
        assert_eq!(st.rows.iter().map(|r| (r.position, r.token)).collect::<Vec<_>>(), vec![(9, 70)]);
        assert!(st.decode_only);
        s.complete(&st);
        // A sequence with the same tokens finds only the blocks of standing
        // tokens computed and full: blocks 0 and 1 (positions 0-7).
        s.add(2, vec![0, 1, 2, 3, 4, 5, 50, 60, 61, 70, 99], PromptLogits::Last).unwrap();
        let st = s.schedule().unwrap();
        assert_eq!(s.cached_tokens(2), 8, "{:?}", st.rows);
        // Drafts a step has no room for are dropped: with 4 logit rows, 3 of 6.
        let mut t = Scheduler::new(Limits { max_logit_rows: 4, ..limits() }, 16);
        t.add(1, vec![1, 2], PromptLogits::Last).unwrap();
        drive(&mut t, 1, 3);
        assert_eq!(t.set_drafts(1, &[4, 5, 6, 7, 8, 9]), 6);
        let st = t.schedule().unwrap();
        assert_eq!(st.rows.len(), 4, "the step's 4 logit rows");
        assert_eq!(t.drafts(1), &[4, 5, 6]);
    }

    #[test]
    fn removing_a_sequence_frees_its_blocks_at_once() {
        let mut s = Scheduler::new(limits(), 8);
        s.add(1, (0..10).collect(), PromptLogits::Last).unwrap();
        drive(&mut s, 2, 0);
        assert_eq!(s.pool.used(), 3);
        assert!(s.remove(1));
        assert_eq!(s.pool.used(), 0);
        assert!(!s.has_work());
        assert!(!s.remove(1));
    }

    #[test]
    fn impossible_sequences_are_refused() {
        let mut s = Scheduler::new(limits(), 2);
        assert_eq!(s.add(1, vec![], PromptLogits::Last), Err(AddError::Empty));
        assert!(matches!(s.add(1, vec![0; 33], PromptLogits::Last), Err(AddError::TooLong { blocks: 9, max: 8, .. })));
        assert!(matches!(s.add(1, vec![0; 9], PromptLogits::Last), Err(AddError::PoolTooSmall { blocks: 3, capacity: 2, .. })));
        s.add(1, vec![0; 3], PromptLogits::Last).unwrap();
        assert_eq!(s.add(1, vec![0; 3], PromptLogits::Last), Err(AddError::Duplicate(1)));
    }

    #[test]
    fn all_logits_sequences_get_every_row_within_the_logit_rows() {
        let mut s = Scheduler::new(limits(), 8);
        s.add(1, (0..6).collect(), PromptLogits::Computed).unwrap();
        let steps = drive(&mut s, 2, 0);
        // 4 logit rows per step at most: the 6 rows run as 4 + 2.
        assert_eq!(steps[0].outputs.iter().map(|o| (o.position, o.next)).collect::<Vec<_>>(), vec![(0, false), (1, false), (2, false), (3, false)]);
        assert_eq!(steps[1].outputs.iter().map(|o| (o.position, o.next)).collect::<Vec<_>>(), vec![(4, false), (5, true)]);
    }
}
