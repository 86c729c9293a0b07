//! Kernel filetests: `tests/ir/kernels/*.kir` hold kernels in the kernel IR's
//! text form (kernels/src/ir_text.rs), each after comment lines that say what it
//! covers and how to launch it:
//!
//! ```text
//! # run: seq=3 sizes=192,64,192 int_max=40 tol=1e-5
//! ```
//!
//! (`sizes`: each parameter's element count; integer inputs are drawn below
//! `int_max`; floats may differ by `tol * (1 + |expected|)`; a file may have
//! several run lines). For every file the test
//! - parses and validates the kernel and checks the file holds it in the
//!   printer's canonical form;
//! - runs every run line on random inputs through the interpreter (the
//!   reference) and compares with the interpreter's GPU mapping (warps and
//!   lanes, the NVPTX lowering's reference), LLVM for this machine, LLVM for
//!   x86-64-v3 and Cranelift;
//! - compares its lowering with the snapshot beside it (`NAME.lowering`: how
//!   many of each instruction the x86-64-v3 assembly and the sm_90 PTX hold, so
//!   that a lost vectorization or a dot instruction gone missing shows as a
//!   small diff), and assembles the PTX with ptxas.
//!
//! `MAXC_BLESS=1` rewrites the files in canonical form and the snapshots (review
//! the diff). A new filetest is a `.kir` file with a run line (write the kernel
//! by hand or take it from `maxc compile --dump-ir DIR`), then one blessed run.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use maxc_codegen::target::GpuTarget;
use maxc_codegen::CpuTarget;
use maxc_kernels::ir_text;
use maxc_kernels::Kernel;
use maxc_tests::kernel_check::{assert_matches_interpreter, assert_warp_mapping_matches, inputs, Case, Rng};
use maxc_tests::{ptxas, temp_dir, workspace_root};
use maxrun_runtime::code::LoadedCode;

/// One `.kir` file: its kernel and run lines.
struct FileTest {
    path: PathBuf,
    kernel: Kernel,
    runs: Vec<Run>,
}

/// A `# run:` line.
struct Run {
    seq: u64,
    sizes: Vec<usize>,
    int_max: i32,
    tol: f32,
}

fn dir() -> PathBuf {
    workspace_root().join("tests/ir/kernels")
}

fn bless() -> bool {
    std::env::var_os("MAXC_BLESS").is_some()
}

impl Run {
    /// `kernel` launched as this line says.
    fn case(&self, kernel: &Kernel) -> Case {
        Case { kernel: kernel.clone(), sizes: self.sizes.clone(), int_max: self.int_max, seq: self.seq, tol: self.tol }
    }
}

/// Reads `# run: key=value ...`.
fn run_line(path: &Path, line: &str) -> Run {
    let mut run = Run { seq: 0, sizes: Vec::new(), int_max: 1, tol: f32::NAN };
    for field in line.split_whitespace() {
        let (key, value) = field.split_once('=').unwrap_or_else(|| panic!("{}: `{field}` is not key=value", path.display()));
        let bad = |e: &dyn std::fmt::Display| -> ! { panic!("{}: {key}={value}: {e}", path.display()) };
        match key {
            "seq" => run.seq = value.parse().unwrap_or_else(|e| bad(&e)),
            "sizes" => run.sizes = value.split(',').map(|n| n.parse().unwrap_or_else(|e| bad(&e))).collect(),
            "int_max" => run.int_max = value.parse().unwrap_or_else(|e| bad(&e)),
            "tol" => run.tol = value.parse().unwrap_or_else(|e| bad(&e)),
            _ => bad(&"unknown key (seq, sizes, int_max, tol)"),
        }
    }
    assert!(run.seq > 0 && run.tol >= 0.0, "{}: a run line needs seq > 0 and tol", path.display());
    run
}

fn read(path: &Path) -> FileTest {
    let text = std::fs::read_to_string(path).unwrap();
    let header: String = text.lines().take_while(|l| l.starts_with('#')).map(|l| format!("{l}\n")).collect();
    let kernel = ir_text::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    kernel.validate().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    // As `maxc compile --dump-ir` names them.
    assert_eq!(path.file_stem().map(|s| s.to_string_lossy().to_string()), Some(kernel.name.clone()), "{}: the file is not named after its kernel", path.display());
    let runs: Vec<Run> = header.lines().filter_map(|l| l.strip_prefix("# run:")).map(|l| run_line(path, l)).collect();
    assert!(!runs.is_empty(), "{}: no `# run:` line", path.display());
    for r in &runs {
        assert_eq!(r.sizes.len(), kernel.params.len(), "{}: sizes has {} entries for {} parameters", path.display(), r.sizes.len(), kernel.params.len());
    }
    let canonical = format!("{header}{}", ir_text::print(&kernel));
    if text != canonical {
        assert!(bless(), "{}: not in the printer's canonical form (MAXC_BLESS=1 rewrites it)", path.display());
        std::fs::write(path, &canonical).unwrap();
    }
    FileTest { path: path.to_path_buf(), kernel, runs }
}

