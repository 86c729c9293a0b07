//! End to end through the real binaries: `maxc compile` -> `maxrun`, compared with
//! the Hugging Face golden logits and greedy texts.

use std::ffi::OsStr;
use std::path::Path;
use std::sync::OnceLock;

use maxc_tests::*;

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}


fn artifact(fixture_name: &str) -> &'static Path {
    static ARTIFACTS: OnceLock<std::sync::Mutex<std::collections::HashMap<String, &'static Path>>> = OnceLock::new();
    let map = ARTIFACTS.get_or_init(Default::default);
    let mut map = map.lock().unwrap();
    map.entry(fixture_name.to_string())
        .or_insert_with(|| {
            let model = if fixture_name == "smollm2-135m" { smollm2_gguf() } else { fixture(fixture_name) };
            // float32 weights, the exact path (a GGUF's default keeps its Q4_1
            // blocks: the default-manifest and stored-encoding tests cover that).
            Box::leak(Box::new(compile_model(fixture_name, &model, &["--quantization-encoding", "float32"]))).as_path()
        })
}

/// Compares the logits and the exact greedy text of every case.
fn check_golden(fixture_name: &str) {
    let mef = artifact(fixture_name);
    let golden = golden(fixture_name);
    for (i, case) in cases(&golden).iter().enumerate() {
        let what = format!("{fixture_name} case {i}");
        let (shape, ours) = dump_logits(mef, case);
        let (gshape, gold) = golden_logits(fixture_name, case);
        assert_eq!(shape, gshape, "{what}");
        assert_logits_close(&what, &ours, &gold);

        let prompt = case["prompt"].as_str().unwrap();
        // The golden runs generated 24 tokens with end-of-sequence suppressed. For the
        // arch-* models (where EOS can win a near tie) --ignore-eos does the same; the
        // others must print the text with the plain command line.
        let mut args = vec![mef.as_os_str(), os("--prompt"), os(prompt), os("--temperature"), os("0"), os("-n"), os("24")];
        if fixture_name.starts_with("arch-") {
            args.push(os("--ignore-eos"));
        }
        let r = run_bin("maxrun", &args);
        assert_eq!(r.0, 0, "{what}: {}", r.2);
        assert_eq!(r.1, case["greedy_text"].as_str().unwrap(), "{what}: greedy text");
    }
}

#[test]
fn tiny_llama_matches_golden() {
    check_golden("tiny-llama");
}

/// `--prompt` is tokenized as `transformers`' `tokenizer(text)`: with what the
/// tokenizer's post-processor adds. tiny-llama's tokenizer.json is given a
/// Llama-3-style post-processor that prepends its BOS; the prompt's logits must
/// then be those of `--token-ids BOS,<golden ids>` exactly, and
/// `--no-special-tokens` gives back the golden logits of the bare ids.
#[test]
fn prompts_get_the_special_tokens_the_tokenizer_adds() {
    let src = fixture("tiny-llama");
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let bos = config["bos_token_id"].as_u64().unwrap() as u32;
    let mut tokenizer: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer.json")).unwrap()).unwrap();
    let bos_text = tokenizer["added_tokens"].as_array().unwrap().iter().find(|t| t["id"] == bos).unwrap()["content"].as_str().unwrap().to_string();
    tokenizer["post_processor"] = serde_json::json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos_text, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos_text, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos_text.clone(): {"id": bos_text, "ids": [bos], "tokens": [bos_text]}},
    });
    let dir = fixture_with("tiny-llama", "bos-tokenizer", &[("tokenizer.json", tokenizer.to_string())]);
    let mef = compile_model("bos-tokenizer", &dir, &["--quantization-encoding", "float32"]);
    let golden = golden("tiny-llama");
    let case = &cases(&golden)[0];
    let prompt = case["prompt"].as_str().unwrap();
    let dump = |extra: &[&str]| {
        let npy = temp_file("bos-logits", "l.npy");
        let mut args = vec![mef.as_os_str(), os("--prompt"), os(prompt), os("--dump-logits"), npy.as_os_str()];
        args.extend(extra.iter().map(|e| os(e)));
        let r = run_bin("maxrun", &args);
        assert_eq!(r.0, 0, "{}", r.2);
        maxrun_runtime::npy::read_f32(&npy).unwrap()
    };
    let with_bos = dump(&[]);
    let mut ids = vec![bos];
    ids.extend(self::ids(&case["input_ids"]));
    let explicit = dump_logits(&mef, &serde_json::json!({ "input_ids": ids }));
    assert_eq!(with_bos.0, explicit.0, "--prompt starts with the BOS the post-processor adds");
    assert_eq!(with_bos.1, explicit.1);
    let bare = dump(&["--no-special-tokens"]);
    let (gshape, gold) = golden_logits("tiny-llama", case);
    assert_eq!(bare.0, gshape, "--no-special-tokens: the bare ids");
    assert_logits_close("--no-special-tokens", &bare.1, &gold);
}

#[test]
fn tiny_qwen2_matches_golden() {
    check_golden("tiny-qwen2");
}

#[test]
fn smollm2_from_gguf_matches_golden() {
    check_golden("smollm2-135m");
}

/// A GGUF of Q5_1 blocks (SmolLM2 rewritten losslessly, so it holds the golden
/// values) compiles both ways to the golden logits, within the fixtures'
/// float32 tolerance: dequantized exactly at import into float32 weights, and
/// kept as its own blocks by `--quantization-encoding q5_1` (every matrix q5_1,
/// fifth bits and all, run by the interleaved integer kernels with the default
/// int16 activations), and by float activations on the row-major block kernels.
#[test]
fn gguf_q5_1_blocks_import_exactly_and_run_as_stored() {
    let gguf = smollm2_as_q5_1();
    let golden = golden("smollm2-135m");
    for (encoding, activations) in [("float32", "float32"), ("q5_1", "int16"), ("q5_1", "float32")] {
        let mef = temp_file("smollm2-q5_1-mef", "model.mef");
        let r = run_bin("maxc", &[os("compile"), os("--model"), gguf.as_os_str(), os("-o"), mef.as_os_str(), os("--quantization-encoding"), os(encoding), os("--activation-encoding"), os(activations)]);
        assert_eq!(r.0, 0, "{}", r.2);
        // Blocks with kernels are not worth a note, whatever the encoding asked for.
        assert!(!r.2.contains("Q5_1 matrices"), "{}", r.2);
        let by = inspect_json(&mef)["weights"]["by_encoding"].clone();
        if encoding == "q5_1" {
            // Every linear layer (stacked: 4 per layer) is q5_1; the embedding stays the file's Q8_0, norms float32.
            assert_eq!(by["q5_1"]["tensors"].as_u64(), Some(4 * 30), "{by}");
            assert_eq!(by["q8_0"]["tensors"].as_u64(), Some(1), "{by}");
            assert!(by.as_object().unwrap().keys().all(|k| ["q5_1", "q8_0", "float32"].contains(&k.as_str())), "{by}");
        }
        for (i, case) in cases(&golden).iter().enumerate() {
            let (shape, ours) = dump_logits(&mef, case);
            let (gshape, gold) = golden_logits("smollm2-135m", case);
            assert_eq!(shape, gshape);
            assert_logits_close(&format!("Q5_1 GGUF as {encoding} with {activations} activations, case {i}"), &ours, &gold);
        }
    }
}

