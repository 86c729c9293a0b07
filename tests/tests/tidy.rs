//! House rules that a compiler cannot check: module docs on every file, and the
//! runtime's dependency tree free of the compiler, LLVM and Cranelift.

use maxc_tests::workspace_root;

fn rust_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if p.is_dir() && name != "target" && !name.starts_with('.') {
            rust_files(&p, out);
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

#[test]
fn every_rust_file_starts_with_a_module_doc() {
    let mut files = Vec::new();
    for dir in ["runtime-stub", "kernels", "codegen", "compiler", "tests"] {
        rust_files(&workspace_root().join(dir), &mut files);
    }
    assert!(files.len() > 20);
    let missing: Vec<_> = files
        .iter()
        .filter(|f| !std::fs::read_to_string(f).unwrap().trim_start().starts_with("//!"))
        .collect();
    assert!(missing.is_empty(), "files without a `//!` module doc: {missing:?}");
}

#[test]
fn maxrun_links_no_compiler() {
    let out = std::process::Command::new(env!("CARGO"))
        .args(["tree", "-p", "maxrun", "--edges", "normal,build", "--prefix", "none", "--offline"])
        .current_dir(workspace_root())
        .output()
        .expect("cargo tree runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(tree.contains("maxrun"), "{tree}");
    for banned in ["maxc ", "maxc-kernels", "maxc-codegen", "inkwell", "llvm-sys", "cranelift"] {
        assert!(!tree.lines().any(|l| l.starts_with(banned)), "maxrun depends on {banned}:\n{tree}");
    }
}
