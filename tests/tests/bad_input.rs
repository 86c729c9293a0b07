//! Bad input never panics: each case is an error that names the file and the field.

use std::ffi::OsStr;
use std::path::PathBuf;

use maxc_tests::*;

/// Runs `maxc compile ARGS -o <fresh dir>/out.mef` and checks that a failed compile
/// leaves no file behind.
fn compile(args: &[&OsStr]) -> (i32, String, String) {
    let dir = temp_dir("out");
    let out = dir.join("out.mef");
    let mut all: Vec<&OsStr> = vec![OsStr::new("compile")];
    all.extend_from_slice(args);
    all.extend([OsStr::new("-o"), out.as_os_str()]);
    let r = run_bin("maxc", &all);
    if r.0 != 0 {
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "a failed compile left files behind");
    }
    r
}

/// A copy of tiny-llama in a temp dir (files linked), with `config.json` replaced by `config`.
fn model_dir(tag: &str, config: Option<&str>) -> TempDir {
    let src = fixture("tiny-llama");
    let dir = temp_dir(tag);
    for f in ["model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"] {
        std::os::unix::fs::symlink(src.join(f), dir.join(f)).unwrap();
    }
    if let Some(c) = config {
        std::fs::remove_file(dir.join("config.json")).unwrap();
        std::fs::write(dir.join("config.json"), c).unwrap();
    }
    dir
}

fn tiny_llama_config() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("tiny-llama").join("config.json")).unwrap()).unwrap()
}

