//! Sharding over a device mesh (`--devices cpu:0,1`): sharded artifacts against the
//! golden logits and the unsharded artifact's greedy text, the per-device weight
//! bytes the header records, snapshots of the shard pass's per-device graphs
//! (tests/ir/shard, re-bless with MAXC_BLESS=1), and bad meshes.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use maxc::graph::text::{parse, print};
use maxc::graph::verify::verify;
use maxc::passes::shard::Shard;
use maxc::passes::Pass;
use maxc::sharding::ShardTarget;
use maxc_tests::*;
use maxrun_runtime::artifact::Artifact;

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

fn model_path(name: &str) -> PathBuf {
    if name == "smollm2-135m" {
        smollm2_gguf()
    } else {
        fixture(name)
    }
}

fn greedy_text(mef: &Path, prompt: &str) -> String {
    let r = run_bin("maxrun", &[mef.as_os_str(), os("--prompt"), os(prompt), os("--temperature"), os("0"), os("-n"), os("24")]);
    assert_eq!(r.0, 0, "{}: {}", mef.display(), r.2);
    r.1
}

/// Every golden case: the sharded artifact's logits within the fixtures README
/// tolerance, its greedy text identical to the unsharded artifact's (and to the
/// golden text).
fn check_sharded(name: &str) -> (TempPath, TempPath) {
    // float32 weights for every model (a GGUF's default is its own blocks; the
    // q4_1 mesh has its own test below).
    let f32 = ["--quantization-encoding", "float32"];
    let whole = compile_model(name, &model_path(name), &f32);
    let sharded = compile_model(name, &model_path(name), &[&f32[..], &["--devices", "cpu:0,1"]].concat());
    let golden = golden(name);
    for (i, case) in cases(&golden).iter().enumerate() {
        let what = format!("{name} case {i} on cpu:0,1");
        let (shape, ours) = dump_logits(&sharded, case);
        let (gshape, gold) = golden_logits(name, case);
        assert_eq!(shape, gshape, "{what}");
        assert_logits_close(&what, &ours, &gold);
        let prompt = case["prompt"].as_str().unwrap();
        let text = greedy_text(&sharded, prompt);
        assert_eq!(text, greedy_text(&whole, prompt), "{what}: greedy text differs from the unsharded artifact");
        assert_eq!(text, case["greedy_text"].as_str().unwrap(), "{what}: greedy text");
    }
    (whole, sharded)
}

/// Weight bytes per device: every sharded tensor holds exactly 1/N of the
/// unsharded tensor's bytes on each device, and each device's section holds what
/// the header says.
fn check_weight_split(whole: &Path, sharded: &Path, devices: u64) -> (u64, u64) {
    let (w, s) = (Artifact::open(whole).unwrap(), Artifact::open(sharded).unwrap());
    assert_eq!(s.header.sub_models.len() as u64, devices);
    assert_eq!(s.header.mesh.len() as u64, devices);
    // By name without the layout: a tied table is packed (`@panel16`) whole
    // and gathered row-major when it is sharded by rows; the layout moves no bytes.
    let without_layout = |name: &str| name.replace("@panel16", "");
    let unsharded = |name: &str| -> u64 { w.header.weights.iter().filter(|e| without_layout(&e.name) == name).map(|e| e.len).sum() };
    let mut sharded_tensors = 0;
    for e in s.header.weights.iter().filter(|e| e.name.contains("@shard")) {
        let base = e.name.split("@shard").next().unwrap();
        let part = e.name.rsplit_once('#').map(|(_, p)| format!("#{p}")).unwrap_or_default();
        let whole_name = format!("{base}{part}");
        let total = unsharded(&whole_name);
        assert!(total > 0, "{}: no unsharded `{whole_name}`", e.name);
        assert_eq!(e.len * devices, total, "{}: a shard holds 1/{devices} of `{whole_name}`", e.name);
        sharded_tensors += 1;
    }
    assert!(sharded_tensors > 0, "no sharded tensors");
    for (d, m) in s.header.sub_models.iter().enumerate() {
        let bytes: u64 = s.header.weights.iter().filter(|e| e.device as usize == d).map(|e| e.len).sum();
        assert!(m.weight_bytes >= bytes && m.weight_bytes < bytes + 64 * s.header.weights.len() as u64, "device {d}: section {} vs entries {bytes}", m.weight_bytes);
        assert_eq!(m.device, format!("cpu:{d}"));
    }
    let total_whole: u64 = w.header.weights.iter().map(|e| e.len).sum();
    let device0: u64 = s.header.weights.iter().filter(|e| e.device == 0).map(|e| e.len).sum();
    (total_whole, device0)
}

