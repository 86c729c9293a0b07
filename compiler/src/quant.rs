//! Weight encodings (MAX's `--quantization-encoding` names) and their exact
//! float conversions, shared by the quantize pass, the reference interpreter and
//! the artifact writer so that all three agree bit for bit.

use half::{bf16, f16};

use crate::graph::QuantScheme;

/// Parses an encoding name; `Ok(None)` for float32, `Err` lists what is implemented.
pub fn parse_encoding(name: &str) -> Result<QuantScheme, String> {
    match name {
        "float32" => Ok(QuantScheme::None),
        "bfloat16" => Ok(QuantScheme::BF16),
        "float16" => Ok(QuantScheme::F16),
        other => Err(format!("`{other}` is not implemented yet; this maxc supports float32, bfloat16 and float16")),
    }
}

/// The value `x` takes once stored in `scheme` (round to nearest even).
pub fn round(scheme: QuantScheme, x: f32) -> f32 {
    match scheme {
        QuantScheme::None => x,
        QuantScheme::BF16 => bf16::from_f32(x).to_f32(),
        QuantScheme::F16 => f16::from_f32(x).to_f32(),
    }
}

/// Little-endian bytes of `values` stored in `scheme`.
pub fn encode(scheme: QuantScheme, values: &[f32], out: &mut Vec<u8>) {
    match scheme {
        QuantScheme::None => values.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        QuantScheme::BF16 => values.iter().for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        QuantScheme::F16 => values.iter().for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
    }
}

/// Bytes per element.
pub fn size(scheme: QuantScheme) -> u64 {
    match scheme {
        QuantScheme::None => 4,
        QuantScheme::BF16 | QuantScheme::F16 => 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_to_nearest_even_and_encoding_agrees() {
        // 1 + 2^-8 is halfway between two bf16 values: ties go to the even one (1.0).
        assert_eq!(round(QuantScheme::BF16, 1.0 + 1.0 / 256.0), 1.0);
        assert_eq!(round(QuantScheme::BF16, 1.0 + 3.0 / 256.0), 1.0 + 4.0 / 256.0);
        assert_eq!(round(QuantScheme::F16, 65504.0), 65504.0);
        let mut bytes = Vec::new();
        encode(QuantScheme::BF16, &[1.5, -2.0], &mut bytes);
        assert_eq!(bytes, vec![0xc0, 0x3f, 0x00, 0xc0]);
        assert_eq!(parse_encoding("q4_k").unwrap_err().contains("bfloat16"), true);
    }
}
