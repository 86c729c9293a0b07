//! Target descriptions. CPU: `--target cpu` (this machine), `cpu:x86-64-v3`,
//! `cpu:x86-64-v4`, or `cpu:<llvm cpu>[+feature,...]`; 64-bit ARM (cross-compiled
//! from any build machine, docs/aarch64.md): `cpu:aarch64` (NEON) or
//! `cpu:aarch64+dotprod` (SDOT for the integer dots). GPU: `cuda:sm_80`, or a
//! list `cuda:sm_80,sm_90` (one PTX module each). Both: `cpu,cuda:sm_90`, a fat
//! artifact with CPU code as the fallback.

use crate::CodegenError;

/// A resolved CPU target.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuTarget {
    pub triple: String,
    /// LLVM CPU name (`znver4`, `x86-64-v3`, ...).
    pub cpu: String,
    /// LLVM feature string (`+avx2,+fma,...`); empty means the CPU's own set.
    pub features: String,
    /// Every feature the generated code may use, LLVM spelling without `+`.
    pub enabled: Vec<String>,
}

/// Features the x86-64 micro-architecture levels imply (LLVM spelling).
const V2: &[&str] = &["sse3", "ssse3", "sse4.1", "sse4.2", "popcnt", "cx16", "sahf"];
const V3: &[&str] = &["avx", "avx2", "bmi", "bmi2", "f16c", "fma", "lzcnt", "movbe", "xsave"];
const V4: &[&str] = &["avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"];

/// The x86 features `--target cpu:NAME+feature,...` may name: LLVM's names of
/// the features maxrun can detect at load (`maxrun::cpu::has_feature`; a test
/// keeps the two lists together), so that an artifact never needs a feature its
/// runtime cannot check.
pub const KNOWN_FEATURES: &[&str] = &[
    "sse", "sse2", "sse3", "ssse3", "sse4.1", "sse4.2", "sse4a", "popcnt", "cx16", "avx", "avx2", "fma", "f16c", "bmi",
    "bmi2", "lzcnt", "movbe", "xsave", "xsaveopt", "xsavec", "xsaves", "adx", "aes", "pclmul", "rdrnd", "rdseed", "sha",
    "tbm", "fxsr", "avxvnni", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512ifma", "avx512vbmi",
    "avx512vbmi2", "avx512vnni", "avx512bitalg", "avx512vpopcntdq", "avx512bf16", "avx512fp16", "gfni", "vaes",
    "vpclmulqdq", "avx512vp2intersect",
];

/// The triples of the CPU targets: x86-64 and 64-bit ARM Linux.
pub const X86_64_TRIPLE: &str = "x86_64-unknown-linux-gnu";
pub const AARCH64_TRIPLE: &str = "aarch64-unknown-linux-gnu";

/// The aarch64 features `--target cpu:aarch64+feature,...` may name: LLVM's names
/// of the features maxrun detects on ARM (`maxrun::cpu::has_feature`, through
/// `is_aarch64_feature_detected!`; a test keeps the two lists together). NEON is
/// always on (every AArch64 Linux machine has it); `dotprod` turns the integer
/// dots into SDOT.
pub const KNOWN_AARCH64_FEATURES: &[&str] = &["neon", "dotprod", "fullfp16", "fp16fml", "i8mm", "bf16", "lse", "crc", "rcpc"];

/// Host features that are advertised by CPUID on some VMs but fault when used
/// (AMX); never enabled from CPUID alone.
const NEVER_FROM_HOST: &[&str] = &["amx-tile", "amx-int8", "amx-bf16", "amx-fp16", "amx-complex"];