/// Sampling through the binary: filters that leave one token (top-k 1, top-p 0,
/// min-p 1) give the golden greedy text at any temperature and seed; a seed
/// reproduces its text; different seeds at temperature 1 do not all agree.
#[test]
fn sampling_filters_seeds_and_the_greedy_limit() {
    let mef = artifact("smollm2-135m");
    let golden = golden("smollm2-135m");
    let case = &cases(&golden)[0];
    let prompt = case["prompt"].as_str().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec![mef.as_os_str(), os("--prompt"), os(prompt), os("-n"), os("24")];
        args.extend(extra.iter().map(|a| os(a)));
        let r = run_bin("maxrun", &args);
        assert_eq!(r.0, 0, "{extra:?}: {}", r.2);
        r.1
    };
    for filter in [&["--top-k", "1"][..], &["--top-p", "0"], &["--min-p", "1"]] {
        let args: Vec<&str> = ["--temperature", "1.5", "--seed", "9"].iter().chain(filter).copied().collect();
        assert_eq!(run(&args), case["greedy_text"].as_str().unwrap(), "{filter:?} leaves the most likely token alone");
    }
    let sampled = |seed: &str| run(&["--temperature", "1", "--top-p", "0.95", "--seed", seed]);
    let texts: Vec<String> = ["1", "2", "3", "4"].into_iter().map(sampled).collect();
    assert_eq!(sampled("1"), texts[0], "a seed reproduces its text");
    assert!(texts.iter().any(|t| t != &texts[0]), "four seeds at temperature 1 drew the same text: {texts:?}");
}

/// The README's main job (`scripts/run.sh`) compiles manifests/smollm2-135m.toml,
/// which keeps the GGUF's Q4_1 blocks: every linear layer stays Q4_1 (no float32
/// copy, no requantization), and since those blocks are what the golden reference
/// dequantized, logits and greedy texts still match the golden ones, with the
/// manifest's f16 KV cache too.
#[test]
fn default_manifest_keeps_q4_1_blocks_and_matches_golden() {
    let manifest = workspace_root().join("manifests/smollm2-135m.toml");
    let mef = temp_file("default-manifest", "model.mef");
    let r = run_bin("maxc", &[os("compile"), manifest.as_os_str(), os("-o"), mef.as_os_str(), os("--quiet")]);
    assert_eq!(r.0, 0, "{}", r.2);
    let v = inspect_json(&mef);
    let by_encoding = &v["weights"]["by_encoding"];
    // The linear layers in Q4_1, the tied embedding / lm_head in Q8_0 (the file's).
    assert_eq!(by_encoding["q8_0"]["tensors"].as_u64(), Some(1), "{by_encoding}");
    assert!(by_encoding["q4_1"]["tensors"].as_u64().unwrap() > 0, "{by_encoding}");
    assert!(by_encoding.get("float32").is_none_or(|f| f["bytes"].as_u64().unwrap() < 1 << 20), "only small tensors stay float32: {by_encoding}");
    assert!(v["file_bytes"].as_u64().unwrap() < 110 << 20, "a 4-bit artifact, not float32's 515 MiB");
    assert_eq!(v["memory"]["kv_encoding"], "float16", "{}", v["memory"]);
    let golden = golden("smollm2-135m");
    for (i, case) in cases(&golden).iter().enumerate() {
        let what = format!("default manifest case {i}");
        assert_logits_close(&what, &dump_logits(&mef, case).1, &golden_logits("smollm2-135m", case).1);
        let r = run_bin("maxrun", &[mef.as_os_str(), os("--prompt"), os(case["prompt"].as_str().unwrap()), os("-n"), os("24")]);
        assert_eq!(r.0, 0, "{what}: {}", r.2);
        assert_eq!(r.1, case["greedy_text"].as_str().unwrap(), "{what}: greedy text");
    }
}

/// The chat golden's prompt ids, run as a plain prompt: the golden answer, ended
/// by its end-of-sequence token, which is counted but not printed (as in chat
/// replies and llama.cpp; the golden text keeps it as `<|im_end|>`).
#[test]
fn smollm2_answers_the_chat_case() {
    let mef = artifact("smollm2-135m");
    let golden = golden("smollm2-135m");
    let chat = &golden["chat"];
    let ids: Vec<String> = maxc_tests::ids(&chat["input_ids"]).iter().map(u32::to_string).collect();
    let r = run_bin("maxrun", &[mef.as_os_str(), os("--token-ids"), os(&ids.join(",")), os("--temperature"), os("0"), os("-n"), os("64")]);
    assert_eq!(r.0, 0, "{}", r.2);
    let golden_text = chat["greedy_text"].as_str().unwrap();
    assert!(golden_text.ends_with("<|im_end|>"), "the golden answer ends with the end token");
    assert_eq!(r.1, golden_text.trim_end_matches("<|im_end|>"), "stops at <|im_end|> with the golden answer, without printing it");
    let generated = chat["greedy_ids"].as_array().unwrap().len();
    assert!(r.2.contains(&format!("generated: {generated} tokens")), "{}", r.2);
}

/// Decode costs O(1) tokens: 64 generated tokens are one prefill and 63 decode steps.
#[test]
fn decode_runs_one_token_per_step() {
    let mef = artifact("tiny-llama");
    let r = run_bin("maxrun", &[mef.as_os_str(), os("--prompt"), os("Once upon a time"), os("-n"), os("64"), os("--ignore-eos")]);
    assert_eq!(r.0, 0, "{}", r.2);
    assert!(r.2.contains("generated: 64 tokens"), "{}", r.2);
    assert!(r.2.contains("plan runs: prefill 1, decode 63"), "{}", r.2);
}

