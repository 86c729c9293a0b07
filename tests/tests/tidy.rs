//! House rules that a compiler cannot check: module docs on every file, the
//! crates' layering (the format contract at the bottom, the runtime free of the
//! compiler, LLVM and Cranelift, the tiny runtime free of HTTP, async,
//! grammars, CLI and metrics, the compiler free of the server, the kernel IR
//! free of the runtime), and no import cycle among the compiler's modules.

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

/// Every file of tests/tests/ is a module of the one test binary
/// (tests/Cargo.toml has `autotests = false`): a file no `mod` names would
/// never be compiled, and its tests would pass by not running.
#[test]
fn every_test_file_is_a_module_of_the_suite() {
    let dir = workspace_root().join("tests/tests");
    let suite = std::fs::read_to_string(dir.join("suite.rs")).unwrap();
    let named: std::collections::BTreeSet<&str> = suite.lines().filter_map(|l| l.strip_prefix("mod ")?.strip_suffix(';')).collect();
    let mut files = std::collections::BTreeSet::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        if let Some(module) = name.strip_suffix(".rs").filter(|&m| m != "suite") {
            files.insert(module.to_string());
        }
    }
    assert!(files.len() > 20, "{files:?}");
    let missing: Vec<_> = files.iter().filter(|f| !named.contains(f.as_str())).collect();
    assert!(missing.is_empty(), "tests/tests/suite.rs has no `mod` for {missing:?}: their tests never run");
    let stale: Vec<_> = named.iter().filter(|m| !files.contains(**m)).collect();
    assert!(stale.is_empty(), "tests/tests/suite.rs names modules with no file: {stale:?}");
}

/// The crates' layering (docs/ARCHITECTURE.md, "Layers"): each crate and the
/// packages its dependency tree must not contain. The format crate is the
/// contract both halves share; the kernel IR depends on it alone, not on the
/// runtime (and so on none of the runtime's CUDA, tokenizer, template or CLI
/// crates); the backends add LLVM and Cranelift; the tiny runtime links no
/// HTTP, async, grammar, CLI or metrics crate; the engine adds grammars but no
/// server; no runtime crate links a compiler crate; and the compiler links the
/// contract and the tiny runtime (no CUDA), none of the crates above it.
/// (`maxrun ` with its space is the CLI package, not every `maxrun-*`.)
const LAYERS: &[(&str, &[&str])] = &[
    ("maxc-format", &["maxrun", "maxc ", "maxc-kernels", "maxc-codegen", "cudarc", "tokenizers", "minijinja", "clap", "tokio", "inkwell", "cranelift"]),
    ("maxc-kernels", &["maxrun", "maxc ", "maxc-codegen", "cudarc", "tokenizers", "minijinja", "clap", "tokio", "inkwell", "llvm-sys", "cranelift"]),
    ("maxc-codegen", &["maxrun", "maxc ", "cudarc", "tokenizers", "minijinja", "clap", "tokio"]),
    ("maxrun-runtime", &[
        "maxc ", "maxc-kernels", "maxc-codegen", "maxrun-engine", "maxrun-server", "maxrun ", "inkwell", "llvm-sys", "cranelift",
        "tokio", "hyper", "axum", "futures", "llguidance", "toktrie", "clap", "indicatif", "prometheus",
    ]),
    ("maxrun-engine", &["maxc ", "maxc-kernels", "maxc-codegen", "maxrun-server", "maxrun ", "inkwell", "llvm-sys", "cranelift", "tokio", "hyper", "axum", "clap", "indicatif", "prometheus"]),
    ("maxrun-server", &["maxc ", "maxc-kernels", "maxc-codegen", "maxrun ", "inkwell", "llvm-sys", "cranelift", "clap", "indicatif"]),
    ("maxrun", &["maxc ", "maxc-kernels", "maxc-codegen", "inkwell", "llvm-sys", "cranelift"]),
    ("maxc", &["maxrun-engine", "maxrun-server", "maxrun ", "axum", "hyper", "tokio", "futures", "llguidance", "prometheus", "cudarc"]),
];