fn manifest(tag: &str, text: &str) -> TempPath {
    let p = temp_file(tag, "model.toml");
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn manifest_missing() {
    let r = compile(&[OsStr::new("/nonexistent/model.toml")]);
    assert_clean_error(&r, 1, &["/nonexistent/model.toml", "cannot read"]);
    assert_eq!(r.2.matches("os error 2").count(), 1, "the OS error is said once: {}", r.2);
}

#[test]
fn manifest_unparsable() {
    let p = manifest("unparsable", "[model\npath = ");
    assert_clean_error(&compile(&[p.as_os_str()]), 1, &["model.toml", "not valid TOML"]);
}

#[test]
fn manifest_unknown_key() {
    let p = manifest("unknown", "[model]\npath = \"x\"\ncolour = \"red\"\n");
    assert_clean_error(&compile(&[p.as_os_str()]), 1, &["model.toml", "colour", "architecture"]);
}

#[test]
fn manifest_wrong_type() {
    let p = manifest("type", "[model]\npath = \"x\"\n[generation]\ntop_k = \"many\"\n");
    assert_clean_error(&compile(&[p.as_os_str()]), 1, &["model.toml", "generation.top_k", "invalid type"]);
}

#[test]
fn model_path_missing() {
    let p = manifest("nomodel", "[model]\npath = \"does/not/exist\"\n");
    assert_clean_error(&compile(&[p.as_os_str()]), 1, &["does/not/exist", "model.path", "does not exist"]);
}

#[test]
fn config_missing_required_field() {
    let mut c = tiny_llama_config();
    c.as_object_mut().unwrap().remove("num_hidden_layers");
    let dir = model_dir("nolayers", Some(&c.to_string()));
    let r = compile(&[OsStr::new("--model"), dir.as_os_str()]);
    assert_clean_error(&r, 1, &["config.json", "num_hidden_layers", "missing"]);
}

#[test]
fn config_missing_entirely() {
    let dir = model_dir("noconfig", None);
    std::fs::remove_file(dir.join("config.json")).unwrap();
    assert_clean_error(&compile(&[OsStr::new("--model"), dir.as_os_str()]), 1, &["config.json", "not found"]);
}

#[test]
fn unsupported_architecture() {
    let mut c = tiny_llama_config();
    c["architectures"] = serde_json::json!(["FalconForCausalLM"]);
    let dir = model_dir("falcon", Some(&c.to_string()));
    let r = compile(&[OsStr::new("--model"), dir.as_os_str()]);
    let supported = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM", "GPT2LMHeadModel", "BertModel"];
    assert_clean_error(&r, 1, &[&["config.json", "FalconForCausalLM"][..], &supported[..]].concat());
    let r = run_bin("maxc", &[OsStr::new("check"), OsStr::new("--model"), dir.as_os_str()]);
    assert_clean_error(&r, 1, &["1 problem(s)"]);
    assert!(r.1.contains("FalconForCausalLM") && r.1.contains("BertModel"), "{}", r.1);
}

/// Rewrites tiny-llama's safetensors with `edit` applied to the header JSON and
/// the data after it.
fn edited_safetensors(tag: &str, edit: impl FnOnce(&mut serde_json::Value, &mut Vec<u8>), truncate_to: Option<usize>) -> TempDir {
    let dir = model_dir(tag, None);
    let bytes = std::fs::read(fixture("tiny-llama").join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut data = bytes[8 + n..].to_vec();
    edit(&mut header, &mut data);
    let h = header.to_string();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h.as_bytes());
    out.extend(&data);
    if let Some(len) = truncate_to {
        out.truncate(len);
    }
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors"), out).unwrap();
    dir
}

#[test]
fn weight_absent() {
    let dir = edited_safetensors(
        "noweight",
        |h, _| {
            let v = h.as_object_mut().unwrap().remove("model.layers.1.mlp.up_proj.weight").unwrap();
            h["renamed.weight"] = v;
        },
        None,
    );
    let r = compile(&[OsStr::new("--model"), dir.as_os_str()]);
    assert_clean_error(&r, 1, &["model.layers.1.mlp.up_proj.weight", "LlamaForCausalLM", "not in the checkpoint"]);
}

#[test]
fn safetensors_truncated_header() {
    let dir = edited_safetensors("sthead", |_, _| {}, Some(100));
    let r = compile(&[OsStr::new("--model"), dir.as_os_str()]);
    assert_clean_error(&r, 1, &["model.safetensors", "header"]);
}

#[test]
fn safetensors_tensor_past_end_of_file() {
    let dir = edited_safetensors("stdata", |_, _| {}, Some(1 << 20));
    let r = compile(&[OsStr::new("--model"), dir.as_os_str()]);
    assert_clean_error(&r, 1, &["model.safetensors", "truncated"]);
}

fn gguf_copy(tag: &str, edit: impl FnOnce(&mut Vec<u8>)) -> TempPath {
    let mut bytes = std::fs::read(smollm2_gguf()).unwrap();
    edit(&mut bytes);
    let p = temp_file(tag, "model.gguf");
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn gguf_bad_magic() {
    let p = gguf_copy("magic", |b| b[..4].copy_from_slice(b"GGML"));
    assert_clean_error(&compile(&[OsStr::new("--model"), p.as_os_str()]), 1, &["model.gguf", "magic"]);
}

#[test]
fn gguf_truncated() {
    let p = gguf_copy("trunc", |b| b.truncate(b.len() / 2));
    assert_clean_error(&compile(&[OsStr::new("--model"), p.as_os_str()]), 1, &["model.gguf", "truncated"]);
}

#[test]
fn gguf_unknown_tensor_type() {
    // Rewrite the type of the first Q4_1 tensor (ggml type 3) to 99 in the tensor table.
    let p = gguf_copy("type", |b| {
        let name = b"blk.0.ffn_down.weight";
        let at = b.windows(name.len()).position(|w| w == name).unwrap() + name.len();
        let n_dims = u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize;
        let ty = at + 4 + 8 * n_dims;
        assert_eq!(u32::from_le_bytes(b[ty..ty + 4].try_into().unwrap()), 3);
        b[ty..ty + 4].copy_from_slice(&99u32.to_le_bytes());
    });
    let r = compile(&[OsStr::new("--model"), p.as_os_str()]);
    assert_clean_error(&r, 1, &["model.gguf", "blk.0.ffn_down.weight", "99", "not supported"]);
}

#[test]
fn gguf_context_length_zero() {
    // llama.context_length: a string key, then the value's type (uint32 = 4) and the value.
    let p = gguf_copy("ctx0", |b| {
        let key = b"llama.context_length";
        let at = b.windows(key.len()).position(|w| w == key).unwrap() + key.len();
        assert_eq!(u32::from_le_bytes(b[at..at + 4].try_into().unwrap()), 4, "a uint32 value");
        b[at + 4..at + 8].copy_from_slice(&0u32.to_le_bytes());
    });
    let r = compile(&[OsStr::new("--model"), p.as_os_str()]);
    assert_clean_error(&r, 1, &["model.gguf", "llama.context_length", "is 0"]);
}

#[test]
fn bad_override_and_stop_after() {
    let dir = fixture("tiny-llama");
    let r = compile(&[OsStr::new("--model"), dir.as_os_str(), OsStr::new("--model-override"), OsStr::new("oops")]);
    assert_clean_error(&r, 1, &["--model-override", "oops"]);
    let r = compile(&[OsStr::new("--model"), dir.as_os_str(), OsStr::new("--stop-after"), OsStr::new("nothing")]);
    assert_clean_error(&r, 1, &["--stop-after", "nothing", "stack-linear"]);
}

#[test]
fn dump_ir_writes_every_pass() {
    let out = temp_dir("dump");
    let dir = fixture("tiny-qwen2");
    let r = compile(&[OsStr::new("--model"), dir.as_os_str(), OsStr::new("--dump-ir"), out.as_os_str()]);
    assert!(r.2.contains("wrote"), "{}", r.2);
    assert_eq!(r.0, 0, "{}", r.2);
    let mut names: Vec<String> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "00-input.mxir",
            "01-canonicalize.mxir",
            "02-constant-fold.mxir",
            "03-cse.mxir",
            "04-stack-linear.mxir",
            "05-fuse-swiglu.mxir",
            "06-fuse-matmul-add.mxir",
            "07-dce.mxir",
            "08-quantize.mxir",
            "kernels",
            "launches.txt",
        ]
    );
    let launches = std::fs::read_to_string(out.join("launches.txt")).unwrap();
    // Per layer: rms_norm, QKV matmul, 3 slices, 2 rope, kv_store, attention, 3 bias
    // adds (Qwen2), o matmul_add, rms_norm, gate/up matmul, swiglu, down matmul_add;
    // decode's attention is split over chunks of positions and merged (one more).
    assert!(launches.contains("prefill: 54 launches, 17 per layer + 3"), "{launches}");
    assert!(launches.contains("decode: 57 launches, 18 per layer + 3"), "{launches}");
    assert!(launches.contains("attention 3, attention_combine 3,"), "{launches}");
    for n in names.iter().filter(|n| n.ends_with(".mxir")) {
        let text = std::fs::read_to_string(out.join(n)).unwrap();
        maxc::graph::verify::verify(&maxc::graph::text::parse(&text).unwrap()).unwrap();
    }
    // The kernels, one text file each (end_to_end.rs round-trips SmolLM2's).
    let kernels = std::fs::read_dir(out.join("kernels")).unwrap().count();
    assert!(kernels > 10, "{kernels} kernel files");
}