/// With stdout and stderr in one file (`> log 2>&1`), the figures on stderr
/// start a line of their own after text that ends mid-line; on separate pipes
/// stdout is exactly the generated text, with no line end added.
#[test]
fn the_figures_start_a_line_of_their_own() {
    let mef = artifact("tiny-llama");
    let args = [mef.as_os_str(), os("--prompt"), os("Once upon a time"), os("-n"), os("8"), os("--ignore-eos")];
    let alone = run_bin("maxrun", &args);
    assert_eq!(alone.0, 0, "{}", alone.2);
    assert!(!alone.1.is_empty() && !alone.1.ends_with('\n'), "this prompt's 8 tokens end mid-line: {:?}", alone.1);
    let log = temp_file("figures-line", "both.log");
    let file = std::fs::File::create(&log).unwrap();
    let status = std::process::Command::new(bin("maxrun"))
        .args(args)
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .status()
        .unwrap();
    assert!(status.success());
    let both = std::fs::read_to_string(&log).unwrap();
    let stats = both.lines().find(|l| l.contains("tok/s")).unwrap_or_else(|| panic!("no figures in {both:?}"));
    assert!(stats.starts_with("prompt: "), "the figures share a line with the text: {both:?}");
    assert!(both.starts_with(&alone.1), "stdout's text comes first, unchanged: {both:?}");
}

#[test]
fn prompt_too_long_fails_before_any_work() {
    let mef = compile_model("short", &fixture("tiny-llama"), &["--model-override", "transformer.max_length=8"]);
    let r = run_bin("maxrun", &[mef.as_os_str(), os("--token-ids"), os("1,2,3,4,5,6,7,8,9")]);
    assert_eq!(r.0, 3, "{}", r.2);
    // Exit codes apart: a usage error is clap's 2, another error 1.
    assert_eq!(run_bin("maxrun", &[mef.as_os_str(), os("--no-such-flag")]).0, 2);
    assert_eq!(run_bin("maxrun", &[mef.as_os_str(), os("--prompt"), os("hi"), os("--top-p"), os("7")]).0, 1);
    assert_eq!(r.2.trim(), "prompt is too long: 9 tokens exceeds the maximum context length of 8 tokens");
    // Generation stops at the context limit instead of overrunning the cache.
    let r = run_bin("maxrun", &[mef.as_os_str(), os("--token-ids"), os("1,2,3,4,5,6"), os("-n"), os("10"), os("--ignore-eos")]);
    assert_eq!(r.0, 0, "{}", r.2);
    assert!(r.2.contains("generated: 2 tokens"), "{}", r.2);
}

#[test]
fn missing_cpu_feature_is_refused_by_name() {
    // A machine without AVX2 (rehearsed: maxrun treats the named features as absent).
    let mef = compile_model("feature", &fixture("tiny-llama"), &["--target", "cpu:x86-64-v3"]);
    let r = run_bin_env("maxrun", &[mef.as_os_str(), os("--prompt"), os("hi")], &[("MAXRUN_DISABLE_CPU_FEATURES", "avx2,fma")]);
    assert_clean_error(&r, 1, &["needs CPU features this machine lacks", "avx2", "fma", "--target"]);
}

/// An AVX2 artifact matches the golden logits, with its prefill panel matmuls in
/// the AVX2 register tile (`_t4x1`: 4 rows x 1 panel) and an AVX-512 one in the
/// AVX-512 float panel tile (`_t8x2`); steps of few rows take one panel of
/// the same rows (`_f4x1`, `_f8x1`).
#[test]
fn portable_target_runs_and_matches() {
    let mef = compile_model("v3", &fixture("tiny-qwen2"), &["--target", "cpu:x86-64-v3"]);
    let golden = golden("tiny-qwen2");
    let case = &cases(&golden)[1];
    assert_logits_close("x86-64-v3", &dump_logits(&mef, case).1, &golden_logits("tiny-qwen2", case).1);
    let v4 = compile_model("v4", &fixture("tiny-qwen2"), &["--target", "cpu:x86-64-v4"]);
    for (artifact, tile) in [(&mef, "_t4x1_f4x1"), (&v4, "_t8x2_f8x1")] {
        let v = inspect_json(&artifact);
        let names: Vec<&str> = v["kernels"]["names"].as_array().unwrap().iter().map(|n| n.as_str().unwrap()).collect();
        let prefill_panels: Vec<&&str> = names.iter().filter(|n| n.contains("panel") && n.contains("_sN")).collect();
        assert!(!prefill_panels.is_empty(), "no prefill panel matmuls: {names:?}");
        for name in prefill_panels {
            assert!(name.ends_with(tile), "{name}: not in the {tile} tile");
        }
    }
}

#[test]
fn bad_artifacts_are_refused_cleanly() {
    let dir = temp_dir("badmef");
    let junk = dir.join("junk.mef");
    std::fs::write(&junk, b"this is not an artifact at all").unwrap();
    assert_clean_error(&run_bin("maxrun", &[junk.as_os_str(), os("--prompt"), os("hi")]), 1, &["junk.mef", "not a maxc artifact"]);

    let good = std::fs::read(artifact("tiny-llama")).unwrap();
    let cut = dir.join("cut.mef");
    std::fs::write(&cut, &good[..good.len() / 2]).unwrap();
    assert_clean_error(&run_bin("maxrun", &[cut.as_os_str(), os("--prompt"), os("hi")]), 1, &["cut.mef", "truncated or corrupt"]);

    let mut newer = good.clone();
    newer[8..12].copy_from_slice(&99u32.to_le_bytes());
    let v = dir.join("v99.mef");
    std::fs::write(&v, &newer).unwrap();
    assert_clean_error(&run_bin("maxrun", &[v.as_os_str(), os("--prompt"), os("hi")]), 1, &["v99.mef", "format 99.", "not supported"]);

    let missing = dir.join("missing.mef");
    let r = run_bin("maxrun", &[missing.as_os_str(), os("--prompt"), os("hi")]);
    assert_clean_error(&r, 1, &["missing.mef", "cannot read the artifact"]);
    assert_eq!(r.2.matches("os error 2").count(), 1, "the OS error is said once: {}", r.2);
}

