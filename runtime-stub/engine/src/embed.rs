//! The embedder: a sentence encoder's inputs in, one embedding per input out,
//! over any [`EncodeExecutor`] (`/v1/embeddings`, `maxrun --embed-file`).
//!
//! [`Embedder::embed_all`] checks every input first (an empty, too long or
//! out-of-vocabulary input fails the call, naming its index, before any work),
//! then packs the inputs into as few steps as the executor's limits allow
//! (inputs and rows per step; longest first, each into the first step with room:
//! first-fit decreasing) and returns the embeddings in input order. An input is
//! never split over steps: its attention sees all of it.

use maxrun_runtime::executor::{EncodeExecutor, EncodeLimits, EncodeStep, ProfileRow, RunError};

/// Why inputs cannot be embedded.
#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    #[error("input {index} is empty: an embedding needs at least one token")]
    EmptyInput { index: usize },
    #[error("input {index} has {tokens} tokens, more than the artifact's maximum length of {max} tokens; shorten it, or recompile with a longer max_length")]
    TooLong { index: usize, tokens: usize, max: u64 },
    #[error("input {index}: token id {id} is outside the vocabulary of {vocab} tokens")]
    BadToken { index: usize, id: u32, vocab: u64 },
    #[error("a step of {sequences} inputs and {rows} rows exceeds the executor's {max_sequences} inputs and {max_rows} rows per step; use embed_all, which splits inputs into steps")]
    StepTooLarge { sequences: usize, rows: usize, max_sequences: usize, max_rows: usize },
    #[error(transparent)]
    Run(#[from] RunError),
}

impl EmbedError {
    /// The request's fault (its inputs), not the model's.
    pub fn is_bad_input(&self) -> bool {
        matches!(self, EmbedError::EmptyInput { .. } | EmbedError::TooLong { .. } | EmbedError::BadToken { .. })
    }
}

/// What the embedder needs to know of the encoder it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EncoderFacts {
    pub vocab_size: u64,
    /// The longest input.
    pub max_length: u64,
    /// Floats per embedding.
    pub width: usize,
}

impl EncoderFacts {
    /// The facts an encoder artifact records (`None`: not an encoder).
    pub fn of(artifact: &maxrun_runtime::artifact::Artifact) -> Option<EncoderFacts> {
        let h = &artifact.header;
        h.model.embedding_width.map(|w| EncoderFacts { vocab_size: h.model.vocab_size, max_length: h.max_length, width: w as usize })
    }
}

/// Embeds inputs in steps of an [`EncodeExecutor`].
pub struct Embedder<'a> {
    executor: Box<dyn EncodeExecutor + 'a>,
    facts: EncoderFacts,
    tokens: Vec<i32>,
    positions: Vec<i32>,
    row_sequences: Vec<i32>,
    starts: Vec<i32>,
    /// Steps run so far.
    steps: u64,
}

impl std::fmt::Debug for Embedder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedder").field("limits", &self.executor.limits()).field("steps", &self.steps).finish()
    }
}

impl<'a> Embedder<'a> {
    pub fn new(executor: Box<dyn EncodeExecutor + 'a>, facts: EncoderFacts) -> Embedder<'a> {
        Embedder { executor, facts, tokens: Vec::new(), positions: Vec::new(), row_sequences: Vec::new(), starts: Vec::new(), steps: 0 }
    }

    pub fn limits(&self) -> EncodeLimits {
        self.executor.limits()
    }

    /// Steps run so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    pub fn threads(&self) -> usize {
        self.executor.threads()
    }

    pub fn describe(&self) -> String {
        self.executor.describe()
    }

    pub fn enable_profile(&mut self) {
        self.executor.enable_profile();
    }

    pub fn profile(&self) -> Vec<ProfileRow> {
        self.executor.profile()
    }