#[test]
fn tiny_llama_on_two_cpu_devices_matches_golden() {
    let (whole, sharded) = check_sharded("tiny-llama");
    let (total, device0) = check_weight_split(&whole, &sharded, 2);
    // Everything but the norms is split: each device holds half, within 1%.
    assert!((device0 as f64 - total as f64 / 2.0).abs() < 0.01 * total as f64, "device 0 holds {device0} of {total}");
    // The header says so too, and `maxrun inspect --json` lists the sub-models.
    let report = inspect_json(&sharded);
    let subs = report["sub_models"].as_array().unwrap();
    assert_eq!(subs.len(), 2);
    for (d, m) in subs.iter().enumerate() {
        assert_eq!(m["name"], format!("shard{d}"));
        assert_eq!(m["device"], format!("cpu:{d}"));
        let bytes = m["weight_bytes"].as_u64().unwrap();
        assert!((bytes as f64 - total as f64 / 2.0).abs() < 0.01 * total as f64, "inspect: device {d} holds {bytes} of {total}");
    }
    assert_eq!(report["mesh"]["spec"], "cpu:0,1");
}

#[test]
fn tiny_qwen2_on_two_cpu_devices_matches_golden() {
    let (whole, sharded) = check_sharded("tiny-qwen2");
    check_weight_split(&whole, &sharded, 2);
}

/// SmolLM2 has 3 KV heads: on 2 devices attention is replicated (the compile
/// says so), the MLP, embedding and lm_head are split.
#[test]
fn smollm2_on_two_cpu_devices_matches_golden() {
    let (whole, sharded) = check_sharded("smollm2-135m");
    let (total, device0) = check_weight_split(&whole, &sharded, 2);
    // Attention weights (q, k, v, o: 0.88M of 2.65M + 0.88M parameters per layer)
    // stay on both devices, so a device holds more than half but well under all.
    assert!(device0 > total / 2 && device0 < total * 2 / 3, "device 0 holds {device0} of {total}");
    let a = Artifact::open(&sharded).unwrap();
    let kv_whole = Artifact::open(&whole).unwrap().header.kv_cache.row_elems;
    assert_eq!(a.header.kv_cache.row_elems, kv_whole, "replicated attention keeps every KV head");
}

/// The GGUF's own Q4_1 blocks, split: down_proj is cut along its input features,
/// i.e. inside every row at block boundaries, and must still give the golden
/// logits (the golden is the exact dequantization of these blocks).
#[test]
fn smollm2_q4_1_blocks_split_across_devices_keep_the_golden_logits() {
    let sharded = compile_model("q4-1-mesh", &smollm2_gguf(), &["--devices", "cpu:0,1", "--quantization-encoding", "q4_1"]);
    let a = Artifact::open(&sharded).unwrap();
    let down: Vec<_> = a.header.weights.iter().filter(|w| w.name.starts_with("model.layers.0.mlp.down_proj.weight@shard")).collect();
    assert!(down.iter().all(|w| w.encoding == "q4_1" && w.shape == [576, 768]), "{down:?}");
    let golden = golden("smollm2-135m");
    let case = &cases(&golden)[0];
    let (_, ours) = dump_logits(&sharded, case);
    let (_, gold) = golden_logits("smollm2-135m", case);
    assert_logits_close("smollm2 q4_1 on cpu:0,1", &ours, &gold);
}