#[test]
fn bad_runtime_flags_are_errors() {
    let mef = artifact("tiny-llama");
    assert_clean_error(&run_bin("maxrun", &[mef.as_os_str(), os("--prompt"), os("hi"), os("--top-p"), os("1.5")]), 1, &["--top-p"]);
    assert_clean_error(&run_bin("maxrun", &[mef.as_os_str(), os("--token-ids"), os("99999999")]), 1, &["99999999", "vocabulary"]);
    assert_clean_error(&run_bin("maxrun", &[mef.as_os_str(), os("--prompt"), os("")]), 1, &["empty"]);
    // Not-a-number and infinite floats: a plain message, not a range ending in f32::MAX.
    for (flag, value) in [("--temperature", "nan"), ("--temperature", "inf"), ("--top-p", "NaN"), ("--min-p", "-inf"), ("--repeat-penalty", "inf")] {
        let r = run_bin("maxrun", &[mef.as_os_str(), os("--prompt"), os("hi"), os(&format!("{flag}={value}"))]);
        assert_clean_error(&r, 1, &[flag, "give a finite number"]);
        assert!(!r.2.contains("340282"), "{}", r.2);
    }
    assert_clean_error(&run_bin("maxrun", &[mef.as_os_str(), os("--prompt"), os("hi"), os("--temperature=-1")]), 1, &["--temperature -1 must be at least 0"]);
    // Thread counts: 0 and absurd counts refused, more than the CPUs warned about.
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert_clean_error(&run_bin("maxrun", &[mef.as_os_str(), os("--prompt"), os("hi"), os("--threads"), os("0")]), 1, &["--threads must be at least 1"]);
    let absurd = (cpus * 8 + 1).to_string();
    let r = run_bin("maxrun", &[mef.as_os_str(), os("--prompt"), os("hi"), os("--threads"), os(&absurd)]);
    assert_clean_error(&r, 1, &[&format!("--threads {absurd}"), "at most that", &(cpus * 8).to_string()]);
    let over = (cpus + 1).to_string();
    let (code, _, stderr) = run_bin("maxrun", &[mef.as_os_str(), os("--prompt"), os("hi"), os("-n"), os("2"), os("--threads"), os(&over)]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains(&format!("warning: --threads {over} is more than the {cpus} CPU(s)")), "{stderr}");
    let bench = [os("bench"), mef.as_os_str(), os("-n"), os("2"), os("-p"), os("2"), os("-r"), os("1"), os("--threads"), os(&absurd)];
    assert_clean_error(&run_bin("maxrun", &bench), 1, &["--threads", "at most that"]);
}

/// `-n 0` generates nothing: no text on stdout, exit 0, and a note saying so.
#[test]
fn zero_new_tokens_generates_nothing() {
    let mef = artifact("tiny-llama");
    let (code, stdout, stderr) = run_bin("maxrun", &[mef.as_os_str(), os("--prompt"), os("Once upon a time"), os("-n"), os("0")]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, "", "no text for -n 0");
    assert!(stderr.contains("-n 0: nothing generated"), "{stderr}");
    // And exactly one for -n 1.
    let (code, _, stderr) = run_bin("maxrun", &[mef.as_os_str(), os("--token-ids"), os("1,2,3"), os("-n"), os("1"), os("--ignore-eos")]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("generated: 1 tokens"), "{stderr}");
}

#[test]
fn failed_compile_leaves_no_file() {
    let dir = temp_dir("nofile");
    let out = dir.join("x.mef");
    let r = run_bin("maxc", &[os("compile"), os("--model"), fixture("tiny-llama").as_os_str(), os("-o"), out.as_os_str(), os("--target"), os("cpu:pentium9")]);
    assert_clean_error(&r, 1, &["pentium9"]);
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "the output directory must stay empty");
    let r = run_bin("maxc", &[os("compile"), os("--model"), fixture("tiny-llama").as_os_str(), os("-o"), os("/nonexistent/dir/x.mef")]);
    assert_clean_error(&r, 1, &["/nonexistent/dir/x.mef", "does not exist"]);
}

#[test]
fn same_inputs_give_identical_artifacts() {
    let a = std::fs::read(compile_model("repro-a", &fixture("tiny-qwen2"), &["--target", "cpu:x86-64-v3", "--jobs", "1"])).unwrap();
    let b = std::fs::read(compile_model("repro-b", &fixture("tiny-qwen2"), &["--target", "cpu:x86-64-v3", "--jobs", "2"])).unwrap();
    assert!(a == b, "two compiles of the same inputs differ");
    // The built-in check agrees.
    compile_model("repro-c", &fixture("tiny-llama"), &["--check-reproducible"]);
}

/// `maxrun bench --json` reports every field CI reads (values are not judged here:
/// performance lives in benchmarks, not tests).
#[test]
fn bench_json_has_the_documented_fields() {
    let mef = artifact("tiny-llama");
    let r = run_bin("maxrun", &[os("bench"), mef.as_os_str(), os("-p"), os("16"), os("-n"), os("8"), os("-r"), os("2"), os("--json"), os("--profile")]);
    assert_eq!(r.0, 0, "{}", r.2);
    let v: serde_json::Value = serde_json::from_str(&r.1).expect("one JSON object");
    for key in ["prefill_tokens_per_s", "prefill_tokens_per_s_stddev", "decode_tokens_per_s", "decode_tokens_per_s_stddev", "read_bandwidth_gb_s", "decode_roofline_fraction"] {
        assert!(v[key].as_f64().is_some_and(|x| x.is_finite() && x >= 0.0), "{key}: {}", v[key]);
    }
    assert_eq!(v["prompt_tokens"], 16);
    assert_eq!(v["generated_tokens"], 8);
    assert_eq!(v["weights_memory"], "file mapping", "the default runs from the file mapping");
    // The tiny model's KV cache is a few hundred KiB: far below an eighth of any
    // test machine's available memory, so it asks for huge pages.
    assert_eq!(v["kv_cache_memory"], "huge pages");
    assert_eq!(v["kv_cache_encoding"], "float32", "the compiler's default cache");
    assert!(v["threads"].as_u64().unwrap() >= 1);
    // The profile ranks kernels of both plans; every decode kernel family appears.
    for family in ["matmul", "attention", "kv_store", "rms_norm", "rope", "embedding", "elementwise", "copy"] {
        assert!(r.2.contains(family), "profile lacks {family}: {}", r.2);
    }
    // A benchmark longer than the compiled context is refused up front.
    let r = run_bin("maxrun", &[os("bench"), mef.as_os_str(), os("-p"), os("100000")]);
    assert_clean_error(&r, 1, &["max_length"]);
    // At a depth: the tests start with that many tokens in the cache, and the
    // depth counts toward the context.
    let r = run_bin("maxrun", &[os("bench"), mef.as_os_str(), os("-p"), os("8"), os("-n"), os("4"), os("-d"), os("16"), os("-r"), os("1"), os("--json")]);
    assert_eq!(r.0, 0, "{}", r.2);
    let v: serde_json::Value = serde_json::from_str(&r.1).expect("one JSON object");
    assert_eq!(v["depth"], 16);
    assert!(v["decode_tokens_per_s"].as_f64().unwrap() > 0.0 && v["prefill_tokens_per_s"].as_f64().unwrap() > 0.0);
    let r = run_bin("maxrun", &[os("bench"), mef.as_os_str(), os("-p"), os("8"), os("-d"), os("100000")]);
    assert_clean_error(&r, 1, &["max_length"]);
    // Two artifacts turn about: both measured, ratios from the same repetitions.
    let other = artifact("tiny-qwen2");
    let r = run_bin(
        "maxrun",
        &[os("bench"), mef.as_os_str(), os("--compare"), other.as_os_str(), os("-p"), os("8"), os("-n"), os("4"), os("-r"), os("2"), os("--json")],
    );
    assert_eq!(r.0, 0, "{}", r.2);
    let v: serde_json::Value = serde_json::from_str(&r.1).expect("one JSON object");
    assert_eq!(v["artifacts"][1].as_str().unwrap(), other.to_str().unwrap());
    for key in ["prefill_ratio", "decode_ratio"] {
        assert!(v[key].as_f64().is_some_and(|x| x.is_finite() && x > 0.0), "{key}: {}", v[key]);
    }
    for k in 0..2 {
        assert!(v["decode_tokens_per_s"][k][0].as_f64().unwrap() > 0.0, "{}", v["decode_tokens_per_s"]);
    }
    let r = run_bin("maxrun", &[os("bench"), mef.as_os_str(), os("--compare"), other.as_os_str(), os("--profile")]);
    assert_clean_error(&r, 1, &["--compare"]);
}

