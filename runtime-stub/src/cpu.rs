//! CPU feature detection for the load-time check of an artifact's required features.

/// Returns the features in `required` (LLVM spelling) that this CPU lacks, or that
/// this runtime cannot check (those are reported as missing: a runtime must not
/// jump into code it cannot vouch for).
///
/// `MAXRUN_DISABLE_CPU_FEATURES=avx512f,avx2` makes this runtime treat those features
/// as absent: it simulates an older machine (tests use it to exercise the refusal).
pub fn missing_features(required: &[String]) -> Vec<String> {
    let disabled = std::env::var("MAXRUN_DISABLE_CPU_FEATURES").unwrap_or_default();
    let disabled: Vec<&str> = disabled.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    required.iter().filter(|f| has_feature(f) != Some(true) || disabled.contains(&f.as_str())).cloned().collect()
}

/// `Some(present)` for features this runtime can detect, `None` otherwise.
#[cfg(target_arch = "x86_64")]
pub fn has_feature(name: &str) -> Option<bool> {
    macro_rules! detect {
        ($($llvm:literal => $std:tt),* $(,)?) => {
            match name {
                $($llvm => Some(std::arch::is_x86_feature_detected!($std)),)*
                _ => None,
            }
        };
    }
    detect! {
        "sse" => "sse", "sse2" => "sse2", "sse3" => "sse3", "ssse3" => "ssse3",
        "sse4.1" => "sse4.1", "sse4.2" => "sse4.2", "sse4a" => "sse4a", "popcnt" => "popcnt",
        "cx16" => "cmpxchg16b", "avx" => "avx", "avx2" => "avx2", "fma" => "fma", "f16c" => "f16c",
        "bmi" => "bmi1", "bmi2" => "bmi2", "lzcnt" => "lzcnt", "movbe" => "movbe", "xsave" => "xsave",
        "xsaveopt" => "xsaveopt", "xsavec" => "xsavec", "xsaves" => "xsaves", "adx" => "adx",
        "aes" => "aes", "pclmul" => "pclmulqdq", "rdrnd" => "rdrand", "rdseed" => "rdseed",
        "sha" => "sha", "tbm" => "tbm", "fxsr" => "fxsr", "avxvnni" => "avxvnni",
        "avx512f" => "avx512f", "avx512bw" => "avx512bw", "avx512cd" => "avx512cd",
        "avx512dq" => "avx512dq", "avx512vl" => "avx512vl", "avx512ifma" => "avx512ifma",
        "avx512vbmi" => "avx512vbmi", "avx512vbmi2" => "avx512vbmi2", "avx512vnni" => "avx512vnni",
        "avx512bitalg" => "avx512bitalg", "avx512vpopcntdq" => "avx512vpopcntdq",
        "avx512bf16" => "avx512bf16", "avx512fp16" => "avx512fp16", "gfni" => "gfni",
        "vaes" => "vaes", "vpclmulqdq" => "vpclmulqdq", "avx512vp2intersect" => "avx512vp2intersect",
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub fn has_feature(_name: &str) -> Option<bool> {
    None
}

/// Whether this runtime can check a feature at all (the compiler records only these).
pub fn is_checkable(name: &str) -> bool {
    has_feature(name).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn baseline_present_and_unknown_missing() {
        assert!(missing_features(&["sse2".to_string()]).is_empty());
        assert_eq!(missing_features(&["no-such-feature".to_string()]), vec!["no-such-feature".to_string()]);
    }
}
