//! CI ergonomics (docs/ci.md): the compile cache (`maxc compile --cache-dir`,
//! `MAXC_CACHE_DIR`) and `maxc compile --json`'s summary and error objects.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use maxc_tests::*;
use serde_json::Value;

/// Held shared by every test of this file and alone by the timed cache hit:
/// its bound is for a compile that does not share the CPUs with this file's
/// other compiles.
static CPUS: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    CPUS.read().unwrap_or_else(|e| e.into_inner())
}

/// `maxc ARGS` with `env`: (exit code, stdout, stderr, wall time).
fn maxc(args: &[&OsStr], env: &[(&str, &str)]) -> (i32, String, String, Duration) {
    let start = Instant::now();
    let (code, out, err) = run_bin_env("maxc", args, env);
    (code, out, err, start.elapsed())
}

/// `maxc compile SOURCE -o OUT EXTRA...` where `source` is a manifest or
/// `--model PATH`; panics unless it succeeds.
fn compile(source: &[&OsStr], out: &Path, extra: &[&str], env: &[(&str, &str)]) -> (String, String, Duration) {
    let mut args: Vec<&OsStr> = vec!["compile".as_ref()];
    args.extend(source);
    args.extend(["-o".as_ref(), out.as_os_str()]);
    args.extend(extra.iter().map(OsStr::new));
    let (code, stdout, stderr, wall) = maxc(&args, env);
    assert_eq!(code, 0, "maxc compile failed: {stderr}");
    (stdout, stderr, wall)
}

fn tiny() -> Vec<&'static OsStr> {
    static MODEL: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    vec!["--model".as_ref(), MODEL.get_or_init(|| fixture("tiny-llama")).as_os_str()]
}

/// The artifacts in a cache directory, checking that each has its checksum
/// beside it and that nothing else is there (no temporary file left behind).
fn entries(cache: &Path) -> Vec<PathBuf> {
    let mut all: Vec<PathBuf> = std::fs::read_dir(cache).unwrap().map(|e| e.unwrap().path()).collect();
    all.sort();
    let mefs: Vec<PathBuf> = all.iter().filter(|p| p.extension().is_some_and(|e| e == "mef")).cloned().collect();
    let mut expected: Vec<PathBuf> = mefs.iter().flat_map(|m| [m.clone(), PathBuf::from(format!("{}.xxh3", m.display()))]).collect();
    expected.sort();
    assert_eq!(all, expected, "an artifact and its checksum per entry, nothing else");
    mefs
}

fn build_id(artifact: &Path) -> String {
    maxrun_runtime::artifact::Artifact::open(artifact).unwrap().header.provenance.build_id
}

#[test]
fn a_second_compile_comes_from_the_cache_and_a_corrupt_entry_is_rebuilt() {
    // The acceptance: SmolLM2's manifest compiled twice, the second time from
    // the cache in under a second and byte-identical; a flipped byte in the
    // entry is found and the entry rebuilt.
    let shared_cpus = shared();
    let dir = temp_dir("ci-cache");
    let manifest = dir.join("smollm2.toml");
    let model = smollm2_gguf().display().to_string();
    std::fs::write(&manifest, format!("[model]\npath = {model:?}\n\n[compile]\nquantization_encoding = \"q4_1\"\nmax_length = 512\n")).unwrap();
    let cache = dir.join("cache");
    let cache_flag = ["--cache-dir", cache.to_str().unwrap()];
    let source = [manifest.as_os_str()];

    let (_, err, first_wall) = compile(&source, &dir.join("first.mef"), &cache_flag, &[]);
    assert!(err.contains("cached as"), "{err}");
    let first = std::fs::read(dir.join("first.mef")).unwrap();

    drop(shared_cpus);
    let alone = CPUS.write().unwrap_or_else(|e| e.into_inner());
    let (_, err, wall) = compile(&source, &dir.join("second.mef"), &cache_flag, &[]);
    drop(alone);
    let _shared_cpus = shared();
    eprintln!("SmolLM2 q4_1 ({} MiB): first compile {first_wall:.2?}, second (cache hit) {wall:.2?}", first.len() >> 20);
    assert!(err.contains("from the cache"), "{err}");
    assert!(wall < Duration::from_secs(1), "a cache hit took {wall:?}");
    assert!(std::fs::read(dir.join("second.mef")).unwrap() == first, "the cached artifact differs from the built one");

    // The entry is named by the build id the artifact records (computed
    // before compiling, by the function the provenance uses).
    let [entry] = &entries(&cache)[..] else { panic!("one entry expected") };
    let id = build_id(&dir.join("second.mef"));
    assert!(entry.file_name().unwrap().to_str().unwrap().starts_with(&format!("{id}-")), "{} is not named by build id {id}", entry.display());

    // One flipped byte in the middle of the entry (the outputs may be hard
    // links to it: `first` holds the built bytes).
    let mut bytes = std::fs::read(entry).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(entry, &bytes).unwrap();
    let (_, err, _) = compile(&source, &dir.join("third.mef"), &cache_flag, &[]);
    assert!(err.contains("warning: cache entry") && err.contains("is corrupt"), "{err}");
    assert_eq!(err.matches("warning").count(), 1, "one warning line: {err}");
    assert!(!err.contains("from the cache"), "{err}");
    assert!(std::fs::read(dir.join("third.mef")).unwrap() == first, "the rebuilt artifact differs from the first");
    assert!(std::fs::read(entry).unwrap() == first, "the entry was not rebuilt");

    let (_, err, _) = compile(&source, &dir.join("fourth.mef"), &cache_flag, &[]);
    assert!(err.contains("from the cache") && !err.contains("warning"), "{err}");
    assert!(std::fs::read(dir.join("fourth.mef")).unwrap() == first);
}

