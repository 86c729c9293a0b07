//! Token sampling: greedy, or temperature with top-k, top-p (nucleus) and min-p
//! filters, in time linear in the vocabulary: the weights are vector code, and
//! only top-k and top-p order tokens, each only among the few that can pass it
//! (`candidates` says how). A seed gives the same draws on every machine.

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

/// Defines a function whose body is compiled twice: with AVX2, taken at run
/// time where the machine has it, and for baseline x86-64 (SSE2) elsewhere. The
/// same operations either way (Rust never fuses a multiply and an add), so the
/// same results and the same draws on every machine.
macro_rules! avx2_where_present {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? $body:block) => {
        $(#[$doc])*
        fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn each($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                fn avx2($($arg: $ty),*) $(-> $ret)? {
                    each($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the machine has AVX2, checked just above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            each($($arg),*)
        }
    };
}

/// The index of the largest logit (the first one on ties, as `argmax` does;
/// NaNs are never the largest, and a row of NaNs gives 0).
pub fn argmax(logits: &[f32]) -> u32 {
    let best = max(logits);
    // The first block of 64 that holds it (a vector compare each), then its place there.
    let block = logits.chunks(64).position(|c| c.iter().fold(false, |hit, &l| hit | (l == best))).unwrap_or(0);
    (block * 64 + logits[block * 64..].iter().position(|&l| l == best).unwrap_or(0)) as u32
}

/// `e^x` for `x <= 0` (`-inf` included), within 2 ulp of the exact value, and 0
/// below -87 (where it leaves the normal floats): Cephes' `expf` in plain
/// arithmetic that compiles to vector code, where libm's `expf` is a call per
/// element (a 49k vocabulary's weights took ~0.5 ms a token with it).
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let xc = x.max(-87.0);
    // e^x = 2^n e^r with n = round(x / ln 2), |r| <= ln 2 / 2; ln 2 in two parts
    // so that n * ln 2 is exact to f32.
    let shifted = xc * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = xc - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let mut poly = 1.987_569_1e-4;
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
        poly = poly * r + c;
    }
    let er = poly * r * r + r + 1.0;
    // n is also the low bits of `shifted` (an integer cast would saturate lane by lane).
    let n_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits());
    let two_n = f32::from_bits(n_bits.wrapping_add(127) << 23);
    if x < -87.0 {
        0.0
    } else {
        er * two_n
    }
}

/// A sum in eight interleaved parts (vector code; a plain fold is one long
/// chain of dependent additions).
fn sum(values: &[f32]) -> f32 {
    let mut parts = [0.0f32; 8];
    let chunks = values.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for chunk in chunks {
        for (p, &v) in parts.iter_mut().zip(chunk) {
            *p += v;
        }
    }
    parts.iter().sum::<f32>() + tail
}

avx2_where_present! {
    /// The largest value, NaNs ignored (-inf for none), in eight interleaved parts.
    fn max(values: &[f32]) -> f32 {
        let mut parts = [f32::NEG_INFINITY; 8];
        let chunks = values.chunks_exact(8);
        let tail = chunks.remainder().iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for chunk in chunks {
            for (p, &v) in parts.iter_mut().zip(chunk) {
                *p = p.max(v);
            }
        }
        parts.iter().copied().fold(tail, f32::max)
    }
}

/// The total weight of the tokens weighing at least `floor`, in eight
/// interleaved parts.
fn mass_from(weights: &[f32], floor: f32) -> f32 {
    let mut parts = [0.0f32; 8];
    let chunks = weights.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().filter(|&&w| w >= floor).sum();
    for chunk in chunks {
        for (p, &w) in parts.iter_mut().zip(chunk) {
            *p += if w >= floor { w } else { 0.0 };
        }
    }
    parts.iter().sum::<f32>() + tail
}

avx2_where_present! {
    /// `weights[i] = exp(logits[i] / t - top)`.
    fn scaled_weights(logits: &[f32], t: f32, top: f32, weights: &mut [f32]) {
        for (w, &l) in weights.iter_mut().zip(logits) {
            *w = exp_nonpositive(l / t - top);
        }
    }
}

