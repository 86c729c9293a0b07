//! Rotary-embedding frequencies, shared by the reference interpreter and kernel generation.

use super::ir::RopeScaling;

/// The inverse frequency of each rotation pair `i in 0..head_dim/2`, after scaling,
/// computed as Hugging Face transformers does.
pub fn inv_freq(head_dim: u32, theta: f32, scaling: &RopeScaling) -> Vec<f32> {
    let half = head_dim as usize / 2;
    let base: Vec<f64> =
        (0..half).map(|i| 1.0 / (theta as f64).powf((2 * i) as f64 / head_dim as f64)).collect();
    let scaled: Vec<f64> = match scaling {
        RopeScaling::None => base,
        RopeScaling::Linear { factor } => base.iter().map(|f| f / *factor as f64).collect(),
        RopeScaling::FreqFactors(factors) => base.iter().zip(factors).map(|(f, d)| f / *d as f64).collect(),
        RopeScaling::Yarn { factor, original_max_position, beta_fast, beta_slow, truncate } => {
            let (dim, theta, factor) = (head_dim as f64, theta as f64, *factor as f64);
            // The dim whose frequency turns `rotations` times over the original context.
            let correction_dim = |rotations: f64| {
                dim * (*original_max_position as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
            };
            let (mut low, mut high) = (correction_dim(*beta_fast as f64), correction_dim(*beta_slow as f64));
            if *truncate {
                (low, high) = (low.floor(), high.ceil());
            }
            let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
            if low == high {
                high += 0.001;
            }
            base.iter()
                .enumerate()
                .map(|(i, &f)| {
                    // 0 below the ramp (kept), 1 above it (interpolated).
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    f / factor * ramp + f * (1.0 - ramp)
                })
                .collect()
        }
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
            let (factor, low, high, old) =
                (*factor as f64, *low_freq_factor as f64, *high_freq_factor as f64, *original_max_position as f64);
            let low_wavelen = old / low;
            let high_wavelen = old / high;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    };
    scaled.into_iter().map(|f| f as f32).collect()
}

/// The factor transformers multiplies cos and sin by (`attention_factor`):
/// YaRN's `0.1 ln(factor) + 1` (1 for a factor <= 1), 1 for every other scaling.
/// Both q and k carry it, so attention scores carry its square.
pub fn attention_factor(scaling: &RopeScaling) -> f32 {
    match scaling {
        RopeScaling::Yarn { factor, .. } if *factor > 1.0 => (0.1 * (*factor as f64).ln() + 1.0) as f32,
        _ => 1.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_frequencies_follow_the_rope_formula() {
        let f = inv_freq(8, 10000.0, &RopeScaling::None);
        assert_eq!(f.len(), 4);
        assert_eq!(f[0], 1.0);
        assert!((f[1] - 0.1).abs() < 1e-7);
        assert!((f[3] - 0.001).abs() < 1e-9);
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let s = RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 8192 };
        let base = inv_freq(128, 500000.0, &RopeScaling::None);
        let scaled = inv_freq(128, 500000.0, &s);
        assert_eq!(scaled[0], base[0]);
        assert!((scaled[63] - base[63] / 8.0).abs() <= base[63] * 1e-6);
    }

    #[test]
    fn yarn_ramps_from_kept_to_interpolated_frequencies() {
        // gpt-oss: head_dim 16, theta 150000, factor 32 over 4096 positions,
        // beta_fast 32, beta_slow 1, no truncation. Expected values written out
        // from transformers' `_compute_yarn_parameters` formula in float64
        // (correction range 2.0232 .. 4.3495).
        let s = RopeScaling::Yarn { factor: 32.0, original_max_position: 4096, beta_fast: 32.0, beta_slow: 1.0, truncate: false };
        let want = [
            1.0,
            0.2254180002028708,
            0.050813274815461475,
            0.006794959489732219,
            0.00045648391922324086,
            1.818833668168956e-05,
            4.0999784818029795e-06,
            9.242089502428301e-07,
        ];
        let got = inv_freq(16, 150000.0, &s);
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((*g as f64 - w).abs() <= w * 1e-6, "pair {i}: {g} vs {w}");
        }
        assert!((attention_factor(&s) - 1.3465736).abs() < 1e-6);
        assert_eq!(attention_factor(&RopeScaling::None), 1.0);
    }
}
