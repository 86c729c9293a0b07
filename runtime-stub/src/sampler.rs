//! Token sampling: greedy, or temperature with top-k, top-p (nucleus) and min-p filters.

/// Sampling settings.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k filter.
    pub top_k: u32,
    /// 1 means no nucleus filter.
    pub top_p: f32,
    /// 0 means no min-p filter.
    pub min_p: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0 }
    }
}

/// SplitMix64: small, seedable, and identical on every platform.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// The index of the largest logit (the first one on ties, as `argmax` does).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Picks the next token from one row of logits.
pub fn sample(logits: &[f32], p: &SamplingParams, rng: &mut Rng) -> u32 {
    if p.temperature <= 0.0 {
        return argmax(logits);
    }
    let mut cand: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l / p.temperature)).collect();
    cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 {
        cand.truncate(p.top_k as usize);
    }
    let max = cand[0].1;
    let mut probs: Vec<f32> = cand.iter().map(|c| (c.1 - max).exp()).collect();
    let total: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= total);
    // Nucleus: the smallest prefix whose mass reaches top_p.
    let mut keep = probs.len();
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        for (i, &x) in probs.iter().enumerate() {
            acc += x;
            if acc >= p.top_p {
                keep = i + 1;
                break;
            }
        }
    }
    // Min-p: drop tokens below min_p times the most likely one.
    if p.min_p > 0.0 {
        let floor = p.min_p * probs[0];
        keep = keep.min(probs.iter().take_while(|&&x| x >= floor).count().max(1));
    }
    let kept = &probs[..keep];
    let mass: f32 = kept.iter().sum();
    let mut r = rng.next_f32() * mass;
    for (i, &x) in kept.iter().enumerate() {
        if r < x {
            return cand[i].0;
        }
        r -= x;
    }
    cand[keep - 1].0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(sample(&[1.0, 3.0, 3.0, 2.0], &SamplingParams::default(), &mut Rng::new(0)), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_seeds_reproduce() {
        let logits = [0.5, 2.0, 1.0, 1.9];
        let p = SamplingParams { temperature: 1.0, top_k: 1, ..Default::default() };
        assert_eq!(sample(&logits, &p, &mut Rng::new(9)), 1);
        let p = SamplingParams { temperature: 1.0, ..Default::default() };
        let a: Vec<u32> = { let mut r = Rng::new(5); (0..50).map(|_| sample(&logits, &p, &mut r)).collect() };
        let b: Vec<u32> = { let mut r = Rng::new(5); (0..50).map(|_| sample(&logits, &p, &mut r)).collect() };
        assert_eq!(a, b);
        assert!(a.contains(&3) && a.contains(&1), "sampling explores likely tokens: {a:?}");
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        // Probabilities ~ [0.64, 0.24, 0.09, 0.03].
        let logits = [3.0, 2.0, 1.0, 0.0];
        let mut r = Rng::new(1);
        let p = SamplingParams { temperature: 1.0, top_p: 0.6, ..Default::default() };
        assert!((0..200).all(|_| sample(&logits, &p, &mut r) == 0));
        let p = SamplingParams { temperature: 1.0, min_p: 0.3, ..Default::default() };
        assert!((0..200).all(|_| sample(&logits, &p, &mut r) <= 1));
    }
}
