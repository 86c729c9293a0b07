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
}