#[test]
fn crates_depend_only_on_the_layers_below_them() {
    for &(krate, banned) in LAYERS {
        let out = std::process::Command::new(env!("CARGO"))
            .args(["tree", "-p", krate, "--edges", "normal,build", "--prefix", "none", "--offline"])
            .current_dir(workspace_root())
            .output()
            .expect("cargo tree runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let tree = String::from_utf8_lossy(&out.stdout);
        assert!(tree.lines().next().is_some_and(|l| l.starts_with(&format!("{krate} "))), "{tree}");
        for banned in banned {
            assert!(!tree.lines().any(|l| l.starts_with(banned)), "{krate} depends on {banned}:\n{tree}");
        }
    }
}

/// `text` without its `//` comments (line, doc and trailing ones); string
/// literals are kept as they are (a `//` inside one cuts the rest of its line,
/// which at worst hides a use, never invents one).
fn without_comments(text: &str) -> String {
    text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// The first segment of every path in a `use` tree after `crate::`: `a` of
/// `a::b`, and `a`, `d` of `{a::{b, c}, d}` (groups may span lines and nest).
fn use_tree_roots(rest: &str) -> Vec<String> {
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    let Some(group) = rest.strip_prefix('{') else { return vec![ident(rest)] };
    let (mut roots, mut depth, mut item_start) = (Vec::new(), 0usize, true);
    for (at, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => item_start = true,
            c if item_start && !c.is_whitespace() => {
                roots.push(ident(&group[at..]));
                item_start = false;
            }
            _ => {}
        }
    }
    roots
}

/// The top-level modules of `compiler/src` that each module names through
/// `crate::` (in code, not comments), keyed by module.
fn compiler_module_uses() -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
    let src = workspace_root().join("compiler/src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut uses: std::collections::BTreeMap<String, std::collections::BTreeSet<String>> = Default::default();
    for f in files {
        let rel = f.strip_prefix(&src).unwrap().to_string_lossy().into_owned();
        let module = rel.split('/').next().unwrap().trim_end_matches(".rs").to_string();
        if module == "lib" || module == "main" {
            continue;
        }
        let code = without_comments(&std::fs::read_to_string(&f).unwrap());
        let entry = uses.entry(module.clone()).or_default();
        for (at, _) in code.match_indices("crate::") {
            let roots = use_tree_roots(&code[at + "crate::".len()..]);
            entry.extend(roots.into_iter().filter(|n| !n.is_empty() && *n != module));
        }
    }
    uses
}

#[test]
fn use_trees_are_read_whole() {
    assert_eq!(use_tree_roots("graph::ir::Op;"), ["graph"]);
    assert_eq!(use_tree_roots("{a::{b, c},\n    d, e::f};"), ["a", "d", "e"]);
    assert_eq!(without_comments("use x; // crate::driver\n/// crate::quant\ncrate::graph"), "use x; \n\ncrate::graph");
}

/// The compiler's modules form layers: no two of them use each other, directly
/// or through others (a cycle makes neither understandable alone).
#[test]
fn compiler_modules_have_no_import_cycles() {
    let uses = compiler_module_uses();
    assert!(uses["graph"].contains("error") && uses["driver"].contains("schedule"), "the scan finds no uses: {uses:?}");
    // Depth-first search for a back edge, reporting the cycle.
    fn visit(m: &str, uses: &std::collections::BTreeMap<String, std::collections::BTreeSet<String>>, path: &mut Vec<String>, done: &mut std::collections::BTreeSet<String>) {
        if let Some(at) = path.iter().position(|p| p == m) {
            panic!("import cycle in compiler/src: {} -> {m}", path[at..].join(" -> "));
        }
        if !done.insert(m.to_string()) {
            return;
        }
        path.push(m.to_string());
        for next in uses.get(m).into_iter().flatten() {
            visit(next, uses, path, done);
        }
        path.pop();
    }
    let mut done = std::collections::BTreeSet::new();
    for m in uses.keys() {
        visit(m, &uses, &mut Vec::new(), &mut done);
    }
}

/// The engine names no device: it drives the executor interface
/// (`runtime-stub/src/executor/mod.rs`, in the tiny runtime), which the CPU, the CPU mesh and the
/// GPU implement, so that what is built on the engine (batching, preemption,
/// prefix reuse, speculation, adapters) is written once for every device.
#[test]
fn the_engine_names_no_device() {
    let dir = workspace_root().join("runtime-stub/engine/src");
    let mut files = Vec::new();
    rust_files(&dir, &mut files);
    assert!(files.len() >= 5, "the engine's files: {files:?}");
    let device_names = [
        "session::",
        "Session",
        "mesh_session",
        "gpu::",
        "Gpu",
        "runner::",
        "Runner",
        "KvCache",
        "kv_cache",
        "ThreadPool",
        "pool::",
        "executor::cpu",
        "executor::mesh",
        "CpuExecutor",
        "MeshExecutor",
        "cpu_encoder",
        "CpuEncoder",
        "cudarc",
        "LoadedCode",
        "PlanState",
    ];
    for file in files {
        let code = without_comments(&std::fs::read_to_string(&file).unwrap());
        for name in device_names {
            assert!(!code.contains(name), "{} names `{name}`: the engine drives devices through `maxrun_runtime::executor`'s traits only", file.display());
        }
    }
}