/// The weights read from the file mapping (the default) and from a private copy
/// on huge pages (`--huge-pages`) are the same bytes: the logits are bit-identical
/// and the golden ones; bench says which it used.
#[test]
fn mapped_and_resident_weights_give_identical_logits() {
    let mef = artifact("tiny-llama");
    let golden = golden("tiny-llama");
    let case = &cases(&golden)[0];
    let (_, mapped) = dump_logits(mef, case);
    let (_, resident) = dump_logits_with(mef, case, &["--huge-pages"]);
    assert!(resident.iter().zip(&mapped).all(|(a, b)| a.to_bits() == b.to_bits()) && resident.len() == mapped.len());
    assert_logits_close("tiny-llama --huge-pages", &resident, &golden_logits("tiny-llama", case).1);
    let r = run_bin("maxrun", &[os("bench"), mef.as_os_str(), os("-p"), os("0"), os("-n"), os("4"), os("-r"), os("1"), os("--json"), os("--huge-pages")]);
    assert_eq!(r.0, 0, "{}", r.2);
    let v: serde_json::Value = serde_json::from_str(&r.1).unwrap();
    assert_eq!(v["weights_memory"], "huge pages");
}

#[test]
fn qwen3_matches_golden() {
    check_golden("arch-qwen3");
}

#[test]
fn olmo2_matches_golden() {
    check_golden("arch-olmo2");
}

#[test]
fn granite_matches_golden() {
    check_golden("arch-granite");
}

#[test]
fn phi3_matches_golden() {
    check_golden("arch-phi3");
}

#[test]
fn gemma2_matches_golden() {
    check_golden("arch-gemma2");
}

/// Gemma 3's golden is ours (tests/fixtures/arch-gemma3/make.py runs transformers).
#[test]
fn gemma3_matches_golden() {
    check_golden("arch-gemma3");
}

#[test]
fn gpt2_matches_golden() {
    check_golden("arch-gpt2");
}

/// `maxrun inspect`'s experts: count, top-k, rule, routed layers, and the
/// bytes of `routed_layers` layers of `experts` SwiGLU experts (`hidden` by
/// `width`, float32) against what a token reads of them: the other weights,
/// but an untied input table (`tie_word_embeddings` false in the config: one
/// row a token, its 1024 x `hidden` floats not counted), and `top_k` experts.
fn check_experts(fixture_name: &str, (experts, top_k, routing, routed_layers): (u64, u64, &str, u64), (hidden, width): (u64, u64)) {
    let v = inspect_json(artifact(fixture_name));
    let e = &v["experts"];
    assert_eq!((e["experts"].as_u64(), e["top_k"].as_u64(), e["routing"].as_str(), e["routed_layers"].as_u64()), (Some(experts), Some(top_k), Some(routing), Some(routed_layers)), "{fixture_name}: {e}");
    let expert_bytes = routed_layers * experts * 3 * hidden * width * 4;
    assert_eq!(e["expert_bytes"].as_u64(), Some(expert_bytes), "{fixture_name}");
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(maxc_tests::fixture(fixture_name).join("config.json")).unwrap()).unwrap();
    let input_table = if config["tie_word_embeddings"] == false { 1024 * hidden * 4 } else { 0 };
    let dense = v["weights"]["bytes"].as_u64().unwrap() - expert_bytes - input_table;
    assert_eq!(e["weight_bytes_per_token"].as_u64(), Some(dense + expert_bytes * top_k / experts), "{fixture_name}");
    let r = run_bin("maxrun", &[os("inspect"), artifact(fixture_name).as_os_str()]);
    assert!(r.1.contains(&format!("{experts} per layer, top {top_k} ({routing}), {routed_layers} routed layers")), "{}", r.1);
}

/// Qwen3-MoE: a dense first layer (`mlp_only_layers`), then two layers of 8
/// experts, top-2, renormalized.
#[test]
fn qwen3_moe_matches_golden() {
    check_golden("arch-qwen3-moe");
    check_experts("arch-qwen3-moe", (8, 2, "softmax_topk_norm", 2), (64, 32));
}

/// Mixtral: 4 experts, top-2, the softmax over the chosen logits.
#[test]
fn mixtral_matches_golden() {
    check_golden("arch-mixtral");
    check_experts("arch-mixtral", (4, 2, "topk_softmax", 2), (64, 96));
}

/// gpt-oss: attention sinks, sliding and full layers alternating, YaRN RoPE,
/// q/k/v/o biases, 4 experts, top 2 with the softmax over the chosen logits
/// and a router bias, the fused gate-and-up experts interleaved with their
/// biases and the clamped SwiGLU.
#[test]
fn gpt_oss_matches_golden() {
    check_golden("arch-gpt-oss");
    check_experts("arch-gpt-oss", (4, 2, "topk_softmax", 2), (64, 64));
}

/// OLMoE: q/k norms over the whole projections, 8 experts, top 2 of the
/// softmax over all, not renormalized; the golden is ours
/// (tests/fixtures/arch-olmoe/make.py runs transformers).
#[test]
fn olmoe_matches_golden() {
    check_golden("arch-olmoe");
    check_experts("arch-olmoe", (8, 2, "softmax_topk", 2), (64, 32));
}

/// Qwen2-MoE: a dense middle layer, 6 experts, top 3 of the softmax over all,
/// not renormalized, a shared expert 48 wide (the experts 32) behind a
/// sigmoid gate; the golden is ours (tests/fixtures/arch-qwen2-moe/make.py).
#[test]
fn qwen2_moe_matches_golden() {
    check_golden("arch-qwen2-moe");
}