fn filetests() -> Vec<FileTest> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir()).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "kir")).collect();
    paths.sort();
    let tests: Vec<FileTest> = paths.iter().map(|p| read(p)).collect();
    let mut names = HashSet::new();
    for t in &tests {
        assert!(names.insert(t.kernel.name.clone()));
    }
    assert!(tests.len() >= 12, "only {} filetests", tests.len());
    tests
}

/// Every run of every file: the interpreter against `compile`d code (three
/// random input sets each).
fn check_backend(spec: &str, tests: &[FileTest], compile: impl Fn(&[Kernel]) -> Vec<u8>) {
    let kernels: Vec<Kernel> = tests.iter().map(|t| t.kernel.clone()).collect();
    let loaded = LoadedCode::load(&compile(&kernels)).unwrap();
    let mut rng = Rng(0x6b69_7266);
    for t in tests {
        let f = loaded.kernel(&t.kernel.name).unwrap();
        for r in &t.runs {
            let case = r.case(&t.kernel);
            for trial in 0..3 {
                assert_matches_interpreter(&format!("{spec} ({})", t.path.display()), f, &case, inputs(&case, &mut rng), trial);
            }
        }
    }
}

#[test]
fn filetests_parse_in_canonical_form() {
    let tests = filetests();
    // Each file's kernel prints back to the file (checked in `read`) and parses
    // back to itself.
    for t in &tests {
        assert_eq!(ir_text::parse(&ir_text::print(&t.kernel)).as_ref(), Ok(&t.kernel), "{}", t.path.display());
    }
}

#[test]
fn filetests_gpu_mapping_matches_interpreter() {
    let mut rng = Rng(0x7761_7270);
    for t in filetests() {
        for r in &t.runs {
            let case = r.case(&t.kernel);
            let inputs = inputs(&case, &mut rng);
            assert_warp_mapping_matches(&t.path.display().to_string(), &case, inputs);
        }
    }
}

#[test]
fn filetests_llvm_host_match_interpreter() {
    let target = CpuTarget::host();
    check_backend("llvm cpu", &filetests(), |k| maxc_codegen::llvm::compile_shared(k, &target).unwrap().shared_object);
}

#[test]
fn filetests_llvm_x86_64_v3_match_interpreter() {
    let target = CpuTarget::parse("cpu:x86-64-v3").unwrap();
    check_backend("llvm x86-64-v3", &filetests(), |k| maxc_codegen::llvm::compile_shared(k, &target).unwrap().shared_object);
}

#[test]
fn filetests_cranelift_match_interpreter() {
    check_backend("cranelift", &filetests(), |k| maxc_codegen::cranelift::compile_shared(k).unwrap().shared_object);
}

/// How many times each instruction occurs in assembly `text`, one
/// `mnemonic count` line each in name order: x86 mnemonics (`vpdpbusd`), PTX
/// opcodes with their modifiers (`ld.global.nc.f32`), predicates dropped. Labels,
/// directives and comments are not instructions.
fn instruction_counts(text: &str) -> String {
    let mut counts = std::collections::BTreeMap::<&str, usize>::new();
    for line in text.lines() {
        let line = line.trim();
        let line = match line.strip_prefix('@') {
            Some(predicated) => predicated.split_once(char::is_whitespace).map_or("", |(_, rest)| rest.trim_start()),
            None => line,
        };
        let Some(op) = line.split(|c: char| c.is_whitespace() || c == ';').next() else { continue };
        if op.is_empty() || op.ends_with(':') || op.starts_with(['.', '#', '/', '{', '}', '(', ')', '$']) || !op.starts_with(|c: char| c.is_ascii_alphabetic()) {
            continue;
        }
        *counts.entry(op).or_default() += 1;
    }
    counts.iter().map(|(op, n)| format!("{op} {n}\n")).collect()
}