/// Every other architecture on two devices: logits within tolerance of the golden
/// ones. Where attention cannot be split (OLMo-2 normalizes q and k over the whole
/// projection; GPT-2 fuses q/k/v into one matmul that is sliced after), it runs
/// replicated (Phi-3's fused checkpoints are split at import, so it splits), and nothing is split only to be gathered back: the one
/// all-gather left is the logits'.
#[test]
fn every_architecture_on_two_devices_matches_golden() {
    for name in ["arch-gemma2", "arch-gemma3", "arch-qwen3", "arch-olmo2", "arch-phi3", "arch-granite", "arch-gpt2"] {
        let mef = compile_model(name, &fixture(name), &["--devices", "cpu:0,1"]);
        let golden = golden(name);
        for (i, case) in cases(&golden).iter().enumerate().take(2) {
            let (_, ours) = dump_logits(&mef, case);
            let (_, gold) = golden_logits(name, case);
            assert_logits_close(&format!("{name} case {i} on cpu:0,1"), &ours, &gold);
        }
        let model = maxc::import::import(&fixture(name), None).unwrap();
        let mut g = maxc::builders::build_graph(&model).unwrap();
        let shard = Some(ShardTarget { index: 0, devices: 2, split_attention: true });
        maxc::passes::run_pipeline(&mut g, &maxc::passes::PipelineOptions { verify_each: true, shard, ..Default::default() }).unwrap();
        assert_eq!(g.count("all_gather"), 1, "{name}: only the logits are gathered");
        let split_attention = g.nodes.iter().any(|n| matches!(n.op, maxc::graph::Op::Attention { .. }) && n.ty.placement != maxc::graph::Placement::Replicated);
        assert_eq!(split_attention, !["arch-olmo2", "arch-gpt2"].contains(&name), "{name}: attention split by heads");
    }
}

/// The mixture-of-experts fixtures on two devices: attention split by heads,
/// every expert on both devices (expert parallelism is a later issue's), the
/// golden logits kept.
#[test]
fn mixture_of_experts_on_two_devices_match_golden() {
    for name in ["arch-qwen3-moe", "arch-mixtral"] {
        let mef = compile_model(name, &fixture(name), &["--devices", "cpu:0,1"]);
        let golden = golden(name);
        for (i, case) in cases(&golden).iter().enumerate() {
            let (_, ours) = dump_logits(&mef, case);
            let (_, gold) = golden_logits(name, case);
            assert_logits_close(&format!("{name} case {i} on cpu:0,1"), &ours, &gold);
        }
    }
}

#[test]
fn attention_split_by_heads_halves_the_kv_cache() {
    let whole = compile_model("kv", &fixture("tiny-llama"), &[]);
    let sharded = compile_model("kv", &fixture("tiny-llama"), &["--devices", "cpu:0,1", "--attention-sharding", "heads"]);
    let (w, s) = (Artifact::open(&whole).unwrap(), Artifact::open(&sharded).unwrap());
    assert_eq!(s.header.kv_cache.row_elems * 2, w.header.kv_cache.row_elems);
    assert_eq!(s.header.sub_models[1].kv_bytes_per_token * 2, w.header.main().kv_bytes_per_token);
}

#[test]
fn bad_meshes_fail_clearly() {
    let llama = fixture("tiny-llama");
    let out = temp_file("bad-mesh", "m.mef");
    let compile = |extra: &[&str]| {
        let mut args = vec![os("compile"), os("--model"), llama.as_os_str(), os("-o"), out.as_os_str()];
        args.extend(extra.iter().map(|s| os(s)));
        run_bin("maxc", &args)
    };
    // tiny-llama's MLP has 160 features: 3 devices do not divide it.
    assert_clean_error(&compile(&["--devices", "cpu:0,1,2"]), 1, &["--devices", "intermediate_size is 160", "3 devices"]);
    assert_clean_error(&compile(&["--devices", "tpu:0,1"]), 1, &["--devices", "`tpu` is not a device kind"]);
    assert_clean_error(&compile(&["--devices", "gpu:all"]), 1, &["--devices", "gpu:0,1,2,3"]);
    assert_clean_error(&compile(&["--devices", "cpu:0,1", "--attention-sharding", "columns"]), 1, &["--attention-sharding", "auto, heads or replicated"]);
    assert_clean_error(&compile(&["--devices", "gpu:0,1"]), 1, &["--devices", "needs GPU code", "--target cuda:sm_90"]);
    assert!(!out.exists(), "no artifact after a failed compile");
    // tiny-qwen2 has 2 KV heads: a 4-device split by heads is refused, naming both.
    let qwen = fixture("tiny-qwen2");
    let r = run_bin("maxc", &[os("compile"), os("--model"), qwen.as_os_str(), os("-o"), out.as_os_str(), os("--devices"), os("cpu:0,1,2,3"), os("--attention-sharding"), os("heads")]);
    assert_clean_error(&r, 1, &["num_key_value_heads is 2", "4 devices"]);
    assert!(!out.exists());
}