impl CpuTarget {
    /// Parses a `--target` CPU spec.
    pub fn parse(spec: &str) -> Result<Self, CodegenError> {
        let err = |m: &str| CodegenError::Target { spec: spec.into(), message: m.into() };
        let triple = X86_64_TRIPLE.to_string();
        if spec == "cpu" {
            return Ok(Self::host());
        }
        let rest = spec.strip_prefix("cpu:").ok_or_else(|| err("CPU targets are `cpu`, `cpu:x86-64-v3`, `cpu:x86-64-v4`, `cpu:aarch64` or `cpu:NAME+feature,...`"))?;
        let (cpu, extra) = match rest.split_once('+') {
            Some((c, f)) => (c, Some(f)),
            None => (rest, None),
        };
        if cpu.is_empty() {
            return Err(err("missing CPU name after `cpu:`"));
        }
        if cpu == "aarch64" {
            return Self::parse_aarch64(spec, extra);
        }
        let mut enabled: Vec<String> = match cpu {
            "x86-64" => vec![],
            "x86-64-v2" => V2.to_vec(),
            "x86-64-v3" => [V2, V3].concat(),
            "x86-64-v4" => [V2, V3, V4].concat(),
            _ => return Err(err("known CPU names: x86-64, x86-64-v2, x86-64-v3, x86-64-v4, aarch64 (or `cpu` for this machine)")),
        }
        .into_iter()
        .map(String::from)
        .collect();
        enabled.extend(["sse", "sse2"].map(String::from));
        let mut features = String::new();
        if let Some(extra) = extra {
            for f in extra.split(',').map(|f| f.trim().trim_start_matches('+')) {
                if f.is_empty() {
                    return Err(err("empty feature name"));
                }
                if !KNOWN_FEATURES.contains(&f) {
                    return Err(CodegenError::Target {
                        spec: spec.into(),
                        message: format!("unknown CPU feature `{f}`; known: {}", KNOWN_FEATURES.join(", ")),
                    });
                }
                features.push_str(&format!("{}+{f}", if features.is_empty() { "" } else { "," }));
                enabled.push(f.to_string());
            }
        }
        enabled.sort();
        enabled.dedup();
        // LLVM aborts on AVX-512 extensions without the foundation ("ZMM registers
        // are not supported without EVEX512").
        if let Some(f) = enabled.iter().find(|f| f.starts_with("avx512") && *f != "avx512f") {
            if !enabled.iter().any(|e| e == "avx512f") {
                return Err(CodegenError::Target {
                    spec: spec.into(),
                    message: format!("`{f}` needs AVX-512 Foundation: use cpu:x86-64-v4+{f}, or add +avx512f"),
                });
            }
        }
        Ok(CpuTarget { triple, cpu: cpu.into(), features, enabled })
    }

    /// `cpu:aarch64[+feature,...]`: LLVM's `generic` AArch64 CPU with NEON and
    /// the features named (from [`KNOWN_AARCH64_FEATURES`]).
    fn parse_aarch64(spec: &str, extra: Option<&str>) -> Result<Self, CodegenError> {
        let mut enabled = vec!["neon".to_string()];
        for f in extra.map(|e| e.split(',').map(|f| f.trim().trim_start_matches('+')).collect::<Vec<_>>()).unwrap_or_default() {
            if f.is_empty() {
                return Err(CodegenError::Target { spec: spec.into(), message: "empty feature name".into() });
            }
            if !KNOWN_AARCH64_FEATURES.contains(&f) {
                return Err(CodegenError::Target {
                    spec: spec.into(),
                    message: format!("unknown aarch64 CPU feature `{f}`; known: {}", KNOWN_AARCH64_FEATURES.join(", ")),
                });
            }
            enabled.push(f.to_string());
        }
        // Kept in the order written (NEON first): the feature string is part of
        // the artifact's provenance.
        let mut seen = Vec::new();
        enabled.retain(|f| if seen.contains(f) { false } else { seen.push(f.clone()); true });
        let features = enabled.iter().map(|f| format!("+{f}")).collect::<Vec<_>>().join(",");
        enabled.sort();
        Ok(CpuTarget { triple: AARCH64_TRIPLE.into(), cpu: "generic".into(), features, enabled })
    }

    /// This machine's CPU, minus features that must never come from CPUID alone.
    pub fn host() -> Self {
        let cpu = inkwell::targets::TargetMachine::get_host_cpu_name().to_string();
        let host = inkwell::targets::TargetMachine::get_host_cpu_features().to_string();
        let mut parts = Vec::new();
        let mut enabled = Vec::new();
        for f in host.split(',').filter(|f| !f.is_empty()) {
            let name = &f[1..];
            if f.starts_with('+') && NEVER_FROM_HOST.contains(&name) {
                parts.push(format!("-{name}"));
            } else {
                if f.starts_with('+') {
                    enabled.push(name.to_string());
                }
                parts.push(f.to_string());
            }
        }
        enabled.sort();
        let triple = if cfg!(target_arch = "aarch64") { AARCH64_TRIPLE } else { X86_64_TRIPLE };
        CpuTarget { triple: triple.into(), cpu, features: parts.join(","), enabled }
    }