/// The snapshot of a kernel's lowering: the instruction counts of its x86-64-v3
/// assembly and of its sm_90 PTX.
fn lowering_snapshot(kernel: &Kernel, ptx: &str) -> String {
    let v3 = CpuTarget::parse("cpu:x86-64-v3").unwrap();
    let asm = maxc_codegen::llvm::emit_assembly(std::slice::from_ref(kernel), &v3).unwrap();
    format!(
        "# The lowering of {}.kir: instructions by name, re-blessed with MAXC_BLESS=1.\n# x86-64-v3 assembly (LLVM)\n{}# sm_90 PTX (LLVM NVPTX)\n{}",
        kernel.name,
        instruction_counts(&asm),
        instruction_counts(ptx)
    )
}

/// `text` against the snapshot at `path` (written under MAXC_BLESS).
fn check_snapshot(path: &Path, text: &str) {
    if bless() {
        std::fs::write(path, text).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e} (MAXC_BLESS=1 writes it)", path.display()));
    if expected != text {
        let (old, new): (HashSet<&str>, HashSet<&str>) = (expected.lines().collect(), text.lines().collect());
        let mut gone: Vec<&str> = old.difference(&new).copied().collect();
        let mut came: Vec<&str> = new.difference(&old).copied().collect();
        gone.sort();
        came.sort();
        panic!("{}: the lowering changed\n  snapshot only: {gone:?}\n  now only:      {came:?}\n(review, then MAXC_BLESS=1 to update)", path.display());
    }
}

#[test]
fn filetests_lowerings_match_their_snapshots_and_ptxas_accepts_them() {
    let sm90 = GpuTarget { arch: "sm_90".into() };
    let scratch = temp_dir("kernel-filetests");
    for t in filetests() {
        let ptx = maxc_codegen::llvm::compile_ptx(std::slice::from_ref(&t.kernel), &sm90).unwrap();
        check_snapshot(&t.path.with_extension("lowering"), &lowering_snapshot(&t.kernel, &ptx));
        let stem = t.path.file_stem().unwrap().to_string_lossy().to_string();
        let ptx_path = scratch.as_path().join(format!("{stem}.ptx"));
        std::fs::write(&ptx_path, &ptx).unwrap();
        let out = std::process::Command::new(ptxas()).arg("-arch=sm_90").arg(&ptx_path).arg("-o").arg(ptx_path.with_extension("cubin")).output().unwrap();
        assert!(out.status.success(), "ptxas -arch=sm_90 ({}): {}", t.path.display(), String::from_utf8_lossy(&out.stderr));
    }
}

/// A broken filetest fails the suite with its file named, not silently: a
/// kernel the verifier refuses, text not in canonical form, no run line, sizes
/// that do not match the parameters, an unknown run key, a file not named after
/// its kernel, and a lowering that differs from its snapshot.
#[test]
fn a_broken_filetest_is_reported_with_its_file() {
    if bless() {
        return;
    }
    let scratch = temp_dir("kernel-filetests-bad");
    let name = "rms_norm_h33_e3727c5ac_sN";
    let good = std::fs::read_to_string(dir().join(format!("{name}.kir"))).unwrap();
    let message = |f: &dyn Fn()| -> String {
        let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).expect_err("accepted");
        e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
    };
    let cases = [
        (name, good.replacen("store p2[", "store p7[", 1), "buffer p7 does not exist"),
        (name, good.replacen("  family", "    family", 1), "canonical form"),
        (name, good.lines().filter(|l| !l.starts_with("# run:")).map(|l| format!("{l}\n")).collect(), "no `# run:` line"),
        (name, good.replacen("sizes=", "sizes=1,", 1), "sizes has 4 entries for 3 parameters"),
        (name, good.replacen("tol=", "tolerance=", 1), "unknown key"),
        ("renamed", good.clone(), "not named after its kernel"),
    ];
    for (n, (stem, text, needle)) in cases.into_iter().enumerate() {
        let case = scratch.as_path().join(format!("case{n}"));
        std::fs::create_dir_all(&case).unwrap();
        let path = case.join(format!("{stem}.kir"));
        std::fs::write(&path, text).unwrap();
        let m = message(&|| drop(read(&path)));
        assert!(m.contains(&path.display().to_string()) && m.contains(needle), "{needle}: {m}");
    }
    let snapshot = scratch.as_path().join(format!("{name}.lowering"));
    std::fs::write(&snapshot, "# x86-64-v3 assembly (LLVM)\nvaddps 3\n").unwrap();
    let m = message(&|| check_snapshot(&snapshot, "# x86-64-v3 assembly (LLVM)\nvaddss 3\n"));
    assert!(m.contains(&snapshot.display().to_string()) && m.contains("vaddps 3") && m.contains("vaddss 3"), "{m}");
}
