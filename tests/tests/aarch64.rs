//! aarch64 cross-compilation, run under qemu-user (docs/aarch64.md): artifacts
//! compiled on this (x86-64) machine for `cpu:aarch64` and `cpu:aarch64+dotprod`,
//! run by the runtime cross-compiled for `aarch64-unknown-linux-gnu`
//! (`target/aarch64-unknown-linux-gnu/release/maxrun`, which scripts/test.sh
//! builds) under `qemu-aarch64`, against the golden logits and greedy texts.
//!
//! Plain NEON code runs on qemu's Cortex-A53 (no dot-product instructions: a
//! stray `sdot` would be an illegal instruction), dotprod code on `-cpu max`.
//! Missing tools (qemu-user, the cross linker, the aarch64 maxrun) skip these
//! tests with a message, except under CI (`CI` set), where they fail.
//!
//! Emulation is slow (SmolLM2 decodes at 1-2 tokens/s under qemu on the
//! 2-core build machine): each artifact runs the three golden prompts' logits
//! (two with plain NEON) and one greedy text (24 tokens with dotprod, 8 with
//! plain NEON). Timings under qemu say nothing about speed on ARM hardware.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use maxc_tests::*;

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// Debian's aarch64 libraries (libc6-arm64-cross), the root qemu resolves the
/// aarch64 maxrun's dynamic loader and libraries in; `QEMU_LD_PREFIX` overrides it.
const DEBIAN_CROSS_ROOT: &str = "/usr/aarch64-linux-gnu";

/// qemu runs one at a time: the two cores are shared, and two emulated engines
/// of two threads each would only slow each other down.
static QEMU: Mutex<()> = Mutex::new(());

/// What running aarch64 code here needs.
struct Arm {
    qemu: PathBuf,
    maxrun: PathBuf,
    root: PathBuf,
}

/// A program on `PATH`.
fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join(name)).find(|p| p.is_file())
}

/// The tools, or `None` after printing why these tests are skipped (outside CI;
/// under CI a missing tool fails the test).
fn arm() -> Option<Arm> {
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| workspace_root().join("target"));
    let maxrun = std::env::var_os("MAXC_AARCH64_MAXRUN").map(PathBuf::from).unwrap_or_else(|| target.join("aarch64-unknown-linux-gnu/release/maxrun"));
    let root = std::env::var_os("QEMU_LD_PREFIX").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(DEBIAN_CROSS_ROOT));
    let mut missing = Vec::new();
    let qemu = on_path("qemu-aarch64");
    if qemu.is_none() {
        missing.push("qemu-aarch64 (Debian's qemu-user)".to_string());
    }
    if on_path("aarch64-linux-gnu-gcc").is_none() && std::env::var_os("CC_aarch64_unknown_linux_gnu").is_none() {
        missing.push("aarch64-linux-gnu-gcc (Debian's gcc-aarch64-linux-gnu, the cross linker)".to_string());
    }
    if !root.join("lib").is_dir() {
        missing.push(format!("{} (Debian's libc6-arm64-cross; or set QEMU_LD_PREFIX)", root.display()));
    }
    if !maxrun.is_file() {
        missing.push(format!(
            "{} (cargo build --release --target aarch64-unknown-linux-gnu -p maxrun --bin maxrun; scripts/test.sh builds it)",
            maxrun.display()
        ));
    }
    if missing.is_empty() {
        return Some(Arm { qemu: qemu.expect("checked"), maxrun, root });
    }
    let message = format!("aarch64 tests need {}; scripts/setup.sh installs the tools on Debian", missing.join(", "));
    if std::env::var_os("CI").is_some() {
        panic!("{message} (CI is set: these tests may not be skipped)");
    }
    eprintln!("skipped: {message}");
    None
}