    /// Refuses input `index` (its number in the caller's list) if it is empty,
    /// longer than the maximum length, or names a token outside the vocabulary.
    fn check_input(&self, index: usize, ids: &[u32]) -> Result<(), EmbedError> {
        let f = &self.facts;
        if ids.is_empty() {
            return Err(EmbedError::EmptyInput { index });
        }
        if ids.len() as u64 > f.max_length {
            return Err(EmbedError::TooLong { index, tokens: ids.len(), max: f.max_length });
        }
        if let Some(&id) = ids.iter().find(|&&id| id as u64 >= f.vocab_size) {
            return Err(EmbedError::BadToken { index, id, vocab: f.vocab_size });
        }
        Ok(())
    }

    /// One step over `sequences` (within [`Self::limits`]): their embeddings,
    /// `[sequences.len(), width]`.
    pub fn step(&mut self, sequences: &[&[u32]]) -> Result<&[f32], EmbedError> {
        for (index, ids) in sequences.iter().enumerate() {
            self.check_input(index, ids)?;
        }
        let rows: usize = sequences.iter().map(|s| s.len()).sum();
        let limits = self.executor.limits();
        if sequences.len() > limits.max_sequences || rows > limits.max_rows {
            return Err(EmbedError::StepTooLarge { sequences: sequences.len(), rows, max_sequences: limits.max_sequences, max_rows: limits.max_rows });
        }
        if sequences.is_empty() {
            return Ok(&[]);
        }
        self.tokens.clear();
        self.positions.clear();
        self.row_sequences.clear();
        self.starts.clear();
        self.starts.push(0);
        for (s, ids) in sequences.iter().enumerate() {
            self.tokens.extend(ids.iter().map(|&id| id as i32));
            self.positions.extend(0..ids.len() as i32);
            self.row_sequences.extend(std::iter::repeat_n(s as i32, ids.len()));
            self.starts.push(self.tokens.len() as i32);
        }
        let step = EncodeStep { tokens: &self.tokens, positions: &self.positions, row_sequences: &self.row_sequences, sequence_starts: &self.starts };
        let out = self.executor.step(&step)?;
        self.steps += 1;
        debug_assert_eq!(out.len(), sequences.len() * self.facts.width, "one embedding per input");
        Ok(out)
    }

