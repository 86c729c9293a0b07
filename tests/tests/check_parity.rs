//! `maxc check` and `maxc compile` resolve the configuration through the same
//! code (`compile_config`), so they refuse the same inputs with the same words:
//! each case below is run through both, and compile's error must be one of
//! check's problems, word for word.

use std::ffi::OsString;

use maxc_tests::*;

/// Runs `maxc SUBCOMMAND ARGS` (compile gets `-o` into a fresh directory).
fn maxc(subcommand: &str, args: &[OsString]) -> (i32, String, String) {
    let mut all = vec![OsString::from(subcommand)];
    all.extend_from_slice(args);
    let out = temp_file("parity-out", "out.mef");
    if subcommand == "compile" {
        all.extend([OsString::from("-o"), out.as_os_str().to_owned()]);
    }
    let refs: Vec<&std::ffi::OsStr> = all.iter().map(OsString::as_os_str).collect();
    run_bin("maxc", &refs)
}

#[test]
fn check_and_compile_refuse_the_same_inputs_alike() {
    let model = fixture("tiny-llama");
    let m = model.clone().into_os_string();
    let dir = temp_dir("parity");
    let manifest = |name: &str, compile: &str| -> OsString {
        let p = dir.join(format!("{name}.toml"));
        std::fs::write(&p, format!("[model]\npath = {:?}\n[compile]\n{compile}\n", model.display().to_string())).unwrap();
        p.into_os_string()
    };
    // A tiny-llama whose config names a BOS outside the vocabulary (a run-time
    // input that compile checks up front).
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    config["bos_token_id"] = serde_json::json!(99999);
    let bad_bos = fixture_with("tiny-llama", "parity-bos", &[("config.json", config.to_string())]);

    let with_model = |flags: &[&str]| -> Vec<OsString> {
        let mut v = vec![OsString::from("--model"), m.clone()];
        v.extend(flags.iter().map(OsString::from));
        v
    };
    let cases: Vec<(&str, Vec<OsString>, &str)> = vec![
        ("unknown encoding", with_model(&["--quantization-encoding", "q3"]), "--quantization-encoding"),
        ("stored embeddings", with_model(&["--embedding-encoding", "stored"]), "--embedding-encoding"),
        ("unknown activation encoding", with_model(&["--activation-encoding", "int9"]), "--activation-encoding"),
        ("unknown KV encoding", with_model(&["--kv-cache-encoding", "int4"]), "--kv-cache-encoding"),
        ("unknown CPU feature", with_model(&["--target", "cpu:x86-64+nosuchfeat"]), "nosuchfeat"),
        ("integer activations with GPU code", with_model(&["--target", "cuda:sm_90", "--activation-encoding", "int8"]), "CPU kernels only"),
        ("integer activations on float weights", with_model(&["--activation-encoding", "int8"]), "not a block encoding"),
        ("unknown backend", with_model(&["--backend", "gcc"]), "--backend"),
        ("cranelift on a tuned target", with_model(&["--backend", "cranelift", "--target", "cpu:x86-64-v3"]), "baseline x86-64"),
        ("cranelift without CPU code", with_model(&["--backend", "cranelift", "--target", "cuda:sm_90"]), "no CPU part"),
        ("unknown device kind", with_model(&["--devices", "tpu:0"]), "--devices"),
        ("GPU mesh without GPU code", with_model(&["--devices", "gpu:0,1"]), "needs GPU code"),
        ("CPU mesh without CPU code", with_model(&["--devices", "cpu", "--target", "cuda:sm_90"]), "needs CPU code"),
        ("mesh that does not divide the MLP", with_model(&["--devices", "cpu:0,1,2"]), "intermediate_size is 160"),
        ("heads that do not split", with_model(&["--devices", "cpu:0,1,2,3", "--attention-sharding", "heads"]), "num_key_value_heads is 2"),
        ("unknown attention policy", with_model(&["--attention-sharding", "rows"]), "--attention-sharding"),
        ("zero sequences per step", with_model(&["--max-sequences", "0"]), "--max-sequences"),
        ("fewer rows than sequences", with_model(&["--max-batch-tokens", "4", "--max-sequences", "8"]), "--max-sequences = 8"),
        ("batch rows below the sequences", vec![manifest("batch", "max_batch_tokens = 4\nmax_sequences = 8")], "compile.max_batch_tokens"),
        ("unknown target in the manifest", vec![manifest("target", "target = \"arm64\"")], "compile.target"),
        ("override with a bad value", with_model(&["--model-override", "transformer.kv_cache_encoding=int4"]), "compile.kv_cache_encoding"),
        ("BOS outside the vocabulary", vec![OsString::from("--model"), bad_bos.as_os_str().to_owned()], "bos_token_id"),
    ];
    assert!(cases.len() >= 15);
    let mut failures = Vec::new();
    for (what, args, needle) in &cases {
        let c = maxc("compile", args);
        let k = maxc("check", args);
        let compile_error = c.2.lines().find_map(|l| l.strip_prefix("error: ")).unwrap_or_default().to_string();
        let problems: Vec<&str> = k.1.lines().filter_map(|l| l.strip_prefix("problem: ")).collect();
        let ok = c.0 == 1
            && k.0 == 1
            && compile_error.contains(needle)
            && problems.contains(&compile_error.as_str())
            && !c.2.contains("panicked")
            && !k.2.contains("panicked");
        if !ok {
            failures.push(format!("{what}: compile exit {} `{compile_error}`; check exit {} problems {problems:?} {}", c.0, k.0, k.2));
        }
    }
    assert!(failures.is_empty(), "{} of {} cases differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
}