    /// Whether this is a 64-bit ARM target (`cpu:aarch64...`): LLVM's AArch64
    /// backend, NEON instead of SSE / AVX, the cross linker.
    pub fn is_aarch64(&self) -> bool {
        self.triple.starts_with("aarch64")
    }

    /// Whether the aarch64 dot-product instructions (`sdot` / `udot`, FEAT_DotProd) are available.
    pub fn has_dotprod(&self) -> bool {
        self.is_aarch64() && self.has_feature("dotprod")
    }

    /// Whether 512-bit vectors are available (then preferred over 256-bit).
    pub fn has_avx512(&self) -> bool {
        self.has_feature("avx512f")
    }

    /// Whether LLVM feature `name` (`avx512vnni`, ...) is enabled for this target.
    pub fn has_feature(&self, name: &str) -> bool {
        self.enabled.iter().any(|f| f == name)
    }

    /// Whether bfloat16 pair dots (`vdpbf16ps` on zmm, AVX512_BF16) outrun f32
    /// FMAs on this CPU: known for AMD Zen 4 and Zen 5 hosts (on a Zen 5 VM
    /// 819 against 445 GFLOP/s on two cores, docs/performance-log.md "On a Zen 5
    /// VM"; Zen 4 by its published rates, one per cycle as its zmm FMAs, with
    /// twice their work: not measured here), not for
    /// Intel's (on a Xeon VM with AMX 206 against 385) nor for a target named
    /// by level and features, whose CPU is not known.
    pub fn bf16_pairs_outrun_fmas(&self) -> bool {
        self.has_avx512_bf16() && matches!(self.cpu.as_str(), "znver4" | "znver5")
    }

    /// Whether Q4_K prefill with int8 activations takes 8 rows x 2 panels
    /// instead of AVX-512's 4 x 2 on this CPU: known for Intel's Sapphire
    /// Rapids and Emerald Rapids cores (48 KiB 12-way L1D, so 8 activation
    /// lines 4 KiB apart and the weights' fit one set). Intel Xeon VM
    /// (sapphirerapids), one thread, Q4_K k 8192 x n 2048 at 128 rows
    /// (`MAXC_BENCH_TILES=4x2,8x2,6x2,5x2,3x2,8x1 cargo bench -p maxc-tests
    /// --bench kernels -- gemm_prefill`), G multiply-adds/s: 4 x 2 166, 8 x 2
    /// 199, 6 x 2 190, 5 x 2 178, 3 x 2 152, 8 x 1 128 (docs/performance-log.md,
    /// 2026-12-07). Not AMD's Zen 4 (8-way L1D: the AVX-512 tiles' rows stop
    /// at 8 lines per set with Q6_K's 8 x 1) nor Zen 5, where it is not
    /// measured, nor a target named by level, whose CPU is not known.
    pub fn q4_k_int8_tiles_take_eight_rows(&self) -> bool {
        self.has_avx512_vnni() && matches!(self.cpu.as_str(), "sapphirerapids" | "emeraldrapids")
    }

    /// Whether 512-bit bfloat16 pair dots (`vdpbf16ps` on zmm, AVX512_BF16) are available.
    pub fn has_avx512_bf16(&self) -> bool {
        self.has_avx512() && self.has_feature("avx512bf16")
    }

    /// Whether 512-bit VNNI byte dot products (`vpdpbusd` on zmm) are available.
    pub fn has_avx512_vnni(&self) -> bool {
        self.has_feature("avx512vnni") && self.has_feature("avx512bw")
    }

    /// Whether 256-bit VEX-encoded VNNI (`vpdpbusd` on ymm, AVX-VNNI) is available.
    pub fn has_avx_vnni(&self) -> bool {
        self.has_feature("avxvnni")
    }

