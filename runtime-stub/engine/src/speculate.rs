//! Speculative decoding: guesses of a sequence's next tokens (drafts), checked
//! in one step of the target model, so that a step can give more than one
//! token per pass over the weights.
//!
//! A proposer drafts up to `k` tokens after a sequence's last token; the
//! batched engine runs that token and the drafts as rows of one step, every
//! row with logits, and samples from each row in order exactly as plain
//! decoding would (the same penalties, grammar mask and random draws): a draft
//! stands while it equals the token sampled before it, the first token that
//! differs replaces it, and a step whose drafts all stand gives one token more
//! from its last row. Since a CPU artifact gives a row the same logits in
//! every plan (docs/serving.md, Batch invariance), the output is the one plain
//! decoding gives, token for token, greedy or sampled with a seed. For a
//! sampled request this is the rejection scheme of Leviathan et al. and Chen
//! et al. with a proposal that puts all its mass on the draft: the draft
//! stands with probability p(draft), and otherwise the token comes from p
//! without it, renormalized.
//!
//! Proposers:
//! - [`NGramIndex`], prompt lookup (vLLM's `ngram`, llama.cpp's lookup
//!   decoding): the longest suffix of the sequence (`max_n` down to `min_n`
//!   tokens) that occurred earlier in its prompt or output proposes the
//!   tokens that followed that occurrence. No second model; an index of the
//!   sequence's n-grams.
//! - Further proposers (a draft model, EAGLE-3 heads or MTP layers a checkpoint
//!   carries) implement [`Proposer`]: they see the sequence's tokens and
//!   return their drafts; a model-based one keeps its own KV cache and rolls
//!   it back to what [`Proposer::verified`] says stood.
//!
//! How many to draft ([`DraftLength`]): a per-sequence acceptance estimate
//! and the cost of a verification row relative to a decode step choose the `k`
//! that maximizes the expected tokens per unit of step time; below a small
//! gain it drafts nothing, and a step's drafted rows are capped so that a
//! batch that is already compute-bound is not made slower.

use std::collections::HashMap;

/// What a request's speculation uses.
#[derive(Clone, Debug, PartialEq)]
pub struct SpeculationConfig {
    /// The most tokens drafted per step for one sequence.
    pub max_drafts: usize,
    /// n-gram lengths the prompt-lookup proposer matches, longest first.
    pub min_n: usize,
    pub max_n: usize,
    /// A verification row's cost relative to a whole decode step of one
    /// sequence (the weights are read once per step whatever its rows): what
    /// [`DraftLength`] weighs the expected gain against. With `n` sequences
    /// decoding, a row costs `n` times as much of each one's share of the step.
    pub row_cost: f64,
    /// Drafted rows per step, all sequences together, at most: past it a step
    /// is bound by arithmetic rather than by reading the weights, and drafts
    /// cost about what they save.
    pub max_step_drafts: usize,
    /// Keeps every draft without checking it against the target's sample: a
    /// deliberately wrong scheme, for the tests that show the distribution
    /// test can fail (tests/tests/speculation.rs). Never set otherwise.
    #[doc(hidden)]
    pub accept_unchecked: bool,
}

impl Default for SpeculationConfig {
    fn default() -> Self {
        SpeculationConfig { max_drafts: 4, min_n: 2, max_n: 5, row_cost: 0.08, max_step_drafts: 24, accept_unchecked: false }
    }
}

impl SpeculationConfig {
    /// Refuses settings that cannot work, naming the flag.
    pub fn check(&self) -> Result<(), String> {
        if !(1..=MAX_DRAFTS).contains(&self.max_drafts) {
            return Err(format!("--draft-tokens {}: drafts per step must be 1 to {MAX_DRAFTS}", self.max_drafts));
        }
        if self.min_n == 0 || self.min_n > self.max_n || self.max_n > 16 {
            return Err(format!("--ngram {}..{}: n-gram lengths must satisfy 1 <= min <= max <= 16", self.min_n, self.max_n));
        }
        Ok(())
    }
}

/// The most drafts per sequence and step a request may ask for.
pub const MAX_DRAFTS: usize = 15;

/// A source of drafts for one sequence.
pub trait Proposer {
    /// Up to `max` drafts after `tokens` (the sequence: prompt and generated
    /// tokens), appended to `out`.
    fn propose(&mut self, tokens: &[u32], max: usize, out: &mut Vec<u32>);

    /// The sequence's tokens now stand up to `len` (drafts past it were
    /// rejected): a proposer with state of its own rolls it back.
    fn verified(&mut self, _len: usize) {}
}