/// Hashes every file of `dir` (name -> (size, xxh3)), to show a refused compile
/// touched none of them.
fn snapshot(dir: &std::path::Path) -> Vec<(String, u64, u64)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p.file_name().unwrap().to_string_lossy().into_owned(), bytes.len() as u64, maxrun_runtime::format::checksum(&bytes))
        })
        .collect();
    files.sort();
    files
}

/// `-o` never destroys an input or a special file: the model's own weights or
/// config (directly or through a symbolic link), the manifest, a directory,
/// /dev/null. Each is refused (exit 1) and every input file keeps its bytes.
#[test]
fn output_paths_that_would_destroy_inputs_are_refused() {
    let dir = temp_dir("protect");
    let m = dir.join("m");
    std::fs::create_dir(&m).unwrap();
    for f in std::fs::read_dir(fixture("tiny-llama")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, m.join(f.file_name().unwrap())).unwrap();
    }
    let manifest = dir.join("model.toml");
    std::fs::write(&manifest, "[model]\npath = \"m\"\n").unwrap();
    let link = dir.join("link.mef");
    std::os::unix::fs::symlink(m.join("config.json"), &link).unwrap();
    let before = snapshot(&m);
    let manifest_before = std::fs::read(&manifest).unwrap();
    let model_arg = [OsStr::new("compile"), OsStr::new("--model"), m.as_os_str()];
    let manifest_arg = [OsStr::new("compile"), manifest.as_os_str()];
    let cases: Vec<(&[&OsStr], PathBuf, &str)> = vec![
        (&model_arg, m.join("model.safetensors"), "is an input of this command"),
        (&model_arg, m.join("config.json"), "is an input of this command"),
        (&model_arg, m.join("tokenizer.json"), "is an input of this command"),
        (&model_arg, link.clone(), "config.json"),
        (&manifest_arg, manifest.clone(), "is an input of this command"),
        (&manifest_arg, m.join("model.safetensors"), "is an input of this command"),
        (&model_arg, m.clone(), "is a directory"),
        (&model_arg, PathBuf::from("/dev/null"), "not a regular file"),
    ];
    for (args, out, needle) in cases {
        let mut all = args.to_vec();
        all.extend([OsStr::new("-o"), out.as_os_str()]);
        let r = run_bin("maxc", &all);
        assert_clean_error(&r, 1, &["-o", needle]);
        assert_eq!(snapshot(&m), before, "-o {}: an input changed", out.display());
        assert_eq!(std::fs::read(&manifest).unwrap(), manifest_before);
    }
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata("/dev/null").unwrap().file_type().is_char_device(), "/dev/null is still the device");
    // A new file in the model's folder is fine.
    let r = run_bin("maxc", &[OsStr::new("compile"), OsStr::new("--model"), m.as_os_str(), OsStr::new("-o"), m.join("new.mef").as_os_str(), OsStr::new("--quiet")]);
    assert_eq!(r.0, 0, "{}", r.2);
}