/// Qwen3 with YaRN RoPE scaling (factor 8 over 16 original positions), past
/// the original context in every case; the golden is ours
/// (tests/fixtures/arch-qwen3-yarn/make.py runs transformers).
#[test]
fn qwen3_yarn_matches_golden() {
    check_golden("arch-qwen3-yarn");
}

/// all-MiniLM-L6-v2 (BertModel + mean pooling + L2 normalization): every golden
/// sentence tokenizes to the golden ids and embeds with cosine >= 0.9999.
#[test]
fn minilm_embeddings_match_golden() {
    let mef = compile_model("minilm", &minilm_dir(), &[]);
    let golden = golden("all-minilm-l6-v2");
    let sentences: Vec<&str> = golden["sentences"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
    let mut tokenizer = tokenizers::Tokenizer::from_file(minilm_dir().join("tokenizer.json")).unwrap();
    tokenizer.with_padding(None);
    for (i, s) in sentences.iter().enumerate() {
        let ids = tokenizer.encode(*s, true).unwrap().get_ids().to_vec();
        assert_eq!(ids, maxc_tests::ids(&golden["input_ids"][i]), "sentence {i} ids");
    }
    let file = temp_file("sentences", "s.txt");
    std::fs::write(&file, sentences.join("\n")).unwrap();
    let r = run_bin("maxrun", &[mef.as_os_str(), os("--embed-file"), file.as_os_str()]);
    assert_eq!(r.0, 0, "{}", r.2);
    let (shape, want) = maxrun_runtime::npy::read_f32(&fixture("all-minilm-l6-v2").join("embeddings.npy")).unwrap();
    let lines: Vec<&str> = r.1.lines().collect();
    assert_eq!(lines.len(), shape[0]);
    for (i, line) in lines.iter().enumerate() {
        let ours: Vec<f32> = serde_json::from_str(line).unwrap();
        let gold = &want[i * shape[1]..(i + 1) * shape[1]];
        let dot: f32 = ours.iter().zip(gold).map(|(a, b)| a * b).sum();
        let cos = dot / (ours.iter().map(|a| a * a).sum::<f32>().sqrt() * gold.iter().map(|b| b * b).sum::<f32>().sqrt());
        assert!(cos >= 0.9999, "sentence {i}: cosine {cos}");
    }
    // --embed prints the same vector for one sentence; a decoder artifact refuses --embed.
    let r = run_bin("maxrun", &[mef.as_os_str(), os("--embed"), os(sentences[3])]);
    assert_eq!(r.1.lines().next().unwrap(), lines[3]);
    let r = run_bin("maxrun", &[artifact("tiny-llama").as_os_str(), os("--embed"), os("hi")]);
    assert_clean_error(&r, 1, &["not a sentence encoder"]);
}

/// --stop cuts the text before the stop string and ends generation; --no-stream
/// prints what streaming prints; --repeat-penalty 1 changes nothing and a strong
/// one steers SmolLM2 off the repeated words of the golden continuation.
#[test]
fn stop_strings_no_stream_and_repeat_penalty() {
    let mef = artifact("smollm2-135m");
    let golden = golden("smollm2-135m");
    let case = &cases(&golden)[1];
    let prompt = case["prompt"].as_str().unwrap();
    let text = case["greedy_text"].as_str().unwrap();
    let base = [mef.as_os_str(), os("--prompt"), os(prompt), os("--temperature"), os("0"), os("-n"), os("24")];
    let run = |extra: &[&str]| {
        let mut args: Vec<&OsStr> = base.to_vec();
        args.extend(extra.iter().map(|s| os(s)));
        let r = run_bin("maxrun", &args);
        assert_eq!(r.0, 0, "{}", r.2);
        r
    };
    let r = run(&["--stop", "2018"]);
    assert_eq!(r.1, &text[..text.find("2018").unwrap()]);
    assert!(!r.2.contains("generated: 24 tokens"), "generation must end at the stop string: {}", r.2);
    assert_eq!(run(&["--no-stream"]).1, text);
    assert_eq!(run(&["--repeat-penalty", "1"]).1, text);
    let case0 = &cases(&golden)[0];
    let r = run_bin(
        "maxrun",
        &[mef.as_os_str(), os("--prompt"), os(case0["prompt"].as_str().unwrap()), os("--temperature"), os("0"), os("-n"), os("24"), os("--repeat-penalty"), os("1.8")],
    );
    assert_ne!(r.1, case0["greedy_text"].as_str().unwrap(), "a strong repeat penalty must change a repetitive continuation");
    assert_clean_error(&run_bin("maxrun", &[mef.as_os_str(), os("--prompt"), os("hi"), os("--stop"), os("")]), 1, &["--stop"]);
}

/// The Cranelift backend: same golden logits and texts as LLVM.
#[test]
fn cranelift_backend_matches_golden() {
    for (name, model) in [("tiny-llama", fixture("tiny-llama")), ("tiny-qwen2", fixture("tiny-qwen2")), ("smollm2-135m", smollm2_gguf())] {
        let mef = compile_model(&format!("cl-{name}"), &model, &["--backend", "cranelift"]);
        let info = maxrun_runtime::artifact::Artifact::open(&mef).unwrap().header;
        assert_eq!(info.target.backend, "cranelift");
        assert!(info.kernels.iter().all(|k| k.backend == "cranelift"));
        let golden = golden(name);
        for (i, case) in cases(&golden).iter().enumerate() {
            let what = format!("cranelift {name} case {i}");
            assert_logits_close(&what, &dump_logits(&mef, case).1, &golden_logits(name, case).1);
            let r = run_bin(
                "maxrun",
                &[mef.as_os_str(), os("--prompt"), os(case["prompt"].as_str().unwrap()), os("--temperature"), os("0"), os("-n"), os("24"), os("--ignore-eos")],
            );
            assert_eq!(r.1, case["greedy_text"].as_str().unwrap(), "{what}: greedy text");
        }
    }
    let r = run_bin("maxc", &[os("compile"), os("--model"), fixture("tiny-llama").as_os_str(), os("-o"), temp_file("clv4", "m.mef").as_os_str(), os("--backend"), os("cranelift"), os("--target"), os("cpu:x86-64-v4")]);
    assert_clean_error(&r, 1, &["cranelift", "baseline x86-64"]);
}

/// Weights stream from the checkpoint to the artifact in pieces: writing
/// SmolLM2 at float32 (540 MB of weights; its embedding alone is 108 MiB as
/// f32) adds less than 64 MiB of anonymous memory to what the earlier phases
/// peaked at (the bound: 2 threads x one piece of 2^20 values, as f32, encoded
/// and laid out, plus allocator slack; docs/performance-log.md "Compile memory").
/// A writer that held a whole tensor would exceed it.
#[test]
fn compile_memory_does_not_grow_with_the_weights() {
    let mef = temp_file("anon", "f32.mef");
    let r = run_bin(
        "maxc",
        &[os("compile"), os("--model"), smollm2_gguf().as_os_str(), os("-o"), mef.as_os_str(), os("--quantization-encoding"), os("float32"), os("--jobs"), os("2"), os("--log-format"), os("json")],
    );
    assert_eq!(r.0, 0, "{}", r.2);
    let phases: Vec<serde_json::Value> = r.1.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()).filter(|o| o["phase"].is_string()).collect();
    let anon = |o: &serde_json::Value| o["peak_anon_bytes"].as_u64().expect("peak_anon_bytes");
    let (write, before) = phases.split_last().expect("phases");
    assert_eq!(write["phase"], "write artifact");
    let earlier = before.iter().map(anon).max().unwrap();
    assert!(earlier > 0, "the phase table reports anonymous memory");
    let embedding_f32 = 49152u64 * 576 * 4;
    let bound = 64u64 << 20;
    assert!(bound < embedding_f32);
    assert!(anon(write) <= earlier + bound, "writing the weights peaked at {} MiB of anonymous memory, the phases before at {} MiB", anon(write) >> 20, earlier >> 20);
}

