//! Multi-ISA artifacts (docs/portable.md): one artifact holds a code variant
//! per x86-64 level over one copy of the weights, and maxrun runs the variant
//! the machine supports with the most features. Lower variants are forced the
//! way a test can pretend to be an older CPU: `MAXRUN_DISABLE_CPU_FEATURES`
//! takes features away from what maxrun detects.

use std::ffi::OsStr;

use maxc_tests::*;
use serde_json::Value;

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// The levels this machine can run, each with the features to take away so
/// that it is the best variant left: (variant, MAXRUN_DISABLE_CPU_FEATURES).
fn levels_here() -> Vec<(&'static str, &'static str)> {
    let mut levels = vec![("cpu:x86-64-v2", "avx2,avx512f")];
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        levels.push(("cpu:x86-64-v3", "avx512f"));
    }
    if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bw") {
        levels.push(("cpu:x86-64-v4", ""));
    } else {
        eprintln!("this CPU has no AVX-512: the x86-64-v4 variant is checked for its presence, not run");
    }
    levels
}

#[test]
fn one_artifact_runs_every_x86_64_level_with_the_golden_logits() {
    let mef = compile_model("multi-isa", &smollm2_gguf(), &["--target", "cpu:x86-64-v2,x86-64-v3,x86-64-v4"]);
    let single = compile_model("single-v3", &smollm2_gguf(), &["--target", "cpu:x86-64-v3"]);
    let (multi, one) = (inspect_json(&mef), inspect_json(&single));
    let variants = multi["cpu_variants"].as_array().unwrap();
    let specs: Vec<&str> = variants.iter().map(|v| v["spec"].as_str().unwrap()).collect();
    assert_eq!(specs, ["cpu:x86-64-v2", "cpu:x86-64-v3", "cpu:x86-64-v4"]);
    // The weights once: the same bytes as the single-target artifact's, and the
    // file no larger than it plus the other variants' code, within 2%.
    assert_eq!(multi["weights"]["bytes"], one["weights"]["bytes"]);
    let code: Vec<u64> = variants.iter().map(|v| v["code_bytes"].as_u64().unwrap()).collect();
    let other_code = code[0] + code[2];
    let (multi_bytes, one_bytes) = (multi["file_bytes"].as_u64().unwrap(), one["file_bytes"].as_u64().unwrap());
    assert!(multi_bytes as f64 <= (one_bytes + other_code) as f64 * 1.02, "{multi_bytes} bytes against {one_bytes} + {other_code} of code");
    assert!(multi_bytes > one_bytes + other_code - (64 << 10), "every variant's code is in the file");
    let golden = golden("smollm2-135m");
    for (variant, disabled) in levels_here() {
        let env = [("MAXRUN_DISABLE_CPU_FEATURES", disabled)];
        // The variant maxrun says it runs, in --verbose and in inspect.
        let case = &cases(&golden)[0];
        let r = run_bin_env("maxrun", &[mef.as_os_str(), os("--prompt"), os(case["prompt"].as_str().unwrap()), os("-n"), os("24"), os("-v")], &env);
        assert_eq!(r.0, 0, "{variant}: {}", r.2);
        assert!(r.2.contains(&format!("CPU variant {variant} (of cpu:x86-64-v2, cpu:x86-64-v3, cpu:x86-64-v4)")), "{variant}: {}", r.2);
        assert_eq!(r.1, case["greedy_text"].as_str().unwrap(), "{variant}: greedy text");
        let r = run_bin_env("maxrun", &[os("inspect"), mef.as_os_str(), os("--json")], &env);
        let v: Value = serde_json::from_str(&r.1).unwrap();
        let selected: Vec<&str> = v["cpu_variants"].as_array().unwrap().iter().filter(|v| v["selected"] == true).map(|v| v["spec"].as_str().unwrap()).collect();
        assert_eq!(selected, [variant]);
        for (i, case) in cases(&golden).iter().enumerate() {
            assert_logits_close(&format!("{variant} case {i}"), &dump_logits_env(&mef, case, &[], &env).1, &golden_logits("smollm2-135m", case).1);
        }
    }
    // A CPU below every variant (no SSE4.2) is refused, naming what each lacks.
    let r = run_bin_env("maxrun", &[mef.as_os_str(), os("--prompt"), os("hi")], &[("MAXRUN_DISABLE_CPU_FEATURES", "sse4.2")]);
    assert_clean_error(&r, 1, &["none of the artifact's CPU variants runs on this machine", "cpu:x86-64-v2 needs sse4.2", "cpu:x86-64-v4 needs", "--target cpu"]);
}

/// Every variant in a list is checked; the cranelift backend has one, and so
/// does an artifact with GPU code (its PTX is the first variant's kernels).
#[test]
fn bad_variant_lists_are_refused() {
    let model = smollm2_gguf();
    let compile = |target: &str, extra: &[&str]| {
        let out = temp_file("bad-variants", "m.mef");
        let mut args = vec![os("compile"), os("--model"), model.as_os_str(), os("-o"), out.as_os_str(), os("--target"), os(target)];
        args.extend(extra.iter().map(|e| os(e)));
        let r = run_bin("maxc", &args);
        assert!(!out.exists(), "{target}: nothing written");
        r
    };
    assert_clean_error(&compile("cpu:x86-64-v3,x86-64-v3", &[]), 1, &["listed twice"]);
    assert_clean_error(&compile("cpu:x86-64-v3,x86-64-v9", &[]), 1, &["x86-64-v9", "known CPU names"]);
    assert_clean_error(&compile("cpu:x86-64-v2,x86-64-v3", &["--backend", "cranelift"]), 1, &["cranelift", "several CPU variants", "--backend llvm"]);
    assert_clean_error(&compile("cpu:x86-64-v3,x86-64-v4,cuda:sm_90", &[]), 1, &["GPU code takes one CPU variant", "separately"]);
}

/// A multi-ISA artifact is reproducible like any other, and every variant's
/// code is under its checksum: a flipped byte in a variant this machine would
/// not even run is refused at load.
#[test]
fn variant_code_is_reproducible_and_checked() {
    let mef = compile_model("variants-repro", &fixture("tiny-llama"), &["--target", "cpu:x86-64-v3,x86-64-v4", "--check-reproducible"]);
    let v = inspect_json(&mef);
    let sections = v["sections"].as_array().unwrap();
    let variant = sections.iter().find(|s| s["kind"] == "VariantCode(0)").expect("the second variant's code section");
    let mut bytes = std::fs::read(&mef).unwrap();
    let at = (variant["offset"].as_u64().unwrap() + variant["bytes"].as_u64().unwrap() / 2) as usize;
    bytes[at] ^= 0x40;
    let bad = temp_file("variants-bad", "bad.mef");
    std::fs::write(&bad, &bytes).unwrap();
    for env in ["", "avx512f"] {
        let r = run_bin_env("maxrun", &[bad.as_os_str(), os("--prompt"), os("hi")], &[("MAXRUN_DISABLE_CPU_FEATURES", env)]);
        assert_clean_error(&r, 1, &["VariantCode(0) section checksum mismatch", "recompile"]);
    }
}