/// Prompt lookup over one sequence: its n-grams of `min_n..=max_n` tokens, each
/// with the end of its latest occurrence. The n-grams ending at the sequence's
/// last token are not indexed until a token follows them, so that a lookup of
/// the suffix finds an earlier occurrence with a continuation.
#[derive(Debug)]
pub struct NGramIndex {
    min_n: usize,
    max_n: usize,
    /// (n, hash of the n tokens) -> the position of the n-gram's last token.
    latest: HashMap<(usize, u64), usize>,
    /// Positions whose n-grams are indexed: those ending before `indexed`.
    indexed: usize,
}

impl NGramIndex {
    pub fn new(min_n: usize, max_n: usize) -> NGramIndex {
        NGramIndex { min_n, max_n, latest: HashMap::new(), indexed: 0 }
    }

    fn hash(tokens: &[u32]) -> u64 {
        // FNV-1a over the tokens' bytes: cheap, and a collision only costs a
        // comparison (every hit is checked token by token).
        tokens.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| t.to_le_bytes().iter().fold(h, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)))
    }

    /// Indexes the n-grams that end before the last token of `tokens`.
    fn catch_up(&mut self, tokens: &[u32]) {
        let upto = tokens.len().saturating_sub(1);
        if upto < self.indexed {
            // The sequence got shorter (drafts rolled back past what was indexed
            // cannot happen, since only standing tokens are indexed; a caller
            // that reuses the index for another sequence starts over).
            self.latest.clear();
            self.indexed = 0;
        }
        for end in self.indexed..upto {
            for n in self.min_n..=self.max_n.min(end + 1) {
                self.latest.insert((n, Self::hash(&tokens[end + 1 - n..=end])), end);
            }
        }
        self.indexed = upto;
    }
}

impl Proposer for NGramIndex {
    fn propose(&mut self, tokens: &[u32], max: usize, out: &mut Vec<u32>) {
        self.catch_up(tokens);
        let len = tokens.len();
        for n in (self.min_n..=self.max_n.min(len)).rev() {
            let suffix = &tokens[len - n..];
            let Some(&end) = self.latest.get(&(n, Self::hash(suffix))) else { continue };
            if &tokens[end + 1 - n..=end] != suffix {
                continue;
            }
            out.extend(tokens[end + 1..].iter().take(max));
            return;
        }
    }
}

/// How many tokens to draft for one sequence, from how many of its drafts stood.
#[derive(Clone, Debug)]
pub struct DraftLength {
    /// The estimated chance that a draft stands given the one before it did
    /// (an exponential average over verified drafts).
    pub acceptance: f64,
    /// Drafts verified and drafts that stood, in all, and the verifications.
    pub drafted: u64,
    pub accepted: u64,
    pub verifications: u64,
    /// Steps since it last drafted (see [`DraftLength::next`]).
    idle: u32,
}

impl Default for DraftLength {
    fn default() -> Self {
        // Optimistic at first, so that a sequence tries drafts before its
        // estimate can say whether they pay.
        DraftLength { acceptance: 0.6, drafted: 0, accepted: 0, verifications: 0, idle: 0 }
    }
}

/// A sequence whose estimate says drafts do not pay still drafts one token
/// this often (in its steps), so that the estimate follows its text.
const PROBE_EVERY: u32 = 32;

/// Weight of the latest verification in the acceptance estimate.
const ACCEPTANCE_WEIGHT: f64 = 0.3;

/// The least expected gain (tokens per unit of step time over plain
/// decoding's 1) worth drafting for.
const MIN_GAIN: f64 = 1.03;

impl DraftLength {
    /// The number of drafts (0 to `max`) that maximizes the expected tokens per
    /// step time, `E(k) / (1 + cost * k)` with `E(k) = 1 + a + ... + a^k` and
    /// `cost` a draft's cost relative to the sequence's share of a decode step;
    /// 0 where even the best gains less than [`MIN_GAIN`].
    pub fn choose(&self, max: usize, cost: f64) -> usize {
        let a = self.acceptance.clamp(0.0, 0.99);
        let (mut best, mut best_gain, mut expected, mut term) = (0, 1.0, 1.0, 1.0);
        for k in 1..=max {
            term *= a;
            expected += term;
            let gain = expected / (1.0 + cost * k as f64);
            if gain > best_gain {
                (best, best_gain) = (k, gain);
            }
        }
        if best_gain < MIN_GAIN {
            0
        } else {
            best
        }
    }

    /// How many to draft this step: [`DraftLength::choose`], except that a
    /// sequence never verified, or one that has not drafted for
    /// [`PROBE_EVERY`] steps, drafts one token to measure its acceptance.
    pub fn next(&mut self, max: usize, cost: f64) -> usize {
        let k = self.choose(max, cost);
        if k > 0 || max == 0 {
            self.idle = 0;
            return k;
        }
        self.idle += 1;
        if self.verifications == 0 || self.idle >= PROBE_EVERY {
            self.idle = 0;
            return 1;
        }
        0
    }

