//! Every example manifest in manifests/ parses; those whose model is present compile.

use maxc::driver::frontend;
use maxc::manifest::LoadedManifest;
use maxc::passes::PipelineOptions;
use maxc_tests::workspace_root;

#[test]
fn example_manifests_parse_and_local_ones_build() {
    let dir = workspace_root().join("manifests");
    let mut built = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let m = LoadedManifest::from_file(&path, &[]).unwrap_or_else(|e| panic!("{e}"));
        if m.manifest.model.path.exists() {
            let fe = frontend(m, &PipelineOptions::default()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(fe.graph.count("attention") > 0);
            built += 1;
        }
    }
    assert!(built >= 3, "the fixture and SmolLM2 manifests must build");
}

/// Every `[compile]` key is also a flag (one struct is both): the numeric ones
/// reach the artifact as the keys do.
#[test]
fn numeric_compile_keys_are_flags_too() {
    use std::ffi::OsStr;
    let out = maxc_tests::temp_file("compile-key-flags", "flags.mef");
    let model = maxc_tests::fixture("tiny-llama");
    let args = [OsStr::new("compile"), OsStr::new("--model"), model.as_os_str(), OsStr::new("-o"), out.as_os_str(), OsStr::new("--no-cache"), OsStr::new("-q")];
    let flags = ["--max-length", "64", "--max-sequences", "2", "--max-batch-tokens", "32"].map(OsStr::new);
    let (code, _, err) = maxc_tests::run_bin("maxc", &[&args[..], &flags[..]].concat());
    assert_eq!(code, 0, "{err}");
    let v = maxc_tests::inspect_json(&out);
    let batch = &v["batch"];
    assert_eq!((batch["max_sequences"].as_u64(), batch["max_batch_tokens"].as_u64()), (Some(2), Some(32)), "{batch}");
    assert_eq!(v["memory"]["max_length"].as_u64(), Some(64), "{}", v["memory"]);
}
