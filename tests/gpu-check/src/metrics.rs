//! Comparisons of logits and embeddings: the fixtures README's float32 tolerance,
//! top-1 agreement and mean KL divergence (the quantization budgets), greedy
//! prefixes, cosine similarity.

/// The fixtures README tolerance for one case: `1e-3 * max(1, max |reference|)`.
pub fn tolerance(reference: &[f32]) -> f32 {
    1e-3 * reference.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1.0)
}

/// The largest `|ours - reference|` (infinite where either holds a NaN or the
/// lengths differ, so that a broken run never passes).
pub fn max_error(ours: &[f32], reference: &[f32]) -> f32 {
    if ours.len() != reference.len() {
        return f32::INFINITY;
    }
    ours.iter().zip(reference).fold(0.0f32, |m, (a, b)| {
        let d = (a - b).abs();
        if d.is_nan() {
            f32::INFINITY
        } else {
            m.max(d)
        }
    })
}

fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let lse = row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln() + max;
    row.iter().map(|&x| x as f64 - lse).collect()
}

/// The first index of the largest value.
pub fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |m, (i, &v)| if v > m.1 { (i, v) } else { m }).0
}

/// Per-position agreement of two `[positions, vocab]` logit arrays.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Agreement {
    pub positions: usize,
    /// Positions whose argmax is the reference's.
    pub top1: usize,
    /// Flips where the reference's top-2 margin is at least four times the RMS
    /// logit error at that position: flips that no near tie explains. (The
    /// largest error cannot tell them apart: a flip needs the two logits' errors
    /// to cover the margin, so the largest is always at least half of it.)
    pub clear_flips: usize,
    /// Summed KL(reference || ours) over the positions.
    pub kl_sum: f64,
}

impl Agreement {
    pub fn add(&mut self, other: Agreement) {
        self.positions += other.positions;
        self.top1 += other.top1;
        self.clear_flips += other.clear_flips;
        self.kl_sum += other.kl_sum;
    }

    pub fn mean_kl(&self) -> f64 {
        self.kl_sum / self.positions.max(1) as f64
    }

    /// Top-1 agreement; with `near_ties_agree`, flips at near ties count as agreement.
    pub fn top1_rate(&self, near_ties_agree: bool) -> f64 {
        let agree = if near_ties_agree { self.positions - self.clear_flips } else { self.top1 };
        agree as f64 / self.positions.max(1) as f64
    }
}

/// Compares `ours` with `reference`, both `[positions, vocab]`.
pub fn agreement(ours: &[f32], reference: &[f32], vocab: usize) -> Agreement {
    let mut a = Agreement::default();
    if ours.len() != reference.len() || vocab == 0 {
        a.positions = reference.len() / vocab.max(1);
        a.clear_flips = a.positions;
        a.kl_sum = f64::INFINITY;
        return a;
    }
    for (o, r) in ours.chunks(vocab).zip(reference.chunks(vocab)) {
        a.positions += 1;
        if argmax(o) == argmax(r) {
            a.top1 += 1;
        } else {
            let mut sorted = r.to_vec();
            sorted.sort_by(|x, y| y.total_cmp(x));
            let rms = (o.iter().zip(r).map(|(x, y)| ((x - y) as f64).powi(2)).sum::<f64>() / vocab as f64).sqrt();
            a.clear_flips += !(((sorted[0] - sorted[1]) as f64) < 4.0 * rms) as usize;
        }
        let (lo, lr) = (log_softmax(o), log_softmax(r));
        let kl: f64 = lr.iter().zip(&lo).map(|(p, q)| p.exp() * (p - q)).sum();
        a.kl_sum += if kl.is_nan() { f64::INFINITY } else { kl };
    }
    a
}

/// How many leading ids agree.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Cosine similarity (0 for a zero or NaN vector).
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return 0.0;
    }
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let c = dot / (norm(a) * norm(b));
    if c.is_nan() {
        0.0
    } else {
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tolerance_follows_the_fixtures_readme() {
        assert_eq!(tolerance(&[0.5, -0.2]), 1e-3);
        assert!((tolerance(&[3.0, -20.0]) - 2e-2).abs() < 1e-7);
    }

    #[test]
    fn nan_and_missing_values_never_pass() {
        assert_eq!(max_error(&[1.0, f32::NAN], &[1.0, 2.0]), f32::INFINITY);
        assert_eq!(max_error(&[1.0], &[1.0, 2.0]), f32::INFINITY);
        assert_eq!(max_error(&[1.0, 2.5], &[1.0, 2.0]), 0.5);
        let a = agreement(&[f32::NAN, 0.0], &[1.0, 0.0], 2);
        assert!(a.mean_kl().is_infinite());
        assert_eq!(cosine(&[0.0, 0.0], &[1.0, 0.0]), 0.0);
    }

    #[test]
    fn flips_at_near_ties_are_told_apart_from_clear_ones() {
        // Two positions over a vocabulary of 64 (zeros but the top two).
        // Position 0: margin 0.01, one logit off by 0.03 (RMS 0.004): a near tie.
        // Position 1: margin 2.0, one logit off by 2.5 (RMS 0.31): a flip no tie explains.
        let vocab = 64;
        let mut reference = vec![0.0f32; 2 * vocab];
        let mut ours = vec![0.0f32; 2 * vocab];
        reference[..2].copy_from_slice(&[1.00, 0.99]);
        ours[..2].copy_from_slice(&[0.97, 0.99]);
        reference[vocab..vocab + 2].copy_from_slice(&[3.0, 1.0]);
        ours[vocab..vocab + 2].copy_from_slice(&[3.0, 3.5]);
        let a = agreement(&ours, &reference, vocab);
        assert_eq!((a.positions, a.top1, a.clear_flips), (2, 0, 1));
        assert_eq!(a.top1_rate(true), 0.5);
        assert_eq!(a.top1_rate(false), 0.0);
        assert!(a.mean_kl() > 0.0);
        let same = agreement(&reference, &reference, vocab);
        assert_eq!((same.top1, same.clear_flips), (2, 0));
        assert!(same.mean_kl().abs() < 1e-12);
    }

    #[test]
    fn prefixes_and_cosines() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert!((cosine(&[1.0, 0.0], &[1.0, 1.0]) - 0.5f64.sqrt()).abs() < 1e-12);
    }
}