    /// Records a verification of `drafted` drafts of which the first `accepted` stood.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        self.verifications += 1;
        // Each draft up to the first rejected one was a trial of whether a
        // draft stands given the one before it did.
        let trials = (accepted + 1).min(drafted);
        let rate = accepted as f64 / trials as f64;
        let w = 1.0 - (1.0 - ACCEPTANCE_WEIGHT).powi(trials as i32);
        self.acceptance += w * (rate - self.acceptance);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The longest earlier n-gram wins, its latest occurrence proposes what
    /// followed it, up to `max`; no match, no drafts; the suffix itself (not
    /// yet followed by anything) is never its own match.
    #[test]
    fn the_longest_earlier_suffix_proposes_what_followed_it() {
        let mut ix = NGramIndex::new(2, 4);
        let mut out = Vec::new();
        // ... 7 8 9 [1 2] ... 1 2 3 4 ... then the sequence ends with 1 2.
        let seq = [5, 1, 2, 9, 9, 1, 2, 3, 4, 6, 0, 1, 2];
        ix.propose(&seq, 3, &mut out);
        assert_eq!(out, vec![3, 4, 6], "the latest `1 2` (positions 5-6) proposes 3 4 6");
        // A longer suffix that matches earlier wins over a later short one.
        let mut ix = NGramIndex::new(2, 4);
        out.clear();
        let seq = [7, 1, 2, 3, 40, 41, 2, 3, 50, 1, 2, 3];
        ix.propose(&seq, 2, &mut out);
        assert_eq!(out, vec![40, 41], "`1 2 3` at 1-3 beats the later `2 3` at 6-7");
        out.clear();
        let mut ix = NGramIndex::new(2, 4);
        ix.propose(&[1, 2, 3, 4, 5], 4, &mut out);
        assert!(out.is_empty(), "no earlier n-gram: {out:?}");
        // Incremental: the index catches up with appended tokens.
        let mut ix = NGramIndex::new(2, 3);
        let mut seq = vec![10, 11, 12, 13];
        ix.propose(&seq, 2, &mut out);
        assert!(out.is_empty());
        seq.extend([10, 11]);
        ix.propose(&seq, 2, &mut out);
        assert_eq!(out, vec![12, 13]);
    }

    /// k grows with the acceptance estimate and falls to 0 where drafting
    /// cannot pay; the estimate follows what stood.
    #[test]
    fn the_draft_length_follows_the_acceptance() {
        let at = |a: f64| DraftLength { acceptance: a, ..DraftLength::default() }.choose(8, 0.08);
        assert_eq!(at(0.0), 0);
        assert_eq!(at(0.05), 0);
        assert!(at(0.5) >= 1 && at(0.5) <= 3, "{}", at(0.5));
        assert!(at(0.95) >= 6, "{}", at(0.95));
        assert!(at(0.3) <= at(0.6) && at(0.6) <= at(0.9));
        let mut d = DraftLength::default();
        for _ in 0..20 {
            d.record(4, 0);
        }
        assert!(d.acceptance < 0.05 && d.choose(4, 0.08) == 0, "{d:?}");
        for _ in 0..20 {
            d.record(4, 4);
        }
        assert!(d.acceptance > 0.9 && d.choose(4, 0.08) == 4, "{d:?}");
        assert_eq!((d.drafted, d.accepted), (160, 80));
    }

    /// With eight sequences sharing a step a draft's row costs eight times
    /// its share: a sequence whose drafts stand 3 times in 4 drafts one token
    /// rather than three, one whose drafts stand half the time none; a
    /// sequence that stopped drafting tries one token every PROBE_EVERY steps,
    /// and a new one tries at once.
    #[test]
    fn drafts_shrink_as_sequences_share_a_step_and_idle_ones_probe() {
        let at = |a: f64, cost: f64| DraftLength { acceptance: a, ..DraftLength::default() }.choose(4, cost);
        assert_eq!(at(0.75, 0.08), 4);
        assert_eq!(at(0.75, 0.08 * 8.0), 1);
        assert_eq!(at(0.5, 0.08 * 8.0), 0);
        let mut d = DraftLength::default();
        assert_eq!(d.next(4, 0.64), 1, "never verified: it tries one");
        d.record(1, 0);
        let ks: Vec<usize> = (0..2 * PROBE_EVERY).map(|_| d.next(4, 0.64)).collect();
        assert_eq!(ks.iter().filter(|&&k| k == 1).count(), 2, "{ks:?}");
        assert_eq!(ks[PROBE_EVERY as usize - 1], 1);
        assert!(ks.iter().all(|&k| k <= 1));
    }
}
