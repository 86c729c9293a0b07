//! CPU feature detection for the load-time check of an artifact's required features:
//! x86-64 through CPUID (`is_x86_feature_detected!`), aarch64 through the kernel's
//! hardware capabilities (`is_aarch64_feature_detected!`).

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

/// One architecture's checkable features: `$list`, their LLVM names (what
/// artifacts record), and `$detect`, compiled on that architecture only, which
/// asks std's detection macro `$macro` under std's name for each.
macro_rules! features {
    ($list:ident, $detect:ident, $arch:literal, $macro:ident, { $($llvm:literal => $std:tt),* $(,)? }) => {
        /// LLVM's names of the features this runtime checks on this architecture.
        pub const $list: &[&str] = &[$($llvm),*];

        #[cfg(target_arch = $arch)]
        fn $detect(name: &str) -> Option<bool> {
            match name {
                $($llvm => Some(std::arch::$macro!($std)),)*
                _ => None,
            }
        }
    };
}

features!(X86_64_FEATURES, detect_x86_64, "x86_64", is_x86_feature_detected, {
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
});

// `aes` is a feature name of both architectures: checkable on each, so that an
// ARM host's `--target cpu` artifact, which records it, passes its own check.
features!(AARCH64_FEATURES, detect_aarch64, "aarch64", is_aarch64_feature_detected, {
    "neon" => "neon", "dotprod" => "dotprod", "fullfp16" => "fp16", "fp16fml" => "fhm",
    "i8mm" => "i8mm", "bf16" => "bf16", "lse" => "lse", "crc" => "crc", "rcpc" => "rcpc",
    "aes" => "aes",
});

/// `Some(present)` for features this runtime can detect on the machine it runs
/// on, `None` otherwise (another architecture's features among them).
#[cfg(target_arch = "x86_64")]
pub fn has_feature(name: &str) -> Option<bool> {
    detect_x86_64(name)
}

/// `Some(present)` for features this runtime can detect on the machine it runs
/// on, `None` otherwise (another architecture's features among them).
#[cfg(target_arch = "aarch64")]
pub fn has_feature(name: &str) -> Option<bool> {
    detect_aarch64(name)
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
pub fn has_feature(_name: &str) -> Option<bool> {
    None
}

/// The `--target` of this machine's architecture that runs on every machine of
/// it that maxrun supports well (x86-64: AVX2 machines), for messages.
pub fn portable_target() -> &'static str {
    if cfg!(target_arch = "aarch64") {
        "cpu:aarch64"
    } else {
        "cpu:x86-64-v3"
    }
}

/// The portable target of this machine's architecture, for messages that ask
/// for a recompile when an artifact needs features this CPU lacks.
pub fn lower_target_hint() -> &'static str {
    if cfg!(target_arch = "aarch64") {
        "--target cpu:aarch64 (NEON alone)"
    } else {
        "a lower level such as --target cpu:x86-64-v3"
    }
}

/// Whether a maxrun can check a feature at load on the architecture it names
/// (the compiler records only these, also for an artifact cross-compiled for
/// the other architecture: an x86-64 maxc writes `dotprod` for an aarch64 one).
pub fn is_checkable(name: &str) -> bool {
    X86_64_FEATURES.contains(&name) || AARCH64_FEATURES.contains(&name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn baseline_present_and_unknown_missing() {
        let baseline = if cfg!(target_arch = "aarch64") { "neon" } else { "sse2" };
        assert!(missing_features(&[baseline.to_string()]).is_empty());
        assert_eq!(missing_features(&["no-such-feature".to_string()]), vec!["no-such-feature".to_string()]);
    }

    #[test]
    fn the_other_architectures_features_are_checkable_but_never_present() {
        let other = if cfg!(target_arch = "aarch64") { "avx2" } else { "dotprod" };
        assert!(is_checkable(other));
        assert_eq!(has_feature(other), None);
        assert_eq!(missing_features(&[other.to_string()]), vec![other.to_string()]);
    }
}