/// `--log-format json` prints one JSON object per phase and a summary; `--quiet`
/// prints nothing; neither changes the artifact; completions are generated.
#[test]
fn compile_logging_modes() {
    let dir = temp_dir("logs");
    let (a, b) = (dir.join("a.mef"), dir.join("b.mef"));
    let model = fixture("tiny-llama");
    let r = run_bin("maxc", &[os("compile"), os("--model"), model.as_os_str(), os("-o"), a.as_os_str(), os("--log-format"), os("json")]);
    assert_eq!(r.0, 0, "{}", r.2);
    let objects: Vec<serde_json::Value> = r.1.lines().map(|l| serde_json::from_str(l).expect("a JSON object per line")).collect();
    let phases: Vec<&str> = objects.iter().filter_map(|o| o["phase"].as_str()).collect();
    assert_eq!(phases, ["import + graph passes", "schedule", "codegen + link", "write artifact"]);
    assert!(objects.iter().filter(|o| o["phase"].is_string()).all(|o| o["wall_s"].as_f64().unwrap() >= 0.0 && o["peak_rss_bytes"].as_u64().unwrap() > 0));
    assert_eq!(objects.last().unwrap()["kernels"].as_u64().unwrap() as usize, maxrun_runtime::artifact::Artifact::open(&a).unwrap().header.kernels.len());
    let r = run_bin("maxc", &[os("compile"), os("--model"), model.as_os_str(), os("-o"), b.as_os_str(), os("--quiet")]);
    assert_eq!((r.0, r.1.as_str(), r.2.as_str()), (0, "", ""));
    assert!(std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(), "logging flags must not change the artifact");
    let r = run_bin("maxc", &[os("completions"), os("bash")]);
    assert!(r.0 == 0 && r.1.contains("_maxc") && r.1.contains("--quantization-encoding"));
}

/// `maxrun --profile` ranks every kernel of the plans a generation runs (the
/// last-token prefill plan for the prompt, the decode plan after it).
#[test]
fn profile_lists_every_kernel_of_the_plans() {
    let mef = artifact("tiny-llama");
    let r = run_bin("maxrun", &[mef.as_os_str(), os("--prompt"), os("Once upon a time"), os("-n"), os("4"), os("--profile")]);
    assert_eq!(r.0, 0, "{}", r.2);
    let header = maxrun_runtime::artifact::Artifact::open(mef).unwrap().header;
    let prompt_plan = header.main().prefill_last.as_ref().expect("decoders have a last-token plan");
    for (plan, launches) in [("prefill", &prompt_plan.launches), ("decode", &header.main().decode.launches)] {
        let section = r.2.split(&format!("{plan}: ")).nth(1).unwrap_or_else(|| panic!("no {plan} table: {}", r.2));
        let section = section.split("\n\n").next().unwrap();
        for l in launches.iter() {
            let symbol = &header.kernels[l.kernel as usize].symbol;
            assert!(section.contains(symbol.as_str()), "{plan} profile lacks {symbol}");
        }
    }
    assert!(r.2.contains("GB/s"));
}

/// The weight-layout decision: float matmul weights whose rows come in whole
/// 16-column panels are stored packed (`panel16`) and run by the panel kernel,
/// a tied embedding table too (the lm_head's GEMV is the largest of a small
/// model), which the embedding then gathers from that layout. (The golden
/// logits of the same artifact are `tiny_qwen2_matches_golden`'s.)
#[test]
fn matmul_weights_are_packed_into_panels() {
    let mef = artifact("tiny-qwen2");
    let a = maxrun_runtime::artifact::Artifact::open(mef).unwrap();
    let h = &a.header;
    let packed: Vec<&str> = h.weights.iter().filter(|w| w.layout == "panel16").map(|w| w.name.as_str()).collect();
    assert!(packed.iter().any(|n| n.contains("mlp.down_proj")), "{packed:?}");
    assert!(packed.iter().any(|n| n.starts_with("model.embed_tokens.weight")), "the tied table is not packed: {packed:?}");
    assert!(h.kernels.iter().any(|k| k.symbol.starts_with("embedding_") && k.symbol.contains("_p16_")), "no gather from the packed table");
    let vocab = h.model.vocab_size;
    assert!(h.kernels.iter().any(|k| k.symbol.starts_with("matmul_panel") && k.symbol.contains(&format!("_n{vocab}_"))), "the lm_head is not a panel matmul");
}

/// The last-token prefill plan (what generation runs on a prompt) gives the last
/// row of the full prefill's logits, and exists for decoders only.
#[test]
fn last_token_prefill_plan_matches_the_full_one() {
    for name in ["tiny-qwen2", "arch-gemma2", "smollm2-135m"] {
        let a = maxrun_runtime::artifact::Artifact::open(artifact(name)).unwrap();
        assert!(a.header.main().prefill_last.is_some(), "{name}: no last-row plan");
        let vocab = a.header.model.vocab_size as usize;
        let golden = golden(name);
        let ids = ids(&cases(&golden)[0]["input_ids"]);
        let mut s = maxrun_runtime::session::Session::new(&a, 2).unwrap();
        let full = s.forward(&ids).unwrap().to_vec();
        s.reset();
        let last = s.forward_last(&ids).unwrap().to_vec();
        assert_eq!(last.len(), vocab);
        let (err, bound) = logits_error(&last, &full[full.len() - vocab..]);
        assert!(err <= bound, "{name}: last-row plan differs by {err} (bound {bound})");
        // And it is a different, shorter plan.
        let plan = a.header.main().prefill_last.as_ref().unwrap();
        assert!(plan.launches.len() > a.header.main().prefill.launches.len(), "one more launch (the row copy)");
    }
    let encoder = maxrun_runtime::artifact::Artifact::open(&compile_model("minilm-last", &minilm_dir(), &[])).unwrap();
    assert!(encoder.header.main().prefill_last.is_none(), "encoders have no logits to cut");
}