/// `--dump-ir` with `--stop-after shard` shows each device's graph, placements
/// and collectives included, without compiling.
#[test]
fn dump_ir_shows_each_devices_placements() {
    let dir = temp_dir("dump-sharded");
    let llama = fixture("tiny-llama");
    let r = run_bin("maxc", &[os("compile"), os("--model"), llama.as_os_str(), os("--devices"), os("cpu:0,1"), os("--stop-after"), os("shard"), os("--dump-ir"), dir.as_os_str()]);
    assert_eq!(r.0, 0, "{}", r.2);
    assert!(r.2.contains("on device 1"), "{}", r.2);
    for d in 0..2 {
        let text = std::fs::read_to_string(dir.join(format!("device{d}/04-shard.mxir"))).unwrap();
        assert!(text.contains("all_reduce") && text.contains("@sharded(1)") && text.contains("@partial_sum"), "device {d}");
        assert!(text.contains(&format!("shard_index = {d}")), "device {d} reads its own slices");
    }
    let r = run_bin("maxc", &[os("compile"), os("--model"), llama.as_os_str(), os("--stop-after"), os("shard")]);
    assert_clean_error(&r, 1, &["--stop-after", "--devices cpu:0,1"]);
}

/// A mesh of GPUs compiles (PTX per device) but this maxrun runs CPU meshes only:
/// it says so instead of running the wrong thing.
#[test]
fn gpu_meshes_are_refused_at_run_time_with_a_reason() {
    let mef = compile_model("gpu-mesh", &fixture("tiny-llama"), &["--devices", "gpu:0,1", "--target", "cpu,cuda:sm_90"]);
    let a = Artifact::open(&mef).unwrap();
    assert_eq!(a.header.mesh.spec(), "gpu:0,1");
    assert_eq!(a.header.sub_models[1].device, "gpu:1");
    let r = run_bin("maxrun", &[mef.as_os_str(), os("--prompt"), os("Hi"), os("-n"), os("2")]);
    assert_clean_error(&r, 1, &["gpu:0,1"]);
    let r = run_bin("maxrun", &[mef.as_os_str(), os("--device"), os("cpu"), os("--prompt"), os("Hi"), os("-n"), os("2")]);
    assert_clean_error(&r, 1, &["gpu:0,1", "--devices cpu:0,1"]);
}

/// The shard pass on tiny-llama's graph for each device of a 2-device mesh, and
/// for tiny-qwen2 (biases, tied embeddings): snapshots, and structure a wrong
/// pass would not have.
#[test]
fn shard_pass_snapshots() {
    let bless = std::env::var_os("MAXC_BLESS").is_some();
    let dir = workspace_root().join("tests/ir/shard");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let input = entry.unwrap().path();
        if !input.to_string_lossy().ends_with(".mxir") || input.to_string_lossy().contains(".device") {
            continue;
        }
        let before = parse(&std::fs::read_to_string(&input).unwrap()).unwrap();
        verify(&before).unwrap();
        for index in 0..2 {
            let mut after = before.clone();
            Shard { target: ShardTarget { index, devices: 2, split_attention: true } }.run(&mut after).unwrap();
            verify(&after).unwrap_or_else(|e| panic!("{}: {e}", input.display()));
            let layers = before.count("attention");
            // Megatron's cut: one all-reduce per attention and per MLP block, one for
            // the vocabulary-split embedding, one all-gather of the logits.
            assert_eq!(after.count("all_reduce"), 2 * layers + 1, "{}", input.display());
            assert_eq!(after.count("all_gather"), 1);
            assert_eq!(after.count("shard_slice"), 0, "no value is computed whole and then cut");
            let text = print(&after);
            assert_eq!(parse(&text).unwrap(), after, "the sharded graph prints and parses back");
            let expected_path = input.with_extension(format!("device{index}.expected.mxir"));
            if bless {
                std::fs::write(&expected_path, &text).unwrap();
            } else {
                let expected = std::fs::read_to_string(&expected_path).unwrap_or_else(|_| panic!("{} missing", expected_path.display()));
                assert_eq!(text, expected, "{}: snapshot differs (MAXC_BLESS=1 to update after review)", expected_path.display());
            }
            checked += 1;
        }
    }
    assert!(checked >= 4);
}
