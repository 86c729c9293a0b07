//! The serial backend: one request at a time through the artifact's
//! single-stream plans (the prompt's last-token plan, then the decode plan), on
//! any [`SequenceExecutor`]. Requests queue first come first served.
//!
//! The runner's KV cache keeps the last request's tokens; a new request that
//! starts with the same tokens (a chat's earlier turns, a shared system prompt)
//! computes only what follows them.

use std::collections::VecDeque;

use super::{OutputRow, Request, RequestId, StepOutput};
use maxrun_runtime::executor::{RunError, SequenceExecutor};

struct Current {
    id: RequestId,
    /// The prompt until it has run, then empty.
    prompt: Vec<u32>,
    /// The sampled token to feed next.
    pending: Option<u32>,
    all_logits: bool,
    cached_tokens: usize,
}

pub struct Serial<'a> {
    runner: Box<dyn SequenceExecutor + 'a>,
    queue: VecDeque<(RequestId, Vec<u32>, bool)>,
    current: Option<Current>,
    /// The tokens whose keys and values the runner's cache holds, in order.
    cached: Vec<u32>,
}

/// How many leading tokens two sequences share.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl<'a> Serial<'a> {
    pub fn new(runner: Box<dyn SequenceExecutor + 'a>) -> Serial<'a> {
        Serial { runner, queue: VecDeque::new(), current: None, cached: Vec::new() }
    }

    pub fn runner(&mut self) -> &mut (dyn SequenceExecutor + 'a) {
        self.runner.as_mut()
    }

    pub fn threads(&self) -> usize {
        self.runner.threads()
    }

    pub fn describe(&self) -> String {
        self.runner.describe()
    }

    pub fn add(&mut self, id: RequestId, request: &Request) {
        self.queue.push_back((id, request.prompt.clone(), request.all_logits));
    }

    pub fn waiting(&self) -> usize {
        self.queue.len()
    }

    pub fn busy(&self) -> bool {
        self.current.is_some()
    }

    /// The token request `id` generated, to feed at its next step.
    pub fn append(&mut self, id: RequestId, token: u32) {
        if let Some(c) = self.current.as_mut().filter(|c| c.id == id) {
            c.pending = Some(token);
        }
    }

    /// Request `id` ended; its tokens stay cached for the next request.
    pub fn finish(&mut self, id: RequestId) {
        self.remove(id);
    }

    pub fn remove(&mut self, id: RequestId) {
        if self.current.as_ref().is_some_and(|c| c.id == id) {
            self.current = None;
        }
        self.queue.retain(|q| q.0 != id);
    }

    /// Runs the current request's next step: its prompt, or its last token. A
    /// failed step forgets the cache (the runner may have run part of it).
    pub fn step(&mut self) -> Result<StepOutput, RunError> {
        let result = self.try_step();
        if result.is_err() {
            self.runner.reset();
            self.cached.clear();
            self.current = None;
        }
        result
    }

    fn try_step(&mut self) -> Result<StepOutput, RunError> {
        if self.current.is_none() {
            let Some((id, prompt, all_logits)) = self.queue.pop_front() else { return Ok(StepOutput::default()) };
            self.current = Some(Current { id, prompt, pending: None, all_logits, cached_tokens: 0 });
        }
        let c = self.current.as_mut().expect("set above");
        let mut out = StepOutput::default();
        if !c.prompt.is_empty() {
            let prompt = std::mem::take(&mut c.prompt);
            // Reuse the cached prefix; at least one token must run to give logits,
            // and every position must run when all of their logits are wanted.
            let keep = if c.all_logits { 0 } else { common_prefix(&self.cached, &prompt).min(prompt.len() - 1) };
            self.runner.truncate(keep as u64);
            self.cached.truncate(keep);
            c.cached_tokens = keep;
            let feed = &prompt[keep..];
            if c.all_logits {
                out.logits = self.runner.forward(feed)?.to_vec();
                out.rows = (keep..prompt.len()).map(|p| OutputRow { id: c.id, position: p, next: p + 1 == prompt.len(), verifies: false, cached_tokens: keep }).collect();
            } else {
                out.logits = self.runner.forward_last(feed)?.to_vec();
                out.rows = vec![OutputRow { id: c.id, position: prompt.len() - 1, next: true, verifies: false, cached_tokens: keep }];
            }
            self.cached.extend_from_slice(feed);
            out.prompt_rows = feed.len();
        } else if let Some(t) = c.pending.take() {
            out.logits = self.runner.forward(&[t])?.to_vec();
            self.cached.push(t);
            out.rows = vec![OutputRow { id: c.id, position: self.cached.len() - 1, next: true, verifies: false, cached_tokens: c.cached_tokens }];
            out.decode_rows = 1;
        }
        Ok(out)
    }
}