    /// The embeddings of `inputs`, in order, in as few steps as the limits
    /// allow: every input is checked first, then packed longest first, each
    /// into the first step with room for it.
    pub fn embed_all(&mut self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, EmbedError> {
        for (index, ids) in inputs.iter().enumerate() {
            self.check_input(index, ids)?;
        }
        let limits = self.executor.limits();
        let mut out = vec![Vec::new(); inputs.len()];
        let width = self.facts.width;
        for step in pack(inputs.iter().map(Vec::len), limits.max_sequences, limits.max_rows) {
            let sequences: Vec<&[u32]> = step.iter().map(|&i| inputs[i].as_slice()).collect();
            let embeddings = self.step(&sequences)?;
            for (&i, e) in step.iter().zip(embeddings.chunks_exact(width)) {
                out[i] = e.to_vec();
            }
        }
        Ok(out)
    }
}

/// Inputs of lengths `lens` (each at most `max_rows`) in steps of at most
/// `max_sequences` inputs and `max_rows` rows: longest first (ties in input
/// order), each into the first step with room (first-fit decreasing). Each
/// step lists its inputs' indices in input order.
pub fn pack(lens: impl Iterator<Item = usize>, max_sequences: usize, max_rows: usize) -> Vec<Vec<usize>> {
    let lens: Vec<usize> = lens.collect();
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lens[i]));
    let mut steps: Vec<(usize, Vec<usize>)> = Vec::new();
    for i in order {
        match steps.iter_mut().find(|(rows, members)| members.len() < max_sequences && rows + lens[i] <= max_rows) {
            Some((rows, members)) => {
                *rows += lens[i];
                members.push(i);
            }
            None => steps.push((lens[i], vec![i])),
        }
    }
    steps
        .into_iter()
        .map(|(_, mut members)| {
            members.sort_unstable();
            members
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every input in exactly one step, no step over either limit, and the
    /// fewest steps where the sequences are the limit (64 short inputs, 16 per
    /// step: 4) or the rows are (first-fit decreasing fills steps of 100 rows
    /// with 60 + 40 and 50 + 30 + 20, where filling them in input order takes 3).
    #[test]
    fn packing_keeps_the_limits_and_takes_few_steps() {
        let check = |lens: &[usize], max_sequences: usize, max_rows: usize, want_steps: usize| {
            let steps = pack(lens.iter().copied(), max_sequences, max_rows);
            let mut seen: Vec<usize> = steps.iter().flatten().copied().collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..lens.len()).collect::<Vec<_>>(), "every input once");
            for s in &steps {
                assert!(s.len() <= max_sequences && s.iter().map(|&i| lens[i]).sum::<usize>() <= max_rows, "{s:?}");
                assert!(s.windows(2).all(|w| w[0] < w[1]), "input order within a step");
            }
            assert_eq!(steps.len(), want_steps, "{lens:?}: {steps:?}");
        };
        let short: Vec<usize> = (0..64).map(|i| 5 + i % 13).collect();
        check(&short, 16, 2048, 4);
        check(&short, 32, 2048, 2);
        check(&[60, 30, 50, 20, 40], 8, 100, 2);
        check(&[100, 100, 1], 8, 100, 3);
        check(&[], 4, 10, 0);
    }

    /// A fake encoder whose embedding of an input is (its length, the sum of
    /// its tokens, its first position, the step's input count): an embedder
    /// that mixed up rows, reordered inputs or split one over steps gives
    /// another vector.
    struct Fake {
        limits: EncodeLimits,
        out: Vec<f32>,
    }

    impl EncodeExecutor for Fake {
        fn limits(&self) -> EncodeLimits {
            self.limits
        }

        fn step(&mut self, step: &EncodeStep<'_>) -> Result<&[f32], RunError> {
            assert!(step.rows() <= self.limits.max_rows && step.sequences() <= self.limits.max_sequences);
            self.out.clear();
            for s in 0..step.sequences() {
                let r = step.sequence(s);
                assert!(r.clone().all(|row| step.row_sequences[row] == s as i32), "rows know their input");
                let sum: i32 = step.tokens[r.clone()].iter().sum();
                self.out.extend([r.len() as f32, sum as f32, step.positions[r.start] as f32, step.sequences() as f32]);
            }
            Ok(&self.out)
        }

        fn threads(&self) -> usize {
            1
        }

        fn describe(&self) -> String {
            "fake".into()
        }
    }

    /// Through a fake executor: each input's vector comes back in input order
    /// with its own length and token sum, every input starting at position 0,
    /// in the steps the limits imply; bad inputs are refused before any step.
    #[test]
    fn embeddings_come_back_in_input_order_in_few_steps() {
        let facts = EncoderFacts { vocab_size: 1000, max_length: 50, width: 4 };
        let mut e = Embedder::new(Box::new(Fake { limits: EncodeLimits { max_rows: 100, max_sequences: 8 }, out: Vec::new() }), facts);
        let inputs: Vec<Vec<u32>> = (0..20u32).map(|i| (0..1 + i * 7 % 50).map(|t| t + i).collect()).collect();
        let out = e.embed_all(&inputs).unwrap();
        for (i, (v, ids)) in out.iter().zip(&inputs).enumerate() {
            assert_eq!((v[0], v[1], v[2]), (ids.len() as f32, ids.iter().sum::<u32>() as f32, 0.0), "input {i}");
        }
        let rows: usize = inputs.iter().map(Vec::len).sum();
        assert!(e.steps() >= rows.div_ceil(100) as u64 && e.steps() <= rows.div_ceil(100) as u64 + 1, "{} steps for {rows} rows", e.steps());
        let before = e.steps();
        for (bad, what) in [(vec![vec![1], vec![]], "input 1 is empty"), (vec![vec![1; 51]], "51 tokens"), (vec![vec![5, 1000]], "token id 1000")] {
            let err = e.embed_all(&bad).unwrap_err();
            assert!(err.is_bad_input() && err.to_string().contains(what), "{err}");
        }
        assert_eq!(e.steps(), before, "nothing ran for bad inputs");
        let nine: Vec<&[u32]> = vec![&[1, 2]; 9];
        assert!(matches!(e.step(&nine), Err(EmbedError::StepTooLarge { sequences: 9, max_sequences: 8, .. })));
    }
}
