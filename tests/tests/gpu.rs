//! The GPU path without a GPU: every PTX module maxc emits is assembled by
//! NVIDIA's ptxas for sm_80 and sm_90; a fat artifact (`--target cpu,cuda:sm_90`)
//! runs through its CPU code and matches the golden logits; a GPU-only artifact
//! on a machine without a CUDA driver is refused with a message that says so.

use std::ffi::OsStr;
use std::path::Path;

use maxc_tests::*;

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// Compiles `model` for `target` with `extra` flags, writing the PTX to a fresh
/// directory: (that directory, which holds both, the artifact, the PTX folder).
fn compile_with_ptx(tag: &str, model: &Path, target: &str, extra: &[&str]) -> (TempDir, std::path::PathBuf, std::path::PathBuf) {
    let dir = temp_dir(tag);
    let (out, ptx) = (dir.join("m.mef"), dir.join("ptx"));
    let mut args = vec![os("compile"), os("--model"), model.as_os_str(), os("-o"), out.as_os_str(), os("--target"), os(target), os("--emit-ptx"), ptx.as_os_str()];
    args.extend(extra.iter().map(|s| os(s)));
    let r = run_bin("maxc", &args);
    assert_eq!(r.0, 0, "{}", r.2);
    (dir, out, ptx)
}

fn assemble(ptx: &Path, arch: &str) {
    let file = ptx.join(format!("{arch}.ptx"));
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains(&format!(".target {arch}")), "{}: wrong .target", file.display());
    assert!(text.contains(".entry"), "{}: no kernels", file.display());
    let out = std::process::Command::new(ptxas()).arg(format!("-arch={arch}")).arg(&file).arg("-o").arg(file.with_extension("cubin")).output().unwrap();
    assert!(out.status.success(), "ptxas -arch={arch} {}: {}", file.display(), String::from_utf8_lossy(&out.stderr));
}

#[test]
fn ptxas_accepts_every_module_for_sm_80_and_sm_90() {
    let cases: Vec<(&str, std::path::PathBuf, &[&str])> = vec![
        ("tiny-llama", fixture("tiny-llama"), &[]),
        ("smollm2-f32", smollm2_gguf(), &["--quantization-encoding", "float32"]),
        // The block-quantized kernels (q4_1 layers, q8_0 embedding) and bf16.
        ("smollm2-q4_1", smollm2_gguf(), &["--quantization-encoding", "q4_1"]),
        ("smollm2-bf16", smollm2_gguf(), &["--quantization-encoding", "bfloat16"]),
        // fp8 codes decoded through halves (`cvt.f32.f16`) in the lane-split block GEMV.
        ("smollm2-fp8", smollm2_gguf(), &["--quantization-encoding", "float8_e4m3fn"]),
        // An f16 KV cache: stores round (`cvt.rn.f16.f32`), attention widens.
        ("tiny-llama-kv-f16", fixture("tiny-llama"), &["--kv-cache-encoding", "float16"]),
    ];
    for (tag, model, extra) in cases {
        let (_dir, mef, ptx) = compile_with_ptx(&format!("ptx-{tag}"), &model, "cuda:sm_80,sm_90", extra);
        for arch in ["sm_80", "sm_90"] {
            assemble(&ptx, arch);
        }
        if tag == "smollm2-f32" {
            // The mapping's pieces reach the PTX: coalesced 16-byte vector loads of
            // GEMV rows from global memory, warp shuffles, and for the 1536-long
            // rows of down_proj four-warp tasks meeting in shared memory.
            let text = std::fs::read_to_string(ptx.join("sm_90.ptx")).unwrap();
            for needle in ["ld.global.v4.f32", "shfl.sync.bfly", ".shared", "bar.sync", "bar.warp.sync"] {
                assert!(text.contains(needle), "{tag}: no `{needle}` in the PTX");
            }
        }
        if tag == "tiny-llama-kv-f16" {
            let text = std::fs::read_to_string(ptx.join("sm_90.ptx")).unwrap();
            for needle in [".entry kv_store_kv2_d16_l", "cvt.rn.f16.f32", "cvt.f32.f16", ".entry attention_split16_"] {
                assert!(text.contains(needle), "{tag}: no `{needle}` in the PTX");
            }
        }
        if tag == "smollm2-q4_1" {
            // A GPU-only artifact computes quantized matmuls with the lane-split form.
            let text = std::fs::read_to_string(ptx.join("sm_90.ptx")).unwrap();
            assert!(text.contains(".entry matmul_rows_q4_1_k576_n960_s1"), "{tag}: no lane-split q4_1 GEMV in the PTX");
        }
        // The artifact carries both modules and no CPU code.
        let v = inspect_json(&mef);
        assert_eq!(v["cpu_code"], false, "{tag}");
        let archs: Vec<&str> = v["gpu"].as_array().unwrap().iter().map(|g| g["arch"].as_str().unwrap()).collect();
        assert_eq!(archs, ["sm_80", "sm_90"], "{tag}");
    }
}