#[test]
fn the_cache_dir_comes_from_the_environment_and_a_changed_flag_misses() {
    let _shared_cpus = shared();
    let dir = temp_dir("ci-env");
    let cache = dir.join("cache");
    let env = [("MAXC_CACHE_DIR", cache.to_str().unwrap())];
    let (_, err, _) = compile(&tiny(), &dir.join("a.mef"), &[], &env);
    assert!(err.contains("cached as") && !err.contains("from the cache"), "{err}");
    // --jobs cannot change the artifact: the same key.
    let (_, err, _) = compile(&tiny(), &dir.join("b.mef"), &["--jobs", "1"], &env);
    assert!(err.contains("from the cache"), "{err}");
    assert_eq!(entries(&cache).len(), 1);
    // A flag that changes the artifact changes the key.
    let (_, err, _) = compile(&tiny(), &dir.join("c.mef"), &["--kv-cache-encoding", "float16"], &env);
    assert!(!err.contains("from the cache") && err.contains("cached as"), "{err}");
    assert_eq!(entries(&cache).len(), 2);
    assert_ne!(build_id(&dir.join("a.mef")), build_id(&dir.join("c.mef")));
    // --no-cache neither reads nor writes.
    let (_, err, _) = compile(&tiny(), &dir.join("d.mef"), &["--no-cache", "--embedding-encoding", "q8_0"], &env);
    assert!(!err.contains("cache"), "{err}");
    assert_eq!(entries(&cache).len(), 2);
    assert!(std::fs::read(dir.join("a.mef")).unwrap() == std::fs::read(dir.join("b.mef")).unwrap());
}

#[test]
fn two_compiles_of_one_key_at_once_leave_one_valid_entry() {
    let _shared_cpus = shared();
    let dir = temp_dir("ci-race");
    let cache = dir.join("cache");
    let spawn = |out: &str| {
        let mut cmd = std::process::Command::new(bin("maxc"));
        cmd.args(["compile".as_ref(), "-q".as_ref(), "--cache-dir".as_ref(), cache.as_os_str()]).args(tiny()).arg("-o").arg(dir.join(out));
        cmd.spawn().expect("maxc starts")
    };
    let (mut a, mut b) = (spawn("a.mef"), spawn("b.mef"));
    assert!(a.wait().unwrap().success() && b.wait().unwrap().success());
    let built = std::fs::read(dir.join("a.mef")).unwrap();
    assert!(std::fs::read(dir.join("b.mef")).unwrap() == built);
    let [entry] = &entries(&cache)[..] else { panic!("one entry expected") };
    assert!(std::fs::read(entry).unwrap() == built);
    let (_, err, _) = compile(&tiny(), &dir.join("c.mef"), &["--cache-dir", cache.to_str().unwrap()], &[]);
    assert!(err.contains("from the cache") && !err.contains("warning"), "{err}");
}

