//! Artifact integrity: checksums on every section, truncation, versions, CPU
//! features, `maxrun inspect`, and `maxc check`.

use std::ffi::OsStr;
use std::path::Path;
use std::sync::OnceLock;

use maxc_tests::*;
use maxrun_runtime::format::SectionKind;

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

fn tiny_artifact() -> &'static Path {
    static A: OnceLock<TempPath> = OnceLock::new();
    A.get_or_init(|| {
        let out = temp_file("trust", "tiny.mef");
        let r = run_bin("maxc", &[os("compile"), os("--model"), fixture("tiny-llama").as_os_str(), os("-o"), out.as_os_str()]);
        assert_eq!(r.0, 0, "{}", r.2);
        out
    })
}

fn write_variant(tag: &str, bytes: &[u8]) -> TempPath {
    let p = temp_file(tag, "variant.mef");
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Runs the artifact (every section verified by default) and expects a clean
/// refusal naming `what`, with nothing printed on stdout.
fn expect_refused(p: &Path, what: &[&str]) {
    let r = run_bin("maxrun", &[p.as_os_str(), os("--token-ids"), os("1,2,3"), os("-n"), os("1")]);
    assert_ne!(r.0, 0, "accepted a damaged artifact: {}", r.2);
    assert_ne!(r.0, 101, "panicked: {}", r.2);
    assert_clean_error(&r, r.0, what);
    assert_eq!(r.1, "", "printed output from a damaged artifact");
}

/// The weights are verified by default: a byte flipped at any of 10 places
/// across the weights section is refused before any token is printed (exit 1,
/// naming the section), on the README's SmolLM2 artifact as on the tiny one;
/// `--no-verify` skips the check (and runs on the damaged weights).
#[test]
fn byte_flips_across_the_weights_are_refused_by_default() {
    let smollm2 = temp_file("trust-smollm2", "smollm2.mef");
    let manifest = workspace_root().join("manifests/smollm2-135m.toml");
    let r = run_bin("maxc", &[os("compile"), manifest.as_os_str(), os("-o"), smollm2.as_os_str(), os("--quiet")]);
    assert_eq!(r.0, 0, "{}", r.2);
    for artifact in [tiny_artifact(), smollm2.as_path()] {
        let good = std::fs::read(artifact).unwrap();
        let header = maxrun_runtime::artifact::Artifact::open(artifact).unwrap().header;
        let w = header.sections.iter().find(|s| s.kind == SectionKind::Weights(0)).unwrap();
        let p = temp_file("flip-weights", "variant.mef");
        for k in 0..10u64 {
            let at = (w.offset + (w.len - 1) * k / 9) as usize;
            let mut bad = good.clone();
            bad[at] ^= 1 << (k % 8);
            std::fs::write(&p, &bad).unwrap();
            let r = run_bin("maxrun", &[p.as_os_str(), os("--prompt"), os("Once upon a time"), os("-n"), os("4")]);
            assert_clean_error(&r, 1, &["Weights(0) section", "checksum mismatch"]);
            assert_eq!(r.1, "", "flip {k} at byte {at}: printed output from damaged weights");
        }
        let r = run_bin("maxrun", &[p.as_os_str(), os("--prompt"), os("Once upon a time"), os("-n"), os("4"), os("--no-verify")]);
        assert_eq!(r.0, 0, "--no-verify runs: {}", r.2);
    }
    drop(std::fs::remove_file(&smollm2));
}

#[test]
fn a_flipped_byte_in_any_section_is_refused_naming_it() {
    let good = std::fs::read(tiny_artifact()).unwrap();
    let header = maxrun_runtime::artifact::Artifact::open(tiny_artifact()).unwrap().header;
    for s in &header.sections {
        let mut bad = good.clone();
        let at = (s.offset + s.len / 2) as usize;
        bad[at] ^= 0x40;
        let p = write_variant(&format!("flip-{:?}", s.kind), &bad);
        let name = format!("{:?} section", s.kind);
        expect_refused(&p, &[&name, "checksum mismatch", "expected", "found"]);
        if s.kind == SectionKind::Weights(0) {
            // inspect reads only the header unless asked to verify.
            let r = run_bin("maxrun", &[os("inspect"), p.as_os_str(), os("--verify")]);
            assert_clean_error(&r, 1, &["Weights(0) section", "checksum mismatch"]);
        }
    }
    // The header itself.
    let mut bad = good.clone();
    bad[maxrun_runtime::format::PRELUDE_LEN + 40] ^= 0x01;
    expect_refused(&write_variant("flip-header", &bad), &["header checksum mismatch"]);
}

#[test]
fn truncation_anywhere_is_refused() {
    let good = std::fs::read(tiny_artifact()).unwrap();
    for i in 0..10 {
        let cut = good.len() * i / 10 + 7;
        let p = write_variant(&format!("cut{i}"), &good[..cut]);
        expect_refused(&p, &["variant.mef"]);
    }
}

#[test]
fn higher_major_version_is_refused_naming_both_versions() {
    let mut bad = std::fs::read(tiny_artifact()).unwrap();
    let major = maxrun_runtime::format::FORMAT_MAJOR + 1;
    bad[8..12].copy_from_slice(&major.to_le_bytes());
    bad[12..16].copy_from_slice(&3u32.to_le_bytes());
    let p = write_variant("major", &bad);
    expect_refused(&p, &[&format!("format {major}.3"), &format!("format {}.{}", maxrun_runtime::format::FORMAT_MAJOR, maxrun_runtime::format::FORMAT_MINOR), "recompile"]);
}

#[test]
fn avx512_artifact_on_a_machine_without_it_is_refused() {
    let out = temp_file("v4", "v4.mef");
    let r = run_bin("maxc", &[os("compile"), os("--model"), fixture("tiny-llama").as_os_str(), os("-o"), out.as_os_str(), os("--target"), os("cpu:x86-64-v4")]);
    assert_eq!(r.0, 0, "{}", r.2);
    let r = run_bin_env("maxrun", &[out.as_os_str(), os("--prompt"), os("hi")], &[("MAXRUN_DISABLE_CPU_FEATURES", "avx512f")]);
    assert_clean_error(&r, 1, &["CPU features this machine lacks", "avx512f"]);
}

#[test]
fn inspect_json_reports_everything() {
    let r = run_bin("maxrun", &[os("inspect"), tiny_artifact().as_os_str(), os("--json"), os("--verify")]);
    assert_eq!(r.0, 0, "{}", r.2);
    let v: serde_json::Value = serde_json::from_str(&r.1).expect("inspect --json prints JSON");
    assert_eq!(v["format"]["major"], maxrun_runtime::format::FORMAT_MAJOR);
    assert_eq!(v["model"]["architecture"], "LlamaForCausalLM");
    assert_eq!(v["model"]["num_layers"], 2);
    assert_eq!(v["verified"], true);
    let p = &v["provenance"];
    assert_eq!(p["build_id"].as_str().unwrap().len(), 32);
    assert!(p["inputs"].as_array().unwrap().iter().any(|i| i["path"].as_str().unwrap().ends_with("model.safetensors")));
    assert_eq!(v["memory"]["kv_bytes_per_token"], 2 * 2 * 2 * 16 * 4, "layers * (k, v) * kv_heads * head_dim * f32");
    assert!(v["kernels"]["count"].as_u64().unwrap() > 5);
    assert_eq!(v["sections"].as_array().unwrap().len(), 4);
    let plans = &v["sub_models"][0]["plans"];
    assert_eq!(plans["decode"]["max_seq"], 1);
    assert_eq!(plans["prefill"]["outputs"][0]["shape"][1], 49152);
}

#[test]
fn check_lists_every_problem_at_once() {
    // A checkpoint missing two weights, asked for a mesh of 3 devices (which do not
    // divide its 160 MLP features).
    let dir = temp_dir("check");
    let src = fixture("tiny-llama");
    for f in ["config.json", "tokenizer.json"] {
        std::os::unix::fs::symlink(src.join(f), dir.join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    for name in ["model.norm.weight", "model.layers.0.mlp.up_proj.weight"] {
        let v = header.as_object_mut().unwrap().remove(name).unwrap();
        header[format!("{name}.renamed")] = v;
    }
    let h = header.to_string();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h.as_bytes());
    out.extend(&bytes[8 + n..]);
    std::fs::write(dir.join("model.safetensors"), out).unwrap();
    let r = run_bin("maxc", &[os("check"), os("--model"), dir.as_os_str(), os("--model-override"), os("transformer.devices=cpu:0,1,2")]);
    // Two missing, the same two under their new names unused, and the mesh.
    assert_clean_error(&r, 1, &["5 problem(s)"]);
    for needle in ["model.norm.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight.renamed: the checkpoint has this tensor", "compile.devices", "intermediate_size is 160"] {
        assert!(r.1.contains(needle), "check output lacks {needle}: {}", r.1);
    }
    let r = run_bin("maxc", &[os("check"), os("--model"), fixture("tiny-qwen2").as_os_str()]);
    assert_eq!(r.0, 0, "{}{}", r.1, r.2);
    assert!(r.1.starts_with("ok"));
}

/// `--check-nan` names the first kernel whose output is not finite: a NaN planted
/// in the final norm's weight surfaces in the final rms_norm, not earlier.
#[test]
fn check_nan_names_the_first_bad_kernel() {
    let good = std::fs::read(tiny_artifact()).unwrap();
    let header = maxrun_runtime::artifact::Artifact::open(tiny_artifact()).unwrap().header;
    let weights = header.sections.iter().find(|s| s.kind == SectionKind::Weights(0)).unwrap();
    let entry = header.weights.iter().find(|w| w.name == "model.norm.weight").unwrap();
    let at = (weights.offset + entry.offset) as usize;
    let mut bad = good.clone();
    bad[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    let p = write_variant("nan", &bad);
    let r = run_bin("maxrun", &[p.as_os_str(), os("--prompt"), os("Once upon a time"), os("-n"), os("2"), os("--check-nan"), os("--no-verify")]);
    assert_clean_error(&r, 1, &["--check-nan", "rms_norm_h64", "prefill plan", "NaN"]);
    // The prompt runs the last-token prefill plan (what generation needs).
    let plan = header.main().prefill_last.as_ref().unwrap();
    let last_rms = plan.launches.iter().rposition(|l| header.kernels[l.kernel as usize].family == "rms_norm").unwrap();
    assert!(r.2.contains(&format!("launch {last_rms} ")), "{}", r.2);
    // Without the flag the run goes on (past --no-verify: the checksum would
    // refuse the changed bytes).
    let r = run_bin("maxrun", &[p.as_os_str(), os("--prompt"), os("Once upon a time"), os("-n"), os("2"), os("--no-verify")]);
    assert_eq!(r.0, 0, "{}", r.2);
    let r = run_bin("maxrun", &[p.as_os_str(), os("--prompt"), os("Once upon a time"), os("-n"), os("2")]);
    assert_clean_error(&r, 1, &["Weights(0) section", "checksum mismatch"]);
}

/// Every CPU feature `--target` accepts is one maxrun can check at load, and
/// an unknown one is refused by maxc with the list.
#[test]
fn target_features_are_the_ones_maxrun_can_check() {
    for f in maxc_codegen::target::KNOWN_FEATURES {
        assert!(maxrun_runtime::cpu::is_checkable(f) && maxrun_runtime::cpu::X86_64_FEATURES.contains(f), "--target accepts `{f}`, which maxrun cannot check");
    }
    // `cpu:aarch64+F`: what an aarch64 maxrun checks (tests/tests/aarch64.rs runs one).
    for f in maxc_codegen::target::KNOWN_AARCH64_FEATURES {
        assert!(maxrun_runtime::cpu::is_checkable(f) && maxrun_runtime::cpu::AARCH64_FEATURES.contains(f), "--target cpu:aarch64 accepts `{f}`, which maxrun cannot check on ARM");
    }
    let out = temp_file("feat", "x.mef");
    let r = run_bin("maxc", &[os("compile"), os("--model"), fixture("tiny-llama").as_os_str(), os("-o"), out.as_os_str(), os("--target"), os("cpu:x86-64+nosuchfeat")]);
    assert_clean_error(&r, 1, &["unknown CPU feature `nosuchfeat`", "avx2"]);
    assert!(!out.exists());
}