/// The mixture-of-experts kernels' PTX: a GPU-only Qwen3-MoE artifact in
/// q8_0 (the router, the grouping, the row-major grouped matmuls decoding
/// blocks) and a fat Mixtral one (the grouped panel matmuls' lane-split GPU
/// form), each assembled by ptxas for sm_80 and sm_90.
#[test]
fn ptxas_accepts_mixture_of_experts_modules() {
    let cases: [(&str, &str, &str, &[&str], &[&str]); 2] = [
        ("qwen3-moe-q8_0", "arch-qwen3-moe", "cuda:sm_80,sm_90", &["--quantization-encoding", "q8_0"], &[".entry moe_route_softmax_topk_norm_e8_k2", ".entry moe_group_e8_k2", ".entry moe_matmul_rows_q8_0_e8_k64_n64", ".entry moe_combine_w64_k2"]),
        ("mixtral-fat", "arch-mixtral", "cpu,cuda:sm_80,sm_90", &[], &[".entry moe_route_topk_softmax_e4_k2", ".entry moe_matmul_panel_e4_k64_n192"]),
    ];
    for (tag, fixture_name, target, extra, needles) in cases {
        let (_dir, _mef, ptx) = compile_with_ptx(&format!("ptx-{tag}"), &fixture(fixture_name), target, extra);
        for arch in ["sm_80", "sm_90"] {
            assemble(&ptx, arch);
        }
        let text = std::fs::read_to_string(ptx.join("sm_90.ptx")).unwrap();
        for needle in needles {
            assert!(text.contains(needle), "{tag}: no `{needle}` in the PTX");
        }
    }
}

/// gpt-oss's GPU-only artifact: attention with sinks (whole attention over key
/// rows and the flash-decoding combine, `_sk` in their names), the router with
/// its bias and the clamped SwiGLU; ptxas assembles it for sm_80 and sm_90.
#[test]
fn ptxas_accepts_gpt_oss_sinks_and_biased_experts() {
    let (_dir, _mef, ptx) = compile_with_ptx("ptx-gpt-oss", &fixture("arch-gpt-oss"), "cuda:sm_80,sm_90", &[]);
    for arch in ["sm_80", "sm_90"] {
        assemble(&ptx, arch);
    }
    let text = std::fs::read_to_string(ptx.join("sm_90.ptx")).unwrap();
    let entries: Vec<&str> = text.lines().filter_map(|l| l.trim().strip_prefix(".visible .entry ").or_else(|| l.trim().strip_prefix(".entry "))).collect();
    for (prefix, part) in [("attention_combine16_", "_sk"), ("attention_h4_kv2_d16_", "_sk"), ("moe_router_", "_bias"), ("moe_act_cswiglu", "_bias")] {
        assert!(entries.iter().any(|e| e.starts_with(prefix) && e.contains(part)), "no {prefix}..{part}.. entry among {entries:?}");
    }
}