/// `--kv-cache-encoding float16` keeps keys and values as halves (rounded to
/// nearest even): the artifact says so and needs half the KV bytes per token,
/// and SmolLM2's logits stay within the fixtures' float32 tolerance of the
/// golden ones (measured 0.015-0.017 against bounds of 0.027-0.041; the cache
/// is written and read by the prefill that computes them), with the golden
/// greedy texts (written and read token by token in decode). The random tiny
/// fixtures, whose keys and values are larger against their logits' spread,
/// exceed that tolerance (tiny-qwen2: 0.010 against 0.0075) and are held to
/// the float16 budget in tests/quantization.rs.
#[test]
fn f16_kv_cache_halves_the_cache_and_keeps_the_golden_logits() {
    for name in ["smollm2-135m"] {
        let model = smollm2_gguf();
        let mef = compile_model(&format!("{name}-kv-f16"), &model, &["--kv-cache-encoding", "float16"]);
        let f32_mef = artifact(name);
        let memory = |mef: &Path| {
            inspect_json(&mef)["memory"].clone()
        };
        let (half, full) = (memory(&mef), memory(f32_mef));
        assert_eq!((half["kv_encoding"].as_str(), full["kv_encoding"].as_str()), (Some("float16"), Some("float32")));
        assert_eq!(2 * half["kv_bytes_per_token"].as_u64().unwrap(), full["kv_bytes_per_token"].as_u64().unwrap());
        let golden = golden(name);
        for (i, case) in cases(&golden).iter().enumerate() {
            let what = format!("{name} case {i}, f16 KV cache");
            let (ours, gold) = (dump_logits(&mef, case).1, golden_logits(name, case).1);
            let (err, bound) = logits_error(&ours, &gold);
            eprintln!("{what}: max logit error {err} (bound {bound})");
            assert_logits_close(&what, &ours, &gold);
            let r = run_bin("maxrun", &[mef.as_os_str(), os("--prompt"), os(case["prompt"].as_str().unwrap()), os("--temperature"), os("0"), os("-n"), os("24")]);
            assert_eq!(r.0, 0, "{what}: {}", r.2);
            assert_eq!(r.1, case["greedy_text"].as_str().unwrap(), "{what}: greedy text");
        }
    }
}

/// generation_config.json's `repetition_penalty` is the artifact's default for
/// `--repeat-penalty` (the same text as the flag on an artifact without it; the
/// flag overrides it), and its `eos_token_id`s join the stop tokens, as
/// transformers' `generate` reads them.
#[test]
fn generation_config_penalty_and_stop_tokens_are_honoured() {
    let model = fixture("tiny-llama");
    let golden = golden("tiny-llama");
    let prompt = cases(&golden)[0]["prompt"].as_str().unwrap().to_string();
    let mut generation: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(model.join("generation_config.json")).unwrap()).unwrap();
    generation["repetition_penalty"] = serde_json::json!(1.8);
    generation["eos_token_id"] = serde_json::json!([2, 7]);
    let dir = fixture_with("tiny-llama", "genconfig-honoured", &[("generation_config.json", generation.to_string())]);
    let with = compile_model("genconfig-penalty", &dir, &["--quantization-encoding", "float32"]);
    let without = artifact("tiny-llama");
    let text = |mef: &Path, extra: &[&str]| {
        let mut args = vec![mef.as_os_str(), os("--prompt"), os(&prompt), os("--temperature"), os("0"), os("-n"), os("24"), os("--ignore-eos")];
        args.extend(extra.iter().map(|s| os(s)));
        let r = run_bin("maxrun", &args);
        assert_eq!(r.0, 0, "{}", r.2);
        r.1
    };
    let plain = text(without, &[]);
    let penalized = text(without, &["--repeat-penalty", "1.8"]);
    assert_ne!(plain, penalized, "the penalty must change tiny-llama's repetitive text for this test to mean anything");
    assert_eq!(text(&with, &[]), penalized, "the checkpoint's repetition_penalty is the default");
    assert_eq!(text(&with, &["--repeat-penalty", "1"]), plain, "the flag overrides the default");
    let v = inspect_json(&with);
    assert_eq!(v["generation"]["repetition_penalty"].as_f64(), Some(1.8f32 as f64), "{}", v["generation"]);
    assert_eq!(v["tokenizer"]["eos_token_ids"], serde_json::json!([2, 7]), "{}", v["tokenizer"]);
}

/// `--dump-ir` writes every kernel of the artifact in the kernel IR's text form:
/// one file per kernel the header lists (same names, same families and parameter
/// counts), each of which parses back to a kernel that validates and prints to
/// the same text (the SmolLM2 README artifact: attention, paged and split
/// attention, int16 interleaved matmuls, quantization, norms, rope, copies).
#[test]
fn every_kernel_of_the_smollm2_artifact_round_trips_through_its_text_form() {
    let dump = temp_dir("kernel-text");
    let dump_arg = dump.as_path().to_str().unwrap().to_string();
    let mef = compile_model("kernel-text", &smollm2_gguf(), &["--quantization-encoding", "q4_1", "--dump-ir", &dump_arg]);
    let header = maxrun_runtime::artifact::Artifact::open(&mef).unwrap().header;
    let dir = dump.as_path().join("kernels");
    let files = std::fs::read_dir(&dir).unwrap().count();
    assert_eq!(files, header.kernels.len(), "one text file per kernel of the artifact");
    assert!(header.kernels.len() > 30, "{} kernels", header.kernels.len());
    for entry in &header.kernels {
        let text = std::fs::read_to_string(dir.join(format!("{}.kir", entry.symbol))).unwrap_or_else(|e| panic!("{}: {e}", entry.symbol));
        let kernel = maxc_kernels::ir_text::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", entry.symbol));
        assert_eq!(kernel.name, entry.symbol);
        assert_eq!(kernel.family, entry.family);
        assert_eq!(kernel.params.len(), entry.num_params as usize, "{}", entry.symbol);
        kernel.validate().unwrap_or_else(|e| panic!("{}: {e:?}", entry.symbol));
        assert_eq!(maxc_kernels::ir_text::print(&kernel), text, "{}", entry.symbol);
    }
}