    /// Whether 512-bit byte and word multiply-adds (`vpmaddubsw` / `vpmaddwd` on
    /// zmm) are available.
    pub fn has_avx512_bw(&self) -> bool {
        self.has_feature("avx512bw")
    }

    /// Whether 256-bit integer vectors (AVX2: `vpmaddubsw` / `vpmaddwd` on ymm) are available.
    pub fn has_avx2(&self) -> bool {
        self.has_feature("avx2")
    }

    /// Whether one four-byte dot instruction multiplies Q8_0's levels as
    /// stored: VNNI's `vpdpbusd` (the unsigned `q + 128` times signed
    /// activations) or NEON's `sdot` / `smull` (the signed `q`). Without it
    /// (`vpmaddubsw`, whose pair sums saturate above 2 x 128 x 128), byte
    /// planes move the weights' signs onto every row's activations
    /// (`lower/dots.rs`, `sign_moved`), so Q8_0 takes word dots in prefill
    /// tiles as well as in decode (the schedule's `byte_dots_take_q8_0`).
    pub fn multiplies_q8_0_bytes_directly(&self) -> bool {
        self.is_aarch64() || self.has_avx512_vnni() || self.has_avx_vnni()
    }
}

/// NVIDIA architectures maxc emits PTX for (Volta and later: 64-bit atomics and
/// `f16` conversions in hardware; LLVM 19 and ptxas 12 both know them).
pub const SUPPORTED_SM: &[&str] = &["sm_70", "sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_90"];

/// An NVIDIA GPU architecture (`sm_90`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuTarget {
    pub arch: String,
}

/// A whole `--target`: CPU code, GPU modules, or both.
#[derive(Clone, Debug, PartialEq)]
pub struct TargetSpec {
    /// The first (or only) CPU variant.
    pub cpu: Option<CpuTarget>,
    /// The other CPU variants of a multi-ISA list (`cpu:x86-64-v2,x86-64-v3`),
    /// in the order written; empty for one CPU target.
    pub cpu_variants: Vec<CpuTarget>,
    /// Each CPU variant's spec as written, `cpu` first then `cpu_variants`
    /// (`cpu:x86-64-v3`, `cpu:x86-64-v4+avx512vnni`, or `cpu`).
    pub cpu_specs: Vec<String>,
    pub gpus: Vec<GpuTarget>,
}

/// `cpu:portable`: the x86-64 servers a CI pipeline ships to without knowing
/// them (docs/portable.md): AVX2 (Haswell and later, Zen 1-3), AVX2 with
/// AVX-VNNI (Alder Lake, Sierra Forest), AVX-512 (Skylake-SP) and AVX-512 with
/// VNNI (Cascade Lake, Ice Lake, Sapphire Rapids, Zen 4), whose byte dot
/// products the default int16 activations are built on. x86-64-v2 (SSE4.2
/// only) is left out: its code compiles 10x slower and runs 10x slower
/// (128-bit registers for 512-bit kernels); list it to have it.
pub const PORTABLE: &[&str] = &["x86-64-v3", "x86-64-v3+avxvnni", "x86-64-v4", "x86-64-v4+avx512vnni"];

/// Whether `item` of a comma list after `cpu:` starts a CPU variant (a CPU
/// name, possibly with `+features`) rather than continuing the previous
/// variant's feature list (`cpu:x86-64-v3+avx512f,avx512bw`).
fn starts_variant(item: &str) -> bool {
    let name = item.split('+').next().unwrap_or_default().trim();
    name.starts_with("x86-64") || name.starts_with("aarch64") || name == "portable"
}

/// The CPU part of a `--target` split into one spec per variant:
/// `cpu:x86-64-v2,x86-64-v3+avx512f,avx512bw` -> `cpu:x86-64-v2`,
/// `cpu:x86-64-v3+avx512f,avx512bw`; `cpu:portable` expands to [`PORTABLE`].
pub fn cpu_variant_specs(cpu_part: &str) -> Vec<String> {
    let Some(rest) = cpu_part.strip_prefix("cpu:") else { return vec![cpu_part.to_string()] };
    let mut variants: Vec<String> = Vec::new();
    for item in rest.split(',') {
        match variants.last_mut() {
            Some(last) if !starts_variant(item) => {
                last.push(',');
                last.push_str(item);
            }
            _ if item.trim() == "portable" => variants.extend(PORTABLE.iter().map(|v| v.to_string())),
            _ => variants.push(item.to_string()),
        }
    }
    variants.into_iter().map(|v| format!("cpu:{v}")).collect()
}