/// Candidates in descending order of likelihood, ties to the lower token id.
fn more_likely(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// The tokens sampling may pick from, in token id order, each with its weight
/// `exp((logit - max) / temperature)` (1 for the most likely).
#[derive(Clone, Debug, PartialEq)]
pub struct Candidates {
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
}

/// The id of candidate `i`: `ids[i]`, or `i` itself while the candidates are
/// every token (`ids` is `None`).
fn id_at(ids: &Option<Vec<u32>>, i: usize) -> u32 {
    ids.as_ref().map_or(i as u32, |ids| ids[i])
}

/// Candidates in token id order, split into ids and weights.
fn by_id(mut pairs: Vec<(u32, f32)>) -> (Vec<u32>, Vec<f32>) {
    pairs.sort_unstable_by_key(|c| c.0);
    pairs.into_iter().unzip()
}

/// The tokens that sampling may pick from one row of logits; `temperature`
/// must be > 0.
///
/// Filters, as in llama.cpp and transformers: top-k keeps the `top_k` largest
/// logits; over them, top-p keeps the shortest most-likely-first prefix whose
/// probability reaches `top_p`, and min-p drops tokens below `min_p` times the
/// most likely one's probability. The cost is linear in the vocabulary (vector
/// code: the weights' `exp` included) plus a sort of what the filters keep:
/// only top-p needs an order, found by selecting the 64, 256, ... most likely
/// until their mass reaches `top_p`. A full sort of a 49k vocabulary took
/// 1.4 ms a token, about a third of SmolLM2's whole decode step (docs/performance.md).
pub fn candidates(logits: &[f32], p: &SamplingParams) -> Candidates {
    let (ids, weights) = filter(logits, p);
    Candidates { ids: ids.unwrap_or_else(|| (0..weights.len() as u32).collect()), weights }
}

/// [`candidates`] with their ids left out (`None`) while they are every token's.
fn filter(logits: &[f32], p: &SamplingParams) -> (Option<Vec<u32>>, Vec<f32>) {
    let t = p.temperature;
    let best = max(logits);
    if !best.is_finite() {
        // No finite most likely logit (all -inf, or an infinity from a broken
        // model): the first largest, alone.
        return (Some(vec![argmax(logits)]), vec![1.0]);
    }
    // Top-k on the logits themselves (dividing by t > 0 keeps their order),
    // selected among those within some distance of the best that number at
    // least k (a counting pass each), not among the whole vocabulary.
    let (ids, logits): (Option<Vec<u32>>, std::borrow::Cow<[f32]>) = if p.top_k > 0 && (p.top_k as usize) < logits.len() {
        let k = p.top_k as usize;
        let floor = [2.0f32, 4.0, 8.0, 16.0, 32.0]
            .into_iter()
            .map(|d| best - d)
            .find(|&floor| logits.iter().filter(|&&l| l >= floor).count() >= k)
            .unwrap_or(f32::NEG_INFINITY);
        let mut pairs: Vec<(u32, f32)> = logits.iter().enumerate().filter(|c| *c.1 >= floor).map(|(i, &l)| (i as u32, l)).collect();
        if k < pairs.len() {
            pairs.select_nth_unstable_by(k - 1, more_likely);
            pairs.truncate(k);
        }
        let (ids, top) = by_id(pairs);
        (Some(ids), top.into())
    } else {
        (None, logits.into())
    };
    let top = best / t;
    let mut weights = vec![0.0f32; logits.len()];
    scaled_weights(&logits, t, top, &mut weights);
    let total = sum(&weights);
    let mut ids = ids;
    if p.min_p > 0.0 {
        // Relative to the most likely token's weight, which is 1 (and stays).
        let floor = p.min_p.min(1.0);
        let (kept_ids, kept_weights) =
            weights.iter().enumerate().filter(|c| *c.1 >= floor).map(|(i, &w)| (id_at(&ids, i), w)).unzip();
        (ids, weights) = (Some(kept_ids), kept_weights);
    }
    if p.top_p >= 1.0 {
        return (ids, weights);
    }
    let target = p.top_p * total;
    // The nucleus holds the most likely tokens, so it lies among those weighing
    // at least some floor whose tokens' mass reaches the target: the first of a
    // few floors that does (a vector pass each) leaves a few hundred tokens to
    // order instead of the vocabulary (a language model's nucleus rarely reaches
    // below 1e-4 of its top token). The margin keeps a floor whose mass only
    // reaches the target by rounding from cutting the nucleus short.
    let floor = [1e-2f32, 1e-3, 1e-4, 1e-6]
        .into_iter()
        .find(|&floor| mass_from(&weights, floor) >= target * (1.0 + 1e-4))
        .unwrap_or(0.0);
    let mut pairs: Vec<(u32, f32)> =
        weights.iter().enumerate().filter(|c| *c.1 >= floor).map(|(i, &w)| (id_at(&ids, i), w)).collect();
    let n = pairs.len();
    let mut k = n.min(64);
    loop {
        if k < n {
            pairs.select_nth_unstable_by(k - 1, more_likely);
        }
        pairs[..k].sort_unstable_by(more_likely);
        let mut mass = 0.0;
        let reached = pairs[..k].iter().position(|c| {
            mass += c.1;
            mass >= target
        });
        match reached {
            Some(last) => {
                pairs.truncate(last + 1);
                break;
            }
            // min-p's cut came first: every token it kept.
            None if k == n => break,
            None => k = (k * 4).min(n),
        }
    }
    let (ids, weights) = by_id(pairs);
    (Some(ids), weights)
}

/// Weights are summed in blocks of this many for a draw, so that finding the
/// drawn token walks the block sums and then one block.
const DRAW_BLOCK: usize = 256;

/// Picks the next token from one row of logits: the first maximum when
/// greedy, else a draw from [`candidates`] in proportion to their weights.
pub fn sample(logits: &[f32], p: &SamplingParams, rng: &mut Rng) -> u32 {
    if p.temperature <= 0.0 {
        return argmax(logits);
    }
    let (ids, weights) = filter(logits, p);
    let id = |i: usize| id_at(&ids, i);
    let blocks: Vec<f32> = weights.chunks(DRAW_BLOCK).map(sum).collect();
    let mut r = rng.next_f32() * blocks.iter().sum::<f32>();
    let mut last = 0;
    for (b, &block) in blocks.iter().enumerate() {
        if block == 0.0 {
            continue;
        }
        let first = b * DRAW_BLOCK;
        last = first;
        if r >= block {
            r -= block;
            continue;
        }
        for (j, &w) in weights[first..(first + DRAW_BLOCK).min(weights.len())].iter().enumerate() {
            if w > 0.0 {
                last = first + j;
            }
            if r < w {
                return id(first + j);
            }
            r -= w;
        }
        // Rounding: the block's parts added to more than its walk.
        return id(last);
    }
    // Rounding left r at or past the last block: its last token that can be drawn.
    let block = &weights[last..(last + DRAW_BLOCK).min(weights.len())];
    id(last + block.iter().rposition(|&w| w > 0.0).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(sample(&[1.0, 3.0, 3.0, 2.0], &SamplingParams::default(), &mut Rng::new(0)), 1);
    }

    #[test]
    fn argmax_finds_the_first_maximum_in_any_block() {
        let mut row = vec![0.5f32; 200];
        (row[130], row[190], row[3]) = (2.0, 2.0, f32::NAN);
        assert_eq!(argmax(&row), 130, "NaNs never win; the first of equal maxima does");
        row[199] = 3.0;
        assert_eq!(argmax(&row), 199, "the tail past the last whole block");
        assert_eq!(argmax(&[f32::NAN; 3]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
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

    /// The filters restated naively, in f64 with a full sort: the kept token ids
    /// (ascending), or None when a cut falls within rounding of a boundary.
    fn reference_kept(logits: &[f32], p: &SamplingParams) -> Option<Vec<u32>> {
        let t = p.temperature as f64;
        let mut c: Vec<(u32, f64)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l as f64 / t)).collect();
        c.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            c.truncate(p.top_k as usize);
        }
        let max = c[0].1;
        let w: Vec<f64> = c.iter().map(|x| (x.1 - max).exp()).collect();
        let total: f64 = w.iter().sum();
        let near = |a: f64, b: f64| (a - b).abs() <= 1e-4 * b.abs().max(1e-30);
        let mut keep = c.len();
        if p.top_p < 1.0 {
            let target = p.top_p as f64 * total;
            let mut acc = 0.0;
            for (i, &x) in w.iter().enumerate() {
                acc += x;
                if near(acc, target) {
                    return None;
                }
                if acc >= target {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            if w.iter().any(|&x| near(x, p.min_p as f64)) {
                return None;
            }
            keep = keep.min(w.iter().take_while(|&&x| x >= p.min_p as f64).count());
        }
        let mut ids: Vec<u32> = c[..keep].iter().map(|x| x.0).collect();
        ids.sort_unstable();
        Some(ids)
    }

    #[test]
    fn candidates_match_a_full_sort_of_the_vocabulary() {
        let mut rng = Rng::new(42);
        let mut checked = 0;
        for case in 0..400 {
            let vocab = [7, 300, 5000][case % 3];
            // Peaked and flat rows: a spread of 12 puts a few tokens ahead, one of
            // 0.5 leaves hundreds in the nucleus (top-p then has to look past the
            // first 64 and 256 candidates).
            let spread = [12.0, 3.0, 0.5][case / 3 % 3];
            let logits: Vec<f32> = (0..vocab).map(|_| (rng.next_f32() - 0.5) * spread).collect();
            let p = SamplingParams {
                temperature: [1.0, 0.7, 1.5][case % 5 % 3],
                top_k: [0, 0, 1, 40, 2000][case % 5],
                top_p: [1.0, 0.9, 0.5, 0.99, 0.0][case / 5 % 5],
                min_p: [0.0, 0.0, 0.05, 0.3][case / 25 % 4],
            };
            let Some(want) = reference_kept(&logits, &p) else { continue };
            let got = candidates(&logits, &p);
            assert!(got.ids.windows(2).all(|w| w[0] < w[1]), "candidates come in token id order");
            assert_eq!(got.ids, want, "case {case}: vocab {vocab}, {p:?}");
            assert_eq!(got.ids.len(), got.weights.len());
            let best = got.weights.iter().copied().fold(0.0, f32::max);
            assert_eq!(best, 1.0, "the most likely token weighs 1");
            checked += 1;
        }
        assert!(checked > 300, "only {checked} cases away from a boundary");
    }

    #[test]
    fn exp_nonpositive_is_within_two_ulp() {
        assert_eq!(exp_nonpositive(0.0), 1.0, "the most likely token's weight is exactly 1");
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpositive(-87.5), 0.0);
        assert_eq!(exp_nonpositive(-1e30), 0.0);
        let mut worst = 0.0f64;
        for i in 0..=870_000 {
            let x = -(i as f32) * 1e-4;
            let (got, want) = (exp_nonpositive(x) as f64, (x as f64).exp());
            worst = worst.max((got - want).abs() / want);
        }
        // 2 ulp of a float is at most 2^-22 relative.
        assert!(worst < 2.0 * 2f64.powi(-23) * 2.0, "worst relative error {worst:e}");
    }

    #[test]
    fn draws_follow_the_probabilities() {
        // Probabilities ~ [0.09, 0.64, 0.03, 0.24] at temperature 1; at 2 the
        // logits halve.
        let logits = [1.0f32, 3.0, 0.0, 2.0];
        for t in [1.0f32, 2.0] {
            let w: Vec<f64> = logits.iter().map(|&l| ((l as f64 - 3.0) / t as f64).exp()).collect();
            let total: f64 = w.iter().sum();
            let p = SamplingParams { temperature: t, ..Default::default() };
            let mut counts = [0usize; 4];
            let mut r = Rng::new(7);
            let draws = 40_000;
            (0..draws).for_each(|_| counts[sample(&logits, &p, &mut r) as usize] += 1);
            for (i, &c) in counts.iter().enumerate() {
                let (got, want) = (c as f64 / draws as f64, w[i] / total);
                assert!((got - want).abs() < 0.01, "temperature {t}: token {i} drawn {got:.4} of the time, probability {want:.4}");
            }
        }
    }

    #[test]
    fn rows_without_a_finite_maximum_do_not_panic() {
        let p = SamplingParams { temperature: 1.0, top_p: 0.9, ..Default::default() };
        let mut r = Rng::new(3);
        assert_eq!(sample(&[f32::NEG_INFINITY, f32::INFINITY, 1.0], &p, &mut r), 1);
        assert_eq!(sample(&[f32::NEG_INFINITY; 3], &p, &mut r), 0);
        // -inf logits (e.g. --ignore-eos's end token) are never drawn.
        let p = SamplingParams { temperature: 1.0, ..Default::default() };
        assert!((0..500).all(|_| sample(&[0.0, f32::NEG_INFINITY, 0.0], &p, &mut r) != 1));
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