impl Arm {
    /// The aarch64 maxrun under qemu on CPU model `cpu`: (exit code, stdout, stderr).
    fn maxrun(&self, cpu: &str, args: &[&OsStr]) -> (i32, String, String) {
        let mut cmd = std::process::Command::new(&self.qemu);
        cmd.arg("-L").arg(&self.root).args(["-cpu", cpu]).arg(&self.maxrun).args(args);
        let out = cmd.output().expect("qemu-aarch64 starts");
        (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    }

    /// `--dump-logits` of one golden case under qemu: (shape, logits).
    fn logits(&self, cpu: &str, mef: &Path, case: &serde_json::Value) -> (Vec<usize>, Vec<f32>) {
        let ids: Vec<String> = ids(&case["input_ids"]).iter().map(u32::to_string).collect();
        let npy = temp_file("aarch64-logits", "l.npy");
        let ids = ids.join(",");
        let r = self.maxrun(cpu, &[mef.as_os_str(), os("--token-ids"), os(&ids), os("--dump-logits"), npy.as_os_str()]);
        assert_eq!(r.0, 0, "aarch64 maxrun --dump-logits failed: {}", r.2);
        maxrun_runtime::npy::read_f32(&npy).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// SmolLM2 as the default manifest compiles it (the GGUF's Q4_1 blocks, the
/// Q8_0 embedding / lm_head, int16 activations: byte planes in prefill, words
/// at decode; an f16 KV cache), for `target`, run under qemu's `cpu`: the
/// golden logits of every case of at most `max_prompt` tokens and the greedy
/// text of the shortest: its first `tokens` tokens (the golden text has 24;
/// fewer compare a prefix of it).
fn smollm2_matches_golden(target: &str, cpu: &str, max_prompt: usize, tokens: usize) {
    let Some(arm) = arm() else { return };
    let started = std::time::Instant::now();
    let mef = compile_model("aarch64-smollm2", &smollm2_gguf(), &["--target", target, "--quantization-encoding", "q4_1", "--kv-cache-encoding", "float16", "--quiet"]);
    let v = inspect_json(&mef);
    assert_eq!(v["target"]["triple"], "aarch64-unknown-linux-gnu", "{}", v["target"]);
    let _one_at_a_time = QEMU.lock().unwrap_or_else(|e| e.into_inner());
    let golden = golden("smollm2-135m");
    for (i, case) in cases(&golden).iter().enumerate().filter(|(_, c)| c["input_ids"].as_array().unwrap().len() <= max_prompt) {
        let what = format!("{target} on qemu {cpu}, case {i}");
        let (shape, ours) = arm.logits(cpu, &mef, case);
        let (gshape, gold) = golden_logits("smollm2-135m", case);
        assert_eq!(shape, gshape, "{what}");
        assert_logits_close(&what, &ours, &gold);
    }
    let shortest = cases(&golden).iter().min_by_key(|c| c["input_ids"].as_array().unwrap().len()).unwrap();
    let n = tokens.to_string();
    let r = arm.maxrun(cpu, &[mef.as_os_str(), os("--prompt"), os(shortest["prompt"].as_str().unwrap()), os("--temperature"), os("0"), os("-n"), os(&n), os("--verbose")]);
    assert_eq!(r.0, 0, "{target}: {}", r.2);
    let golden_text = shortest["greedy_text"].as_str().unwrap();
    if tokens == 24 {
        assert_eq!(r.1, golden_text, "{target} on qemu {cpu}: greedy text");
    } else {
        assert!(!r.1.is_empty() && golden_text.starts_with(&r.1), "{target} on qemu {cpu}: greedy text {:?} does not begin {golden_text:?}", r.1);
    }
    assert!(r.2.contains(&format!("generated: {tokens} tokens")), "{}", r.2);
    assert!(r.2.contains(target), "--verbose names the CPU code's target: {}", r.2);
    eprintln!("{target} on qemu {cpu}: compile and run in {:.1} s", started.elapsed().as_secs_f64());
}

/// Plain NEON runs at a third of the emulated speed of dotprod code (qemu
/// emulates `smull`, `saddlp` and `addp` one by one where one `sdot` does):
/// the two shorter prompts' logits (10 and 5 tokens; the 17-token one alone
/// took 17 s) and 8 greedy tokens, which run every decode kernel.
#[test]
fn smollm2_for_aarch64_neon_matches_golden_under_qemu() {
    smollm2_matches_golden("cpu:aarch64", "cortex-a53", 10, 8);
}

#[test]
fn smollm2_for_aarch64_dotprod_matches_golden_under_qemu() {
    smollm2_matches_golden("cpu:aarch64+dotprod", "max", usize::MAX, 24);
}

/// The kernel forms the SmolLM2 run does not reach: float GEMVs (tiny-llama in
/// float32, against its golden logits and greedy text) and the int8 activations
/// of `--activation-encoding int8` on Q8_0 weights (signed levels, with and
/// without dotprod), whose aarch64 logits must match the same artifact's
/// x86-64 ones (the integer dots are exact; floats differ by summation order
/// at most).
#[test]
fn float_and_int8_kernels_match_under_qemu() {
    let Some(arm) = arm() else { return };
    let golden = golden("tiny-llama");
    let case = &cases(&golden)[0];
    let f32_mef = compile_model("aarch64-f32", &fixture("tiny-llama"), &["--target", "cpu:aarch64", "--quiet"]);
    let _one_at_a_time = QEMU.lock().unwrap_or_else(|e| e.into_inner());
    assert_logits_close("tiny-llama float32 on aarch64", &arm.logits("cortex-a53", &f32_mef, case).1, &golden_logits("tiny-llama", case).1);
    let r = arm.maxrun("cortex-a53", &[f32_mef.as_os_str(), os("--prompt"), os(case["prompt"].as_str().unwrap()), os("--temperature"), os("0"), os("-n"), os("24")]);
    assert_eq!(r.0, 0, "{}", r.2);
    assert_eq!(r.1, case["greedy_text"].as_str().unwrap(), "tiny-llama float32 on aarch64: greedy text");
    let flags = ["--quantization-encoding", "q8_0", "--activation-encoding", "int8", "--quiet"];
    let x86 = compile_model("x86-int8", &fixture("tiny-llama"), &flags);
    let reference = dump_logits(&x86, case).1;
    for (target, cpu) in [("cpu:aarch64", "cortex-a53"), ("cpu:aarch64+dotprod", "max")] {
        let mef = compile_model("aarch64-int8", &fixture("tiny-llama"), &[&["--target", target][..], &flags].concat());
        assert_logits_close(&format!("tiny-llama q8_0 int8 on {target}"), &arm.logits(cpu, &mef, case).1, &reference);
    }
}

/// Code for one architecture is refused on the other, naming both, before any
/// of it runs: the x86-64 maxrun with an aarch64 artifact, the aarch64 one with
/// an x86-64 artifact; and dotprod code on a core without dotprod.
#[test]
fn artifacts_for_another_architecture_or_core_are_refused() {
    let Some(arm) = arm() else { return };
    let a64 = compile_model("aarch64-refused", &fixture("tiny-llama"), &["--target", "cpu:aarch64+dotprod", "--quiet"]);
    let r = run_bin("maxrun", &[a64.as_os_str(), os("--prompt"), os("hi")]);
    assert_clean_error(&r, 1, &["code is for aarch64-unknown-linux-gnu", "this machine is x86_64", "--target cpu"]);
    let x86 = compile_model("x86-refused", &fixture("tiny-llama"), &["--target", "cpu:x86-64-v3", "--quiet"]);
    let _one_at_a_time = QEMU.lock().unwrap_or_else(|e| e.into_inner());
    let r = arm.maxrun("max", &[x86.as_os_str(), os("--prompt"), os("hi")]);
    assert_eq!(r.0, 1, "{}", r.2);
    for needle in ["code is for x86_64-unknown-linux-gnu", "this machine is aarch64", "--target cpu:aarch64"] {
        assert!(r.2.contains(needle), "missing `{needle}`: {}", r.2);
    }
    let r = arm.maxrun("cortex-a53", &[a64.as_os_str(), os("--prompt"), os("hi")]);
    assert_eq!(r.0, 1, "{}", r.2);
    for needle in ["needs CPU features this machine lacks: dotprod", "--target cpu:aarch64"] {
        assert!(r.2.contains(needle), "missing `{needle}`: {}", r.2);
    }
}