impl TargetSpec {
    /// Parses `cpu...`, `cuda:sm_A[,sm_B...]` or `cpu...,cuda:sm_A[,...]`.
    pub fn parse(spec: &str) -> Result<Self, CodegenError> {
        let err = |m: String| CodegenError::Target { spec: spec.into(), message: m };
        let (cpu_part, gpu_part) = match spec.find("cuda:") {
            Some(0) => ("", Some(&spec[5..])),
            Some(at) => {
                let cpu = spec[..at].strip_suffix(',').ok_or_else(|| err("separate the CPU and CUDA parts with a comma: `cpu,cuda:sm_90`".into()))?;
                (cpu, Some(&spec[at + 5..]))
            }
            None => (spec, None),
        };
        let cpu_specs = if cpu_part.is_empty() { Vec::new() } else { cpu_variant_specs(cpu_part) };
        let mut cpus = Vec::with_capacity(cpu_specs.len());
        for (i, one) in cpu_specs.iter().enumerate() {
            if cpu_specs[..i].contains(one) {
                return Err(err(format!("`{one}` is listed twice; each CPU variant once")));
            }
            let target = CpuTarget::parse(one)?;
            if let Some(first) = cpus.first().filter(|f: &&CpuTarget| f.triple != target.triple) {
                return Err(err(format!(
                    "`{one}` is for {} and the first variant for {}: one architecture per artifact (maxrun is built per architecture); compile one artifact each",
                    target.triple, first.triple
                )));
            }
            cpus.push(target);
        }
        let mut cpus = cpus.into_iter();
        let cpu = cpus.next();
        let cpu_variants: Vec<CpuTarget> = cpus.collect();
        let mut gpus: Vec<GpuTarget> = Vec::new();
        if let Some(list) = gpu_part {
            for arch in list.split(',').map(str::trim) {
                if !SUPPORTED_SM.contains(&arch) {
                    return Err(err(format!("unknown GPU architecture `{arch}`; supported: {}", SUPPORTED_SM.join(", "))));
                }
                if !gpus.iter().any(|g| g.arch == arch) {
                    gpus.push(GpuTarget { arch: arch.into() });
                }
            }
        }
        Ok(TargetSpec { cpu, cpu_variants, cpu_specs, gpus })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_cpu_features_are_refused_with_the_known_ones() {
        let e = CpuTarget::parse("cpu:x86-64+nosuchfeat").unwrap_err().to_string();
        assert!(e.contains("unknown CPU feature `nosuchfeat`") && e.contains("avx512vnni"), "{e}");
        assert!(CpuTarget::parse("cpu:x86-64-v4+avx512vnni").is_ok());
        let e = CpuTarget::parse("cpu:x86-64-v3+avx512vnni").unwrap_err().to_string();
        assert!(e.contains("needs AVX-512 Foundation") && e.contains("cpu:x86-64-v4+avx512vnni"), "{e}");
    }

    #[test]
    fn target_specs_combine_cpu_and_cuda() {
        let t = TargetSpec::parse("cuda:sm_80,sm_90").unwrap();
        assert!(t.cpu.is_none());
        assert_eq!(t.gpus.iter().map(|g| g.arch.as_str()).collect::<Vec<_>>(), ["sm_80", "sm_90"]);
        let t = TargetSpec::parse("cpu:x86-64-v3+avx512f,avx512bw,cuda:sm_90").unwrap();
        assert_eq!(t.cpu.unwrap().cpu, "x86-64-v3");
        assert_eq!(t.gpus.len(), 1);
        assert!(TargetSpec::parse("cpu").unwrap().gpus.is_empty());
        let e = TargetSpec::parse("cuda:sm_99").unwrap_err().to_string();
        assert!(e.contains("sm_99") && e.contains("sm_90"), "{e}");
        assert!(TargetSpec::parse("cpucuda:sm_90").is_err());
    }

    #[test]
    fn cpu_lists_are_variants_and_features_stay_with_theirs() {
        let t = TargetSpec::parse("cpu:x86-64-v2,x86-64-v3+avx512f,avx512bw,x86-64-v4,cuda:sm_90").unwrap();
        assert_eq!(t.cpu_specs, ["cpu:x86-64-v2", "cpu:x86-64-v3+avx512f,avx512bw", "cpu:x86-64-v4"]);
        assert_eq!(t.cpu.as_ref().unwrap().cpu, "x86-64-v2");
        assert_eq!(t.cpu_variants.len(), 2);
        assert!(t.cpu_variants[0].has_feature("avx512bw") && !t.cpu_variants[1].has_feature("avx512vnni"));
        assert_eq!(t.gpus.len(), 1);
        let p = TargetSpec::parse("cpu:portable").unwrap();
        assert_eq!(p.cpu_specs, PORTABLE.iter().map(|v| format!("cpu:{v}")).collect::<Vec<_>>());
        assert!(p.cpu_variants[0].has_avx_vnni() && p.cpu_variants.last().unwrap().has_avx512_vnni());
        let more = TargetSpec::parse("cpu:x86-64-v2,portable").unwrap();
        assert_eq!(more.cpu_specs.len(), 1 + PORTABLE.len());
        let one = TargetSpec::parse("cpu:x86-64-v3+avx512f,avx512bw").unwrap();
        assert!(one.cpu_variants.is_empty() && one.cpu_specs == ["cpu:x86-64-v3+avx512f,avx512bw"]);
        let e = TargetSpec::parse("cpu:x86-64-v3,x86-64-v3").unwrap_err().to_string();
        assert!(e.contains("listed twice"), "{e}");
    }

    #[test]
    fn levels_imply_their_features() {
        let v3 = CpuTarget::parse("cpu:x86-64-v3").unwrap();
        assert!(v3.enabled.contains(&"avx2".to_string()) && v3.enabled.contains(&"fma".to_string()));
        assert!(!v3.has_avx512());
        assert!(CpuTarget::parse("cpu:x86-64-v4").unwrap().has_avx512());
        let extra = CpuTarget::parse("cpu:x86-64+avx2,+fma").unwrap();
        assert_eq!(extra.features, "+avx2,+fma");
    }

    #[test]
    fn bad_specs_are_errors() {
        for spec in ["gpu", "cpu:", "cpu:pentium9", "cpu:x86-64+"] {
            assert!(CpuTarget::parse(spec).is_err(), "{spec}");
        }
    }

    #[test]
    fn aarch64_targets_are_neon_with_the_features_named() {
        let neon = CpuTarget::parse("cpu:aarch64").unwrap();
        assert_eq!((neon.triple.as_str(), neon.cpu.as_str(), neon.features.as_str()), (AARCH64_TRIPLE, "generic", "+neon"));
        assert!(neon.is_aarch64() && !neon.has_dotprod() && !neon.has_avx2() && !neon.has_avx512());
        let dot = CpuTarget::parse("cpu:aarch64+dotprod").unwrap();
        assert_eq!(dot.features, "+neon,+dotprod");
        assert!(dot.has_dotprod() && dot.enabled == ["dotprod", "neon"]);
        assert_eq!(CpuTarget::parse("cpu:aarch64+dotprod,+i8mm").unwrap().features, "+neon,+dotprod,+i8mm");
        let e = CpuTarget::parse("cpu:aarch64+avx2").unwrap_err().to_string();
        assert!(e.contains("unknown aarch64 CPU feature `avx2`") && e.contains("dotprod"), "{e}");
        let e = CpuTarget::parse("cpu:x86-64+dotprod").unwrap_err().to_string();
        assert!(e.contains("unknown CPU feature `dotprod`"), "{e}");
        assert!(CpuTarget::parse("cpu:aarch64+").is_err());
        assert!(!CpuTarget::parse("cpu:x86-64-v3").unwrap().is_aarch64());
        let e = CpuTarget::parse("cpu:arm").unwrap_err().to_string();
        assert!(e.contains("aarch64"), "{e}");
    }

    #[test]
    fn host_never_enables_amx() {
        let host = CpuTarget::host();
        assert!(!host.enabled.iter().any(|f| f.starts_with("amx")));
    }
}