#[test]
fn json_prints_one_summary_that_matches_the_artifact() {
    let _shared_cpus = shared();
    let dir = temp_dir("ci-json");
    let out = dir.join("model.mef");
    let cache = dir.join("cache");
    let (stdout, _, _) = compile(&tiny(), &out, &["--json", "--cache-dir", cache.to_str().unwrap()], &[]);
    let s: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not one JSON object ({e}): {stdout}"));
    let inspected = inspect_json(&out);
    assert_eq!(s["artifact"], out.display().to_string());
    assert_eq!(s["bytes"].as_u64(), Some(std::fs::metadata(&out).unwrap().len()));
    assert_eq!(s["build_id"], inspected["provenance"]["build_id"]);
    assert_eq!(s["target_spec"], "cpu");
    let targets = s["targets"].as_array().unwrap();
    assert!(!targets.is_empty() && targets.iter().all(|t| t["kind"] == "cpu"), "{targets:?}");
    assert_eq!(targets[0]["cpu"], inspected["target"]["cpu"]);
    assert_eq!(targets[0]["required_features"], inspected["target"]["required_features"]);
    assert_eq!(s["encodings"]["weights"], inspected["weights"]["by_encoding"]);
    assert_eq!(s["encodings"]["kv_cache"], "float32");
    assert_eq!(s["memory"], inspected["memory"]);
    assert!(s["memory"]["total_bytes_at_max_length"].as_u64().unwrap() > s["memory"]["weights_bytes"].as_u64().unwrap());
    assert_eq!(s["kernels"].as_u64(), inspected["kernels"]["count"].as_u64());
    let phases: Vec<&str> = s["phases"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
    for name in ["cache key + lookup", "import + graph passes", "codegen + link", "write artifact", "cache store"] {
        assert!(phases.contains(&name), "{phases:?}");
    }
    let total: f64 = s["phases"].as_array().unwrap().iter().map(|p| p["wall_s"].as_f64().unwrap()).sum();
    assert!(total > 0.0 && total <= s["wall_s"].as_f64().unwrap(), "phases {total} s, wall {}", s["wall_s"]);
    assert_eq!(s["cache"]["status"], "miss");
    assert!(s["cache"]["key"].as_str().unwrap().starts_with(s["build_id"].as_str().unwrap()));

    let again = dir.join("again.mef");
    let (stdout, stderr, _) = compile(&tiny(), &again, &["--json", "--cache-dir", cache.to_str().unwrap()], &[]);
    let hit: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(hit["cache"]["status"], "hit");
    assert!(["hard link", "copy"].contains(&hit["cache"]["transfer"].as_str().unwrap()));
    for field in ["bytes", "build_id", "targets", "encodings", "memory", "kernels"] {
        assert_eq!(hit[field], s[field], "{field}");
    }
    assert!(stderr.is_empty(), "--json prints nothing but warnings on stderr: {stderr}");
    // No cache: `cache` is null.
    let (stdout, _, _) = compile(&tiny(), &dir.join("plain.mef"), &["--json"], &[]);
    let plain: Value = serde_json::from_str(&stdout).unwrap();
    assert!(plain["cache"].is_null() && plain["build_id"] == s["build_id"]);
}

#[test]
fn json_failures_print_the_error_object_and_exit_with_the_documented_code() {
    let _shared_cpus = shared();
    let dir = temp_dir("ci-json-error");
    let manifest = dir.join("bad.toml");
    let model = fixture("tiny-llama").display().to_string();
    std::fs::write(&manifest, format!("[model]\npath = {model:?}\n\n[compile]\nquantization_encoding = \"q3_x\"\n")).unwrap();
    let out = dir.join("never.mef");
    let error = |args: &[&OsStr], code: i32| -> Value {
        let (c, stdout, stderr, _) = maxc(args, &[]);
        assert_eq!(c, code, "{stderr}");
        assert!(stderr.contains("error: "), "stderr keeps the message: {stderr}");
        let v: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not one JSON object ({e}): {stdout}"));
        assert_eq!(v["error"]["exit_code"].as_i64(), Some(code as i64));
        v["error"].clone()
    };
    let e = error(&["compile".as_ref(), manifest.as_os_str(), "-o".as_ref(), out.as_os_str(), "--json".as_ref()], 1);
    assert_eq!(e["kind"], "invalid");
    assert_eq!(e["file"], manifest.display().to_string());
    assert_eq!(e["field"], "compile.quantization_encoding");
    assert!(e["message"].as_str().unwrap().contains("q3_x"), "{e}");
    // The same with the cache: the key is never computed from a bad manifest.
    let cache = dir.join("cache");
    let e = error(&["compile".as_ref(), manifest.as_os_str(), "-o".as_ref(), out.as_os_str(), "--json".as_ref(), "--cache-dir".as_ref(), cache.as_os_str()], 1);
    assert_eq!(e["field"], "compile.quantization_encoding");
    assert!(!out.exists() && !cache.exists());
    // A flag value: the error names its manifest field (flag and key are one setting).
    let mut args = vec!["compile".as_ref()];
    args.extend(tiny());
    args.extend(["-o".as_ref(), out.as_os_str(), "--json".as_ref(), "--target".as_ref(), "cpu:z80".as_ref()]);
    let e = error(&args, 1);
    assert_eq!((e["file"].as_str(), e["field"].as_str()), (Some("<--model>"), Some("--target")), "{e}");
    // Usage errors, ours and clap's: exit 2.
    let e = error(&["compile".as_ref(), manifest.as_os_str(), "--json".as_ref()], 2);
    assert_eq!(e["kind"], "usage");
    let e = error(&["compile".as_ref(), manifest.as_os_str(), "--json".as_ref(), "--no-such-flag".as_ref()], 2);
    assert!(e["kind"] == "usage" && e["message"].as_str().unwrap().contains("--no-such-flag"), "{e}");
    let e = error(&["compile".as_ref(), manifest.as_os_str(), "-o".as_ref(), out.as_os_str(), "--json".as_ref(), "--log-format".as_ref(), "json".as_ref()], 2);
    assert_eq!(e["kind"], "usage");
}