#[test]
fn gpu_forms_split_a_decode_step_into_many_tasks() {
    // SmolLM2 (9 query and 3 KV heads of 64, width 576, MLP 1536): the PTX runs
    // RoPE per (token, pair), the attention combine per (token, head), swiglu in
    // chunks of 256 and the q slice of the fused projection in chunks of 64; the
    // kernel table says how many GPU tasks each plan task becomes, and the PTX
    // assembles.
    let (_dir, mef, ptx) = compile_with_ptx("ptx-split", &smollm2_gguf(), "cuda:sm_90", &["--quantization-encoding", "q4_1"]);
    assemble(&ptx, "sm_90");
    let header = maxrun_runtime::artifact::Artifact::open(&mef).unwrap().header;
    let split = |prefix: &str| -> Vec<u32> { header.kernels.iter().filter(|k| k.symbol.starts_with(prefix)).map(|k| k.gpu_task_split).collect() };
    assert_eq!(split("rope_w576_hd64_"), [32, 32], "prefill and decode");
    assert_eq!(split("rope_w192_hd64_"), [32, 32]);
    assert_eq!(split("swiglu_h1536_"), [6, 6]);
    assert_eq!(split("attention_combine16_"), [9, 9], "decode and the batch plans' decode rows");
    assert_eq!(split("slice_w960_o0_l576_"), [9, 9]);
    // The block matmuls of a GPU-only artifact are their GPU form itself (a task
    // per column, no split); embedding and norms keep a task per token.
    for k in &header.kernels {
        if k.symbol.starts_with("matmul") || k.symbol.starts_with("rms_norm") || k.symbol.starts_with("embedding") {
            assert_eq!(k.gpu_task_split, 1, "{}", k.symbol);
        }
    }
    // Row-major float weights keep the CPU's eight-column tasks in the plan and
    // run a task per column on the GPU (`matmul_rowwise`).
    let (_dir, mef, ptx) = compile_with_ptx("ptx-split-bf16", &fixture("tiny-llama"), "cuda:sm_90", &["--quantization-encoding", "bfloat16"]);
    assemble(&ptx, "sm_90");
    let header = maxrun_runtime::artifact::Artifact::open(&mef).unwrap().header;
    let matmuls: Vec<(&str, u32)> = header.kernels.iter().filter(|k| k.symbol.starts_with("matmul")).map(|k| (k.symbol.as_str(), k.gpu_task_split)).collect();
    assert!(!matmuls.is_empty() && matmuls.iter().all(|&(_, split)| split == 8), "{matmuls:?}");
}

#[test]
fn fat_artifact_runs_its_cpu_code_and_matches_the_golden_logits() {
    for (name, model) in [("tiny-llama", fixture("tiny-llama")), ("smollm2-135m", smollm2_gguf())] {
        // float32 weights (a GGUF's default is its own blocks): the panel GEMV below.
        let (_dir, mef, ptx) = compile_with_ptx(&format!("fat-{name}"), &model, "cpu,cuda:sm_90", &["--quantization-encoding", "float32"]);
        assemble(&ptx, "sm_90");
        if name == "smollm2-135m" {
            // The CPU code packs the weights in panels; the PTX runs the lane-split
            // GPU form of that matmul under the same symbol.
            let text = std::fs::read_to_string(ptx.join("sm_90.ptx")).unwrap();
            let start = text.find(".entry matmul_panel_k576_n960_s1(").expect("the panel GEMV is in the PTX");
            let end = text[start + 1..].find(".entry").map_or(text.len(), |e| start + 1 + e);
            assert!(text[start..end].contains("shfl.sync.bfly"), "the fat artifact's GPU panel GEMV is not split across lanes");
        }
        let golden = golden(name);
        for case in cases(&golden) {
            let (_, ours) = dump_logits(&mef, case);
            let (_, gold) = golden_logits(name, case);
            assert_logits_close(&format!("fat {name} {}", case["name"]), &ours, &gold);
        }
    }
}