/// Thread counts for weight conversion are bounded like maxrun's.
#[test]
fn absurd_job_counts_are_refused() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let absurd = (cpus * 8 + 1).to_string();
    let r = compile(&[OsStr::new("--model"), fixture("tiny-llama").as_os_str(), OsStr::new("-j"), OsStr::new(&absurd)]);
    assert_clean_error(&r, 1, &[&format!("--jobs {absurd}"), "at most that"]);
    assert_clean_error(&compile(&[OsStr::new("--model"), fixture("tiny-llama").as_os_str(), OsStr::new("-j"), OsStr::new("0")]), 1, &["--jobs must be at least 1"]);
}

/// SIGTERM, SIGINT or SIGHUP while the artifact is being written (a cancelled CI
/// job): maxc removes its temporary file and exits with 128 + the signal.
#[test]
fn a_signal_during_the_write_leaves_no_temporary_file() {
    let manifest = workspace_root().join("manifests/smollm2-135m.toml");
    for (signal, number) in [("TERM", 15), ("INT", 2), ("HUP", 1)] {
        let dir = temp_dir(&format!("signal-{signal}"));
        let out = dir.join("x.mef");
        // float32: a 515 MB artifact, long enough to be caught while it is written.
        let mut child = std::process::Command::new(bin("maxc"))
            .args([OsStr::new("compile"), manifest.as_os_str(), OsStr::new("-o"), out.as_os_str(), OsStr::new("--quantization-encoding"), OsStr::new("float32"), OsStr::new("--quiet")])
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let start = std::time::Instant::now();
        loop {
            let writing = std::fs::read_dir(&dir).unwrap().any(|e| e.unwrap().file_name().to_string_lossy().starts_with(".x.mef.tmp-"));
            if writing {
                break;
            }
            assert!(child.try_wait().unwrap().is_none(), "the compile ended before its temporary file was seen");
            assert!(start.elapsed() < std::time::Duration::from_secs(300), "no temporary file within 300 s");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        let pid = child.id().to_string();
        assert!(std::process::Command::new("kill").args([&format!("-{signal}"), &pid]).status().unwrap().success());
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(128 + number), "SIG{signal}: {status:?}");
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(left.is_empty(), "SIG{signal} left {left:?}");
    }
}