/// A fat fp8 artifact: the CPU code reads the codes in panels, and the PTX runs
/// the panel GEMV's lane-split form under the same symbol, converting the
/// codes through halves; ptxas accepts it.
#[test]
fn fat_fp8_artifact_runs_panel_gemvs_on_both_sides() {
    let (_dir, mef, ptx) = compile_with_ptx("fat-fp8", &smollm2_gguf(), "cpu,cuda:sm_90", &["--quantization-encoding", "float8_e4m3fn"]);
    assemble(&ptx, "sm_90");
    let text = std::fs::read_to_string(ptx.join("sm_90.ptx")).unwrap();
    let start = text.find(".entry matmul_panel_float8_e4m3fn_k576_n960_s1(").expect("the fp8 panel GEMV is in the PTX");
    let end = text[start + 1..].find(".entry").map_or(text.len(), |e| start + 1 + e);
    for needle in ["shfl.sync.bfly", "cvt.f32.f16"] {
        assert!(text[start..end].contains(needle), "the fat artifact's GPU fp8 panel GEMV has no `{needle}`");
    }
    let r = run_bin("maxrun", &[os("inspect"), mef.as_os_str(), os("--json")]);
    assert!(r.1.contains("panel16"), "no panel16 weights in the fat fp8 artifact");
}

#[test]
fn gpu_only_artifact_without_a_driver_says_so() {
    let has_driver = ["/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1", "/usr/local/cuda/lib64/stubs/libcuda.so"].iter().any(|p| Path::new(p).exists());
    if has_driver {
        eprintln!("a CUDA driver is installed: the no-driver message cannot be checked here");
        return;
    }
    let (_dir, mef, _) = compile_with_ptx("gpu-only", &fixture("tiny-llama"), "cuda:sm_90", &[]);
    // Without CPU code, float matmul weights stay row-major (warps read rows).
    let weights = maxrun_runtime::artifact::Artifact::open(&mef).unwrap().header.weights;
    assert!(weights.iter().all(|w| w.layout == "row_major"), "a GPU-only artifact packs no panels");
    let r = run_bin("maxrun", &[mef.as_os_str(), os("--prompt"), os("hello")]);
    assert_clean_error(&r, 1, &["no CUDA driver", "no CPU code", "--target cpu,cuda:sm_90"]);
    // Asking for the GPU of a fat artifact names the fallback.
    let (_dir, fat, _) = compile_with_ptx("fat-device", &fixture("tiny-llama"), "cpu,cuda:sm_80", &[]);
    let r = run_bin("maxrun", &[fat.as_os_str(), os("--prompt"), os("hello"), os("--device"), os("gpu")]);
    assert_clean_error(&r, 1, &["no CUDA driver", "--device cpu"]);
    // And auto falls back to it, saying why.
    let r = run_bin("maxrun", &[fat.as_os_str(), os("--prompt"), os("hello"), os("-n"), os("2")]);
    assert_eq!(r.0, 0, "{}", r.2);
    assert!(r.2.contains("running the artifact's CPU code"), "{}", r.2);
}

#[test]
fn gpu_flags_without_a_gpu_target_are_refused() {
    let out = temp_file("emit-ptx", "m.mef");
    let model = fixture("tiny-llama");
    let r = run_bin("maxc", &[os("compile"), os("--model"), model.as_os_str(), os("-o"), out.as_os_str(), os("--emit-ptx"), out.with_extension("ptx").as_os_str()]);
    assert_clean_error(&r, 1, &["--emit-ptx", "no GPU part", "cuda:sm_90"]);
    let r = run_bin("maxc", &[os("compile"), os("--model"), model.as_os_str(), os("-o"), out.as_os_str(), os("--target"), os("cuda:sm_80"), os("--backend"), os("cranelift")]);
    assert_clean_error(&r, 1, &["--backend", "no CPU part", "--target cpu,cuda:sm_80"]);
    assert!(!out.exists());
    let r = run_bin("maxrun", &[out.as_os_str(), os("--device"), os("tpu")]);
    assert_eq!(r.0, 2, "{}", r.2);
    assert!(r.2.contains("auto, cpu, gpu or gpu:N"), "{}", r.2);
}

#[test]
fn unknown_gpu_architectures_are_refused() {
    let out = temp_file("sm99", "m.mef");
    let r = run_bin("maxc", &[os("compile"), os("--model"), fixture("tiny-llama").as_os_str(), os("-o"), out.as_os_str(), os("--target"), os("cuda:sm_99")]);
    assert_clean_error(&r, 1, &["sm_99", "sm_80", "sm_90"]);
    assert!(!out.exists());
}