/// generation_config.json's sampling defaults are checked as the flags are:
/// out of range or of the wrong type is refused, naming the file and key.
#[test]
fn generation_config_values_out_of_range_are_refused() {
    let cases = [
        (r#"{"do_sample": true, "top_p": 7}"#, "top_p", "7 must be between 0 and 1"),
        (r#"{"do_sample": true, "min_p": -0.5}"#, "min_p", "must be between 0 and 1"),
        (r#"{"do_sample": true, "temperature": -1}"#, "temperature", "must be between 0"),
        (r#"{"do_sample": true, "temperature": "hot"}"#, "temperature", "expected a finite number"),
        (r#"{"top_k": -5}"#, "top_k", "expected an integer >= 0"),
        (r#"{"max_new_tokens": 0}"#, "max_new_tokens", "expected an integer >= 1"),
    ];
    for (i, (json, key, needle)) in cases.iter().enumerate() {
        let dir = temp_dir(&format!("genconfig-{i}"));
        for f in std::fs::read_dir(fixture("tiny-llama")).unwrap() {
            let f = f.unwrap().path();
            std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
        }
        let g = dir.join("generation_config.json");
        let _ = std::fs::remove_file(&g);
        std::fs::write(&g, json).unwrap();
        let r = compile(&[OsStr::new("--model"), dir.as_os_str()]);
        assert_clean_error(&r, 1, &["generation_config.json", key, needle]);
    }
}

/// An activation other than the one maxc lowers is refused, never replaced by
/// SiLU silently (transformers' names, and a nonsense one).
#[test]
fn unsupported_activations_are_refused() {
    for (i, act) in ["gelu", "banana", "relu"].iter().enumerate() {
        let mut c = tiny_llama_config();
        c["hidden_act"] = serde_json::json!(act);
        let dir = model_dir(&format!("act-{i}"), Some(&c.to_string()));
        let r = compile(&[OsStr::new("--model"), dir.as_os_str()]);
        assert_clean_error(&r, 1, &["config.json", "hidden_act", act, "`silu` only"]);
    }
}

/// Two safetensors files that both hold a tensor: refused, naming the tensor
/// and both files (not "the last one read wins").
#[test]
fn a_tensor_in_two_weight_files_is_refused() {
    let dir = model_dir("dup-tensor", None);
    std::os::unix::fs::symlink(fixture("tiny-llama").join("model.safetensors"), dir.join("model-2.safetensors")).unwrap();
    let r = compile(&[OsStr::new("--model"), dir.as_os_str()]);
    assert_clean_error(&r, 1, &["model-2.safetensors", "is also in", "model.safetensors", "one weight file"]);
}

/// num_hidden_layers smaller than the layers in the weights: refused (the extra
/// layers would be dropped without a word).
#[test]
fn fewer_layers_in_the_config_than_in_the_weights_is_refused() {
    let mut c = tiny_llama_config();
    c["num_hidden_layers"] = serde_json::json!(1);
    let dir = model_dir("fewer-layers", Some(&c.to_string()));
    let r = compile(&[OsStr::new("--model"), dir.as_os_str()]);
    assert_clean_error(&r, 1, &["config.json", "num_hidden_layers", "is 1", "layer 1", "model.layers.1."]);
}

/// What maxrun would fail on at run time is refused at compile time: a chat
/// template that does not parse or does not render a conversation, and special
/// token ids outside the vocabulary.
#[test]
fn chat_templates_and_special_ids_are_checked_at_compile_time() {
    for (i, (template, needle)) in [
        ("{% for m in messages %}{{ m.content }}", "chat_template"),
        ("{{ raise_exception('roles must alternate system/user') }}", "roles must alternate"),
    ]
    .iter()
    .enumerate()
    {
        let dir = model_dir(&format!("template-{i}"), None);
        std::fs::write(dir.join("chat_template.jinja"), template).unwrap();
        let r = compile(&[OsStr::new("--model"), dir.as_os_str()]);
        assert_clean_error(&r, 1, &["chat_template", "does not render a conversation", needle]);
    }
    let mut c = tiny_llama_config();
    c["bos_token_id"] = serde_json::json!(99999);
    let dir = model_dir("bos-out-of-vocab", Some(&c.to_string()));
    let r = compile(&[OsStr::new("--model"), dir.as_os_str()]);
    assert_clean_error(&r, 1, &["bos_token_id", "99999 is outside the vocabulary of 49152 tokens"]);
}

/// A tensor the architecture does not read with this config.json is refused,
/// naming it and its file: here a `q_proj.bias` while `attention_bias` is false
/// (built without it, the artifact would compute another model than the checkpoint).
#[test]
fn a_tensor_the_model_does_not_use_is_refused() {
    let dir = edited_safetensors(
        "unused-tensor",
        |h, data| {
            let end = data.len();
            h["model.layers.0.self_attn.q_proj.bias"] = serde_json::json!({"dtype": "F32", "shape": [64], "data_offsets": [end, end + 256]});
            data.extend([0u8; 256]);
        },
        None,
    );
    assert_eq!(tiny_llama_config()["attention_bias"], serde_json::json!(false));
    let r = compile(&[OsStr::new("--model"), dir.as_os_str()]);
    assert_clean_error(&r, 1, &["model.safetensors", "model.layers.0.self_attn.q_proj.bias", "does not use it"]);
    let r = run_bin("maxc", &[OsStr::new("check"), OsStr::new("--model"), dir.as_os_str()]);
    assert!(r.0 == 1 && r.1.contains("q_proj.bias"), "maxc check lists it: {}", r.1);
}

/// A manifest table maxc does not build is refused by name, not parsed and dropped.
#[test]
fn manifest_components_are_refused() {
    let p = manifest("components", "[model]\npath = \"x\"\n[components.vision]\npath = \"v\"\n");
    assert_clean_error(&compile(&[p.as_os_str()]), 1, &["model.toml", "[components.vision]", "not supported", "remove the table"]);
}

/// Config keys that change the computation in some checkpoint family are
/// honoured where maxc builds them and refused elsewhere, never dropped: a
/// Llama config with Gemma's soft-capping, a partial rotary factor, Q/K norms,
/// per-layer attention kinds; a Qwen2 window on some layers only.
#[test]
fn config_keys_maxc_would_ignore_are_refused() {
    let cases: [(&str, serde_json::Value, &str); 5] = [
        ("attn_logit_softcapping", serde_json::json!(50.0), "Gemma2ForCausalLM"),
        ("partial_rotary_factor", serde_json::json!(0.5), "no architecture maxc builds"),
        ("use_qk_norm", serde_json::json!(true), "no architecture maxc builds"),
        ("layer_types", serde_json::json!(["full_attention", "sliding_attention"]), "layer_types[1]"),
        ("query_pre_attn_scalar", serde_json::json!(144), "not LlamaForCausalLM"),
    ];
    for (i, (key, value, needle)) in cases.iter().enumerate() {
        let mut c = tiny_llama_config();
        c[*key] = value.clone();
        let dir = model_dir(&format!("math-key-{i}"), Some(&c.to_string()));
        let r = compile(&[OsStr::new("--model"), dir.as_os_str()]);
        assert_clean_error(&r, 1, &["config.json", key, needle]);
    }
    // Neutral values are accepted.
    let mut c = tiny_llama_config();
    c["partial_rotary_factor"] = serde_json::json!(1.0);
    c["layer_types"] = serde_json::json!(["full_attention", "full_attention"]);
    let dir = model_dir("math-key-neutral", Some(&c.to_string()));
    let r = run_bin("maxc", &[OsStr::new("check"), OsStr::new("--model"), dir.as_os_str()]);
    assert_eq!(r.0, 0, "{} {}", r.1, r.2);
    // Qwen2: the window on layers max_window_layers.. only.
    let src = fixture("tiny-qwen2");
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    c["use_sliding_window"] = serde_json::json!(true);
    c["sliding_window"] = serde_json::json!(8);
    c["max_window_layers"] = serde_json::json!(1);
    let dir = fixture_with("tiny-qwen2", "qwen2-window", &[("config.json", c.to_string())]);
    let r = compile(&[OsStr::new("--model"), dir.as_os_str()]);
    assert_clean_error(&r, 1, &["config.json", "max_window_layers", "slides all layers or none"]);
}

/// A copy of the arch-qwen3-moe fixture (files linked) with `config` edited
/// and, when `tensors` is set, its safetensors header edited.
fn moe_dir(tag: &str, config: impl FnOnce(&mut serde_json::Value), tensors: Option<&dyn Fn(&mut serde_json::Value)>) -> TempDir {
    let src = fixture("arch-qwen3-moe");
    let dir = temp_dir(tag);
    for f in ["model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::os::unix::fs::symlink(src.join(f), dir.join(f)).unwrap();
    }
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config(&mut c);
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    if let Some(edit) = tensors {
        let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        edit(&mut header);
        let h = header.to_string();
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend(h.as_bytes());
        out.extend(&bytes[8 + n..]);
        std::fs::remove_file(dir.join("model.safetensors")).unwrap();
        std::fs::write(dir.join("model.safetensors"), out).unwrap();
    }
    dir
}

/// Mixture-of-experts configurations and checkpoints that disagree: each a
/// refusal naming the file and the key or tensor, never a panic.
#[test]
fn moe_config_and_tensors_that_disagree() {
    let model = |dir: &TempDir| compile(&[OsStr::new("--model"), dir.as_os_str()]);
    // More experts per token than experts.
    let dir = moe_dir("moe-topk", |c| c["num_experts_per_tok"] = 9.into(), None);
    assert_clean_error(&model(&dir), 1, &["config.json", "num_experts_per_tok", "9", "between 1 and"]);
    // Fewer experts than the checkpoint holds: the router's rows say so first;
    // `maxc check` lists the experts past the count too.
    let dir = moe_dir("moe-fewer", |c| c["num_local_experts"] = 6.into(), None);
    assert_clean_error(&model(&dir), 1, &["model.layers.1.mlp.gate.weight", "[8, 64]", "expected [6, 64] from config.json"]);
    let r = run_bin("maxc", &[OsStr::new("check"), OsStr::new("--model"), dir.as_os_str()]);
    assert_clean_error(&r, 1, &["problem(s)"]);
    assert!(r.1.contains("model.layers.2.mlp.experts.6.gate_proj.weight") && r.1.contains("6 experts per layer") && r.1.contains("num_local_experts"), "{}", r.1);
    // More experts than the checkpoint holds.
    let dir = moe_dir("moe-more", |c| c["num_local_experts"] = 10.into(), None);
    assert_clean_error(&model(&dir), 1, &["model.layers.1.mlp.gate.weight", "expected [10, 64] from config.json"]);
    let r = run_bin("maxc", &[OsStr::new("check"), OsStr::new("--model"), dir.as_os_str()]);
    assert!(r.1.contains("model.layers.1.mlp.experts.8.gate_proj.weight"), "{}", r.1);
    // The two spellings of the count disagree.
    let dir = moe_dir("moe-spellings", |c| c["num_experts"] = 4.into(), None);
    assert_clean_error(&model(&dir), 1, &["config.json", "num_local_experts", "num_experts is 4"]);
    // A dense layer that does not exist.
    let dir = moe_dir("moe-dense", |c| c["mlp_only_layers"] = serde_json::json!([0, 7]), None);
    assert_clean_error(&model(&dir), 1, &["config.json", "mlp_only_layers", "layer 7", "num_hidden_layers is 3"]);
    // A missing expert tensor.
    let dir = moe_dir("moe-missing", |_| {}, Some(&|h| {
        let v = h.as_object_mut().unwrap().remove("model.layers.2.mlp.experts.3.up_proj.weight").unwrap();
        h["renamed.weight"] = v;
    }));
    assert_clean_error(&model(&dir), 1, &["model.layers.2.mlp.experts.3.up_proj.weight", "not in the checkpoint"]);
    // A router of the wrong shape.
    let dir = moe_dir("moe-router", |_| {}, Some(&|h| h["model.layers.1.mlp.gate.weight"]["shape"] = serde_json::json!([4, 128])));
    assert_clean_error(&model(&dir), 1, &["model.layers.1.mlp.gate.weight", "[8, 64]", "[4, 128]"]);
}

/// The MoE GGUF with a metadata integer changed: `key`'s value (uint32) set to `value`.
fn moe_gguf(tag: &str, key: &str, value: u32) -> TempPath {
    let mut bytes = std::fs::read(workspace_root().join("tests/golden/gguf/arch-qwen3-moe.f32.gguf")).unwrap();
    let k = key.as_bytes();
    let at = bytes.windows(k.len()).position(|w| w == k).unwrap() + k.len();
    assert_eq!(u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()), 4, "{key}: a uint32 value");
    bytes[at + 4..at + 8].copy_from_slice(&value.to_le_bytes());
    let p = temp_file(tag, "model.gguf");
    std::fs::write(&p, bytes).unwrap();
    p
}

/// A GGUF whose expert count disagrees with its stacked expert tensors, or
/// routes each token to more experts than there are.
#[test]
fn moe_gguf_metadata_that_disagrees_with_the_tensors() {
    let p = moe_gguf("moe-gguf-count", "qwen3moe.expert_count", 4);
    assert_clean_error(&compile(&[OsStr::new("--model"), p.as_os_str()]), 1, &["model.gguf", "blk.0.ffn_gate_exps.weight", "4 experts", "[8, 32, 64]"]);
    let p = moe_gguf("moe-gguf-used", "qwen3moe.expert_used_count", 9);
    assert_clean_error(&compile(&[OsStr::new("--model"), p.as_os_str()]), 1, &["model.gguf", "qwen3moe.expert_used_count", "9", "qwen3moe.expert_count = 8"]);
}
