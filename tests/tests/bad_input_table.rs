//! The table-driven bad-input suite (#36): `tests/bad_input/cases.txt`.
//!
//! Every input maxc and maxrun read is either honoured exactly or refused with a
//! message naming the file, the field, what was found and what is supported, and
//! nothing the user owns is touched. Each line of the table is one refusal:
//!
//! ```text
//! name | tool | input edits | arguments | exit code | message fragments
//! ```
//!
//! - `tool`: `maxc` or `maxrun`.
//! - `input edits`: `-` for none, else edits joined by `&&`, applied in order to
//!   fresh copies of the inputs (`apply_edit` implements every kind): `config`,
//!   `generation`, `tokenizer_config`, `tokenizer` (`KEY=JSON`, `/json/pointer=JSON`,
//!   `-KEY` removes), `safetensors` (the same on model.safetensors' header; a bare
//!   key is a tensor name), `safetensors-dup NAME`, `safetensors-truncate N`,
//!   `file NAME=TEXT`, `rm NAME`, `mkdir NAME`, `copy SRC=DST`, `poke NAME@OFFSET=HEX`,
//!   `gguf-set KEY=TYPE:VALUE`, `gguf-u32 KEY=N`, `gguf-remove KEY`, `gguf-type KEY=N`
//!   (the value's type id), `gguf-tensor NAME FIELD=VALUE` (type, offset, name, dims;
//!   or `remove`, `duplicate`), `gguf-poke OFFSET=HEX`, `gguf-truncate N`,
//!   `artifact-flip OFFSET`, `artifact-poke OFFSET=HEX`, `artifact-truncate N`,
//!   `manifest TEXT`. TEXT takes `\n`, `\t`, `\xHH`, `\\` escapes; OFFSET and N are
//!   a number, `end-N`, or for artifacts `SECTION+N` (`header`, `Code`, `Weights(0)`,
//!   `Tokenizer`, `ChatTemplate`).
//! - `arguments`: split like a shell line (double quotes group), with placeholders
//!   `{model}` (a copy of the tiny-llama fixture folder, edited), `{gguf}` (an
//!   edited copy of SmolLM2's GGUF), `{artifact}` (an edited copy of a tiny-llama
//!   artifact compiled once per run), `{manifest}` (the `manifest` edit's file),
//!   `{out}` (a fresh path in an empty folder), `{dir}` (the case's folder),
//!   `{fixture:NAME}` (a fixture folder, unedited), `{repeat:N:TEXT}`.
//! - `exit code`: the expected status; `message fragments`: `;`-separated, each
//!   must appear in stderr (`!TEXT`: must not; `stdout:TEXT`: in stdout, where
//!   `maxc check` lists its problems). The case's folder reads `{dir}` in both, so
//!   a fragment never matches the temporary path.
//!
//! Every case also asserts: no "panicked" in stderr, never exit 101, no death by
//! a signal, an empty `{out}` folder after a failure, and every input file (the
//! model folder, GGUF, manifest, artifact, anything else in the case's folder)
//! byte-identical after the command. All cases run and the test fails once at
//! the end, listing every failing case with its command, exit code and stderr.
//!
//! `BAD_INPUT_ONLY=name,name` runs only those cases; `BAD_INPUT_SHOW=1` prints
//! every case's exit code and stderr (to write new lines); `MAXC_KEEP_TEST_FILES=1`
//! keeps the case folders (as it keeps every test's files).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use maxc_tests::*;
use serde_json::Value;

/// The table, relative to the workspace root.
const TABLE: &str = "tests/bad_input/cases.txt";
/// A case that runs longer than this is killed and reported.
const TIMEOUT: Duration = Duration::from_secs(60);
/// The tiny-llama fixture files copied for `{model}` (not the goldens).
const MODEL_FILES: [&str; 6] = ["config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json", "model.safetensors", "chat_template.jinja"];

/// One line of the table.
#[derive(Debug, Clone)]
struct Case {
    line: usize,
    name: String,
    tool: String,
    edits: Vec<String>,
    args: String,
    exit: i32,
    fragments: Vec<String>,
    /// Under a `# DEFECT` comment block: an open product defect. The line states the
    /// correct refusal; until the product gives it, the case must still keep
    /// every invariant (no panic, no signal, no file touched), and once it
    /// passes in full the test fails until the marker is removed.
    open_defect: bool,
}

/// Splits `s` on `sep` where it is not preceded by a backslash; `\|` becomes `|`.
fn split_columns(s: &str) -> Vec<String> {
    let mut cols = vec![String::new()];
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\\' && chars.peek() == Some(&'|') {
            cols.last_mut().unwrap().push(chars.next().unwrap());
        } else if c == '|' {
            cols.push(String::new());
        } else {
            cols.last_mut().unwrap().push(c);
        }
    }
    cols.into_iter().map(|c| c.trim().to_string()).collect()
}

fn parse_table(text: &str) -> Result<Vec<Case>, String> {
    let mut cases: Vec<Case> = Vec::new();
    // A `# DEFECT` comment block marks the case lines that follow it, up to a
    // blank line or the next comment block.
    let (mut defect, mut after_case) = (false, false);
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let t = raw.trim();
        if t.starts_with("# DEFECT") {
            defect = true;
        } else if t.is_empty() || (t.starts_with('#') && after_case) {
            defect = false;
        }
        after_case = !t.is_empty() && !t.starts_with('#');
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        let open_defect = defect;
        let cols = split_columns(t);
        if cols.len() != 6 {
            return Err(format!("{TABLE}:{line}: {} columns, expected 6 (name | tool | edits | args | exit | fragments): {t}", cols.len()));
        }
        let name = cols[0].clone();
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
            return Err(format!("{TABLE}:{line}: a case name is [A-Za-z0-9_-]+: `{name}`"));
        }
        if cases.iter().any(|c| c.name == name) {
            return Err(format!("{TABLE}:{line}: case `{name}` appears twice"));
        }
        let tool = cols[1].clone();
        if tool != "maxc" && tool != "maxrun" {
            return Err(format!("{TABLE}:{line}: tool `{tool}`: expected maxc or maxrun"));
        }
        let edits = if cols[2] == "-" || cols[2].is_empty() { Vec::new() } else { cols[2].split("&&").map(|e| e.trim().to_string()).collect() };
        let exit = cols[4].parse::<i32>().map_err(|e| format!("{TABLE}:{line}: exit code `{}`: {e}", cols[4]))?;
        let fragments: Vec<String> = cols[5].split(';').map(|f| f.trim().to_string()).filter(|f| !f.is_empty()).collect();
        if exit != 0 && fragments.is_empty() {
            return Err(format!("{TABLE}:{line}: a refusal needs at least one message fragment"));
        }
        cases.push(Case { line, name, tool, edits, args: cols[3].clone(), exit, fragments, open_defect });
    }
    Ok(cases)
}

/// `\n`, `\t`, `\r`, `\\`, `\xHH` in TEXT.
fn unescape(s: &str) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 1 < b.len() {
            match b[i + 1] {
                b'n' => out.push(b'\n'),
                b't' => out.push(b'\t'),
                b'r' => out.push(b'\r'),
                b'\\' => out.push(b'\\'),
                b'x' => {
                    let h = s.get(i + 2..i + 4).ok_or("\\x needs two hex digits")?;
                    out.push(u8::from_str_radix(h, 16).map_err(|e| format!("\\x{h}: {e}"))?);
                    i += 2;
                }
                other => return Err(format!("unknown escape \\{}", other as char)),
            }
            i += 2;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Ok(out)
}

fn hex(s: &str) -> Result<Vec<u8>, String> {
    let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    if !s.len().is_multiple_of(2) {
        return Err(format!("hex `{s}` has an odd length"));
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|e| format!("hex `{s}`: {e}"))).collect()
}

/// Shell-like word splitting: whitespace separates, `"..."` and `'...'` group
/// (an empty pair is an empty argument), `\` escapes the next character.
fn split_args(s: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut cur: Option<String> = None;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => {
                if let Some(w) = cur.take() {
                    words.push(w);
                }
            }
            '"' | '\'' => {
                let w = cur.get_or_insert_with(String::new);
                loop {
                    match chars.next() {
                        None => return Err(format!("unclosed {c} in `{s}`")),
                        Some(q) if q == c => break,
                        Some('\\') if c == '"' => w.push(chars.next().ok_or("a trailing backslash")?),
                        Some(o) => w.push(o),
                    }
                }
            }
            '\\' => cur.get_or_insert_with(String::new).push(chars.next().ok_or("a trailing backslash")?),
            c => cur.get_or_insert_with(String::new).push(c),
        }
    }
    words.extend(cur);
    Ok(words)
}

/// The paths of one case's inputs.
struct Paths {
    dir: PathBuf,
    model: PathBuf,
    gguf: PathBuf,
    artifact: PathBuf,
    manifest: PathBuf,
    out_dir: PathBuf,
    out: PathBuf,
}

impl Paths {
    fn new(dir: PathBuf) -> Self {
        Paths {
            model: dir.join("model"),
            gguf: dir.join("model.gguf"),
            artifact: dir.join("model.mef"),
            manifest: dir.join("model.toml"),
            out_dir: dir.join("out"),
            out: dir.join("out/out.mef"),
            dir,
        }
    }

    /// Replaces the placeholders of `s`; unknown `{...}` stay as they are.
    fn expand(&self, s: &str) -> Result<String, String> {
        let mut out = String::new();
        let mut rest = s;
        while let Some(open) = rest.find('{') {
            out.push_str(&rest[..open]);
            let after = &rest[open..];
            let Some(close) = after.find('}') else {
                out.push_str(after);
                rest = "";
                break;
            };
            let inner = &after[1..close];
            let p = |p: &Path| p.to_string_lossy().into_owned();
            let replaced = match inner {
                "model" => Some(p(&self.model)),
                "gguf" => Some(p(&self.gguf)),
                "artifact" => Some(p(&self.artifact)),
                "manifest" => Some(p(&self.manifest)),
                "out" => Some(p(&self.out)),
                "dir" => Some(p(&self.dir)),
                _ if inner.starts_with("fixture:") => Some(p(&fixture(&inner["fixture:".len()..]))),
                _ if inner.starts_with("repeat:") => {
                    let (n, text) = inner["repeat:".len()..].split_once(':').ok_or(format!("{{{inner}}}: expected {{repeat:N:TEXT}}"))?;
                    Some(text.repeat(n.parse().map_err(|e| format!("{{{inner}}}: {e}"))?))
                }
                _ => None,
            };
            match replaced {
                Some(r) => out.push_str(&r),
                None => out.push_str(&after[..=close]),
            }
            rest = &after[close + 1..];
        }
        out.push_str(rest);
        Ok(out)
    }
}

/// The inputs shared by all cases: SmolLM2's GGUF and the compiled tiny-llama artifact.
struct Shared {
    gguf: Option<Vec<u8>>,
    artifact: Option<(Vec<u8>, maxrun_runtime::format::Header)>,
}

/// `N`, `0xN`, `end-N` (from the end of a `len`-byte file), or `SECTION+N` for artifacts.
fn offset(spec: &str, len: usize, header: Option<&maxrun_runtime::format::Header>) -> Result<usize, String> {
    let num = |s: &str| -> Result<usize, String> {
        let s = s.trim();
        if let Some(h) = s.strip_prefix("0x") {
            usize::from_str_radix(h, 16).map_err(|e| format!("`{s}`: {e}"))
        } else {
            s.parse().map_err(|e| format!("`{s}`: {e}"))
        }
    };
    if let Some(n) = spec.strip_prefix("end-") {
        return len.checked_sub(num(n)?).ok_or(format!("`{spec}` is before the start"));
    }
    if let Some((section, n)) = spec.split_once('+') {
        let base = if section == "header" {
            maxrun_runtime::format::PRELUDE_LEN
        } else {
            let h = header.ok_or(format!("`{spec}`: sections are for artifacts"))?;
            let s = h.sections.iter().find(|s| format!("{:?}", s.kind) == section).ok_or(format!("`{spec}`: no section {section}"))?;
            s.offset as usize
        };
        return Ok(base + num(n)?);
    }
    num(spec)
}

fn poke(bytes: &mut [u8], at: usize, data: &[u8]) -> Result<(), String> {
    let end = at + data.len();
    if end > bytes.len() {
        return Err(format!("poke at {at}..{end} is past the end ({} bytes)", bytes.len()));
    }
    bytes[at..end].copy_from_slice(data);
    Ok(())
}

/// Sets (`value` Some) or removes the value at `path`: a JSON pointer (`/a/0/b`)
/// or a bare top-level key (which may hold dots).
fn json_edit(root: &mut Value, path: &str, value: Option<Value>) -> Result<(), String> {
    let tokens: Vec<String> = match path.strip_prefix('/') {
        Some(p) => p.split('/').map(|t| t.replace("~1", "/").replace("~0", "~")).collect(),
        None => vec![path.to_string()],
    };
    let (last, parents) = tokens.split_last().ok_or("an empty path")?;
    let mut cur = root;
    for t in parents {
        cur = match cur {
            Value::Object(m) => m.get_mut(t).ok_or(format!("{path}: no key `{t}`"))?,
            Value::Array(a) => {
                let i: usize = t.parse().map_err(|e| format!("{path}: `{t}`: {e}"))?;
                a.get_mut(i).ok_or(format!("{path}: no index {i}"))?
            }
            _ => return Err(format!("{path}: `{t}` is inside a scalar")),
        };
    }
    match (cur, value) {
        (Value::Object(m), Some(v)) => {
            m.insert(last.clone(), v);
        }
        (Value::Object(m), None) => {
            m.remove(last).ok_or(format!("{path}: no key `{last}` to remove"))?;
        }
        (Value::Array(a), v) => {
            let i: usize = last.parse().map_err(|e| format!("{path}: `{last}`: {e}"))?;
            match v {
                Some(v) if i == a.len() => a.push(v),
                Some(v) => *a.get_mut(i).ok_or(format!("{path}: no index {i}"))? = v,
                None if i < a.len() => {
                    a.remove(i);
                }
                None => return Err(format!("{path}: no index {i}")),
            }
        }
        _ => return Err(format!("{path}: the parent is a scalar")),
    }
    Ok(())
}

/// `PATH=JSON` or `-PATH`.
fn json_spec(spec: &str) -> Result<(String, Option<Value>), String> {
    if let Some(p) = spec.strip_prefix('-') {
        return Ok((p.to_string(), None));
    }
    // The path ends at the first `=` (JSON pointers and keys here hold none).
    let (p, v) = spec.split_once('=').ok_or(format!("`{spec}`: expected PATH=JSON or -PATH"))?;
    let v: Value = serde_json::from_str(v).map_err(|e| format!("`{v}` is not JSON: {e}"))?;
    Ok((p.to_string(), Some(v)))
}

/// model.safetensors as (header JSON text, data after the header).
fn safetensors_split(bytes: &[u8]) -> Result<(String, Vec<u8>), String> {
    let n = u64::from_le_bytes(bytes.get(..8).ok_or("short safetensors")?.try_into().unwrap()) as usize;
    let h = std::str::from_utf8(bytes.get(8..8 + n).ok_or("short safetensors header")?).map_err(|e| e.to_string())?;
    Ok((h.to_string(), bytes[8 + n..].to_vec()))
}

fn safetensors_join(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header.as_bytes());
    out.extend(data);
    out
}

/// A GGUF file taken apart: metadata values kept as raw bytes, tensor infos, the
/// data section. Written back with the original alignment (32), whatever the
/// metadata then says.
struct Gguf {
    version: u32,
    kvs: Vec<(String, u32, Vec<u8>)>,
    tensors: Vec<(String, Vec<u64>, u32, u64)>,
    data: Vec<u8>,
}

const GGUF_ALIGN: usize = 32;

impl Gguf {
    fn parse(b: &[u8]) -> Result<Self, String> {
        let u32_at = |at: usize| b.get(at..at + 4).map(|s| u32::from_le_bytes(s.try_into().unwrap())).ok_or("truncated GGUF");
        let u64_at = |at: usize| b.get(at..at + 8).map(|s| u64::from_le_bytes(s.try_into().unwrap()) as usize).ok_or("truncated GGUF");
        fn skip(b: &[u8], at: &mut usize, ty: u32) -> Result<(), String> {
            let u64_at = |at: usize| b.get(at..at + 8).map(|s| u64::from_le_bytes(s.try_into().unwrap()) as usize).ok_or("truncated GGUF");
            match ty {
                0 | 1 | 7 => *at += 1,
                2 | 3 => *at += 2,
                4..=6 => *at += 4,
                10..=12 => *at += 8,
                8 => *at += 8 + u64_at(*at)?,
                9 => {
                    let item = u32::from_le_bytes(b.get(*at..*at + 4).ok_or("truncated GGUF")?.try_into().unwrap());
                    let n = u64_at(*at + 4)?;
                    *at += 12;
                    for _ in 0..n {
                        skip(b, at, item)?;
                    }
                }
                other => return Err(format!("GGUF metadata type {other}")),
            }
            Ok(())
        }
        if b.get(..4) != Some(b"GGUF") {
            return Err("not a GGUF".into());
        }
        let version = u32_at(4)?;
        let (n_tensors, n_kv) = (u64_at(8)?, u64_at(16)?);
        let mut at = 24;
        let mut kvs = Vec::new();
        for _ in 0..n_kv {
            let kl = u64_at(at)?;
            let key = String::from_utf8_lossy(&b[at + 8..at + 8 + kl]).into_owned();
            at += 8 + kl;
            let ty = u32_at(at)?;
            at += 4;
            let start = at;
            skip(b, &mut at, ty)?;
            kvs.push((key, ty, b[start..at].to_vec()));
        }
        let mut tensors = Vec::new();
        for _ in 0..n_tensors {
            let nl = u64_at(at)?;
            let name = String::from_utf8_lossy(&b[at + 8..at + 8 + nl]).into_owned();
            at += 8 + nl;
            let nd = u32_at(at)? as usize;
            let dims = (0..nd).map(|i| u64_at(at + 4 + 8 * i).map(|d| d as u64)).collect::<Result<Vec<_>, _>>()?;
            at += 4 + 8 * nd;
            tensors.push((name, dims, u32_at(at)?, u64_at(at + 4)? as u64));
            at += 12;
        }
        let data_start = at.div_ceil(GGUF_ALIGN) * GGUF_ALIGN;
        Ok(Gguf { version, kvs, tensors, data: b[data_start.min(b.len())..].to_vec() })
    }

    fn write(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.kvs.len() as u64).to_le_bytes());
        for (k, ty, raw) in &self.kvs {
            out.extend((k.len() as u64).to_le_bytes());
            out.extend(k.as_bytes());
            out.extend(ty.to_le_bytes());
            out.extend(raw);
        }
        for (name, dims, ty, off) in &self.tensors {
            out.extend((name.len() as u64).to_le_bytes());
            out.extend(name.as_bytes());
            out.extend((dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
            out.extend(ty.to_le_bytes());
            out.extend(off.to_le_bytes());
        }
        out.resize(out.len().div_ceil(GGUF_ALIGN) * GGUF_ALIGN, 0);
        out.extend(&self.data);
        out
    }

    /// `TYPE:VALUE` as (GGUF type, raw bytes): u8 i8 u16 i16 u32 i32 f32 bool str
    /// u64 i64 f64, and arrays `u32[]:1,2` / `str[]:a,b` (an empty list after the colon).
    fn value(spec: &str) -> Result<(u32, Vec<u8>), String> {
        let (ty, v) = spec.split_once(':').ok_or(format!("`{spec}`: expected TYPE:VALUE"))?;
        fn scalar(ty: &str, v: &str) -> Result<(u32, Vec<u8>), String> {
            let e = |e: &dyn std::fmt::Display| format!("`{v}` as {ty}: {e}");
            Ok(match ty {
                "u8" => (0, v.parse::<u8>().map_err(|x| e(&x))?.to_le_bytes().to_vec()),
                "i8" => (1, v.parse::<i8>().map_err(|x| e(&x))?.to_le_bytes().to_vec()),
                "u16" => (2, v.parse::<u16>().map_err(|x| e(&x))?.to_le_bytes().to_vec()),
                "i16" => (3, v.parse::<i16>().map_err(|x| e(&x))?.to_le_bytes().to_vec()),
                "u32" => (4, v.parse::<u32>().map_err(|x| e(&x))?.to_le_bytes().to_vec()),
                "i32" => (5, v.parse::<i32>().map_err(|x| e(&x))?.to_le_bytes().to_vec()),
                "f32" => (6, v.parse::<f32>().map_err(|x| e(&x))?.to_le_bytes().to_vec()),
                "bool" => (7, vec![v.parse::<bool>().map_err(|x| e(&x))? as u8]),
                "str" => {
                    let mut b = (v.len() as u64).to_le_bytes().to_vec();
                    b.extend(v.as_bytes());
                    (8, b)
                }
                "u64" => (10, v.parse::<u64>().map_err(|x| e(&x))?.to_le_bytes().to_vec()),
                "i64" => (11, v.parse::<i64>().map_err(|x| e(&x))?.to_le_bytes().to_vec()),
                "f64" => (12, v.parse::<f64>().map_err(|x| e(&x))?.to_le_bytes().to_vec()),
                other => return Err(format!("GGUF type `{other}`")),
            })
        }
        match ty.strip_suffix("[]") {
            Some(item) => {
                let items: Vec<&str> = if v.is_empty() { Vec::new() } else { v.split(',').collect() };
                let item_ty = scalar(item, if item == "str" { "" } else { "0" })?.0;
                let mut b = item_ty.to_le_bytes().to_vec();
                b.extend((items.len() as u64).to_le_bytes());
                for i in items {
                    b.extend(scalar(item, i)?.1);
                }
                Ok((9, b))
            }
            None => scalar(ty, v),
        }
    }
}

/// Applies one edit of the table to the case's inputs (files in `p.model`, the
/// in-memory GGUF and artifact bytes, the manifest).
fn apply_edit(edit: &str, p: &Paths, gguf: &mut Option<Vec<u8>>, artifact: &mut Option<Vec<u8>>, shared: &Shared) -> Result<(), String> {
    let (kind, arg) = edit.split_once(' ').map(|(k, a)| (k, a.trim())).unwrap_or((edit, ""));
    let model_file = |name: &str| p.model.join(name);
    let read_json = |name: &str| -> Result<Value, String> {
        match std::fs::read(model_file(name)) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| format!("{name} is not JSON before the edit: {e}")),
            Err(_) => Ok(Value::Object(Default::default())),
        }
    };
    let write = |name: &str, bytes: &[u8]| -> Result<(), String> {
        let f = model_file(name);
        if f.is_dir() {
            std::fs::remove_dir_all(&f).map_err(|e| e.to_string())?;
        }
        std::fs::write(&f, bytes).map_err(|e| format!("{}: {e}", f.display()))
    };
    let need = |b: &mut Option<Vec<u8>>, what: &str| -> Result<(), String> { b.as_ref().map(|_| ()).ok_or(format!("`{edit}`: no {what} in this case")) };
    match kind {
        "config" | "generation" | "tokenizer_config" | "tokenizer" => {
            let name = match kind {
                "config" => "config.json",
                "generation" => "generation_config.json",
                "tokenizer_config" => "tokenizer_config.json",
                _ => "tokenizer.json",
            };
            let mut v = read_json(name)?;
            let (path, value) = json_spec(arg)?;
            json_edit(&mut v, &path, value)?;
            write(name, serde_json::to_string_pretty(&v).unwrap().as_bytes())
        }
        "safetensors" | "safetensors-dup" => {
            let bytes = std::fs::read(model_file("model.safetensors")).map_err(|e| e.to_string())?;
            let (h, data) = safetensors_split(&bytes)?;
            let mut v: Value = serde_json::from_str(&h).map_err(|e| e.to_string())?;
            let header = if kind == "safetensors" {
                let (path, value) = json_spec(arg)?;
                json_edit(&mut v, &path, value)?;
                v.to_string()
            } else {
                // A second entry of the same name: only possible in the text.
                let entry = v.get(arg).ok_or(format!("no tensor `{arg}`"))?.to_string();
                let s = v.to_string();
                format!("{},{}:{entry}}}", &s[..s.len() - 1], Value::String(arg.into()))
            };
            write("model.safetensors", &safetensors_join(&header, &data))
        }
        "safetensors-truncate" => {
            let mut bytes = std::fs::read(model_file("model.safetensors")).map_err(|e| e.to_string())?;
            bytes.truncate(offset(arg, bytes.len(), None)?);
            write("model.safetensors", &bytes)
        }
        "file" => {
            let (name, text) = arg.split_once('=').ok_or(format!("`{edit}`: expected file NAME=TEXT"))?;
            let _ = std::fs::remove_file(model_file(name));
            write(name, &unescape(text)?)
        }
        "rm" => {
            let f = model_file(arg);
            if f.is_dir() { std::fs::remove_dir_all(&f) } else { std::fs::remove_file(&f) }.map_err(|e| format!("rm {arg}: {e}"))
        }
        "mkdir" => {
            let f = model_file(arg);
            let _ = std::fs::remove_file(&f);
            std::fs::create_dir_all(&f).map_err(|e| e.to_string())
        }
        "copy" => {
            let (from, to) = arg.split_once('=').ok_or(format!("`{edit}`: expected copy SRC=DST"))?;
            std::fs::copy(model_file(from), model_file(to)).map(|_| ()).map_err(|e| format!("copy {from}: {e}"))
        }
        "poke" => {
            let (target, data) = arg.split_once('=').ok_or(format!("`{edit}`: expected poke NAME@OFFSET=HEX"))?;
            let (name, at) = target.split_once('@').ok_or(format!("`{edit}`: expected poke NAME@OFFSET=HEX"))?;
            let mut bytes = std::fs::read(model_file(name)).map_err(|e| e.to_string())?;
            let at = offset(at, bytes.len(), None)?;
            poke(&mut bytes, at, &hex(data)?)?;
            write(name, &bytes)
        }
        "gguf-set" | "gguf-u32" | "gguf-remove" | "gguf-tensor" | "gguf-type" => {
            need(gguf, "{gguf}")?;
            let mut g = Gguf::parse(gguf.as_ref().unwrap())?;
            match kind {
                "gguf-remove" => {
                    let before = g.kvs.len();
                    g.kvs.retain(|(k, _, _)| k != arg);
                    if g.kvs.len() == before {
                        return Err(format!("no GGUF key `{arg}`"));
                    }
                }
                "gguf-type" => {
                    let (key, ty) = arg.split_once('=').ok_or(format!("`{edit}`: expected gguf-type KEY=N"))?;
                    let kv = g.kvs.iter_mut().find(|(k, _, _)| k == key).ok_or(format!("no GGUF key `{key}`"))?;
                    kv.1 = ty.parse().map_err(|e| format!("{ty}: {e}"))?;
                }
                "gguf-tensor" => {
                    let (name, change) = arg.split_once(' ').ok_or(format!("`{edit}`: expected gguf-tensor NAME FIELD=VALUE"))?;
                    let i = g.tensors.iter().position(|t| t.0 == name).ok_or(format!("no GGUF tensor `{name}`"))?;
                    match change.split_once('=') {
                        Some(("type", v)) => g.tensors[i].2 = v.parse().map_err(|e| format!("{v}: {e}"))?,
                        Some(("offset", v)) => g.tensors[i].3 = v.parse().map_err(|e| format!("{v}: {e}"))?,
                        Some(("name", v)) => g.tensors[i].0 = v.to_string(),
                        Some(("dims", v)) => {
                            g.tensors[i].1 = v.split(',').map(|d| d.trim().parse().map_err(|e| format!("{d}: {e}"))).collect::<Result<_, _>>()?
                        }
                        None if change == "remove" => {
                            g.tensors.remove(i);
                        }
                        None if change == "duplicate" => {
                            let t = g.tensors[i].clone();
                            g.tensors.push(t);
                        }
                        _ => return Err(format!("`{edit}`: FIELD is type, offset, name or dims; or remove, duplicate")),
                    }
                }
                _ => {
                    let (key, v) = arg.split_once('=').ok_or(format!("`{edit}`: expected KEY=VALUE"))?;
                    let (ty, raw) = if kind == "gguf-u32" { Gguf::value(&format!("u32:{v}"))? } else { Gguf::value(v)? };
                    match g.kvs.iter_mut().find(|(k, _, _)| k == key) {
                        Some(kv) => {
                            if kind == "gguf-u32" && kv.1 != 4 {
                                return Err(format!("GGUF key `{key}` is not a uint32"));
                            }
                            *kv = (key.to_string(), ty, raw);
                        }
                        None if kind == "gguf-u32" => return Err(format!("no GGUF key `{key}`")),
                        None => g.kvs.push((key.to_string(), ty, raw)),
                    }
                }
            }
            *gguf = Some(g.write());
            Ok(())
        }
        "gguf-poke" | "artifact-poke" | "gguf-truncate" | "artifact-truncate" | "artifact-flip" => {
            let is_gguf = kind.starts_with("gguf");
            let (buf, header) = if is_gguf {
                need(gguf, "{gguf}")?;
                (gguf.as_mut().unwrap(), None)
            } else {
                need(artifact, "{artifact}")?;
                (artifact.as_mut().unwrap(), shared.artifact.as_ref().map(|a| &a.1))
            };
            match kind.split_once('-').unwrap().1 {
                "truncate" => {
                    let n = offset(arg, buf.len(), header)?;
                    buf.truncate(n);
                }
                "flip" => {
                    let at = offset(arg, buf.len(), header)?;
                    *buf.get_mut(at).ok_or(format!("flip at {at} is past the end"))? ^= 0x01;
                }
                _ => {
                    let (at, data) = arg.split_once('=').ok_or(format!("`{edit}`: expected OFFSET=HEX"))?;
                    let at = offset(at, buf.len(), header)?;
                    poke(buf, at, &hex(data)?)?;
                }
            }
            Ok(())
        }
        "manifest" => {
            // Bytes that are not UTF-8 (`\xff`) are written as they are, unexpanded.
            let bytes = match String::from_utf8(unescape(arg)?) {
                Ok(text) => p.expand(&text)?.into_bytes(),
                Err(e) => e.into_bytes(),
            };
            std::fs::write(&p.manifest, bytes).map_err(|e| e.to_string())
        }
        other => Err(format!("unknown edit kind `{other}`")),
    }
}

/// Every file under `dir` but `skip` (relative path -> xxh3 of its bytes; folders
/// as "dir"), following no links.
fn snapshot(dir: &Path, skip: &Path, into: &mut BTreeMap<String, String>, root: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let path = e.path();
        if path == skip {
            continue;
        }
        let rel = path.strip_prefix(root).unwrap().to_string_lossy().into_owned();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        if meta.is_dir() {
            into.insert(rel, "dir".into());
            snapshot(&path, skip, into, root);
        } else if meta.file_type().is_symlink() {
            into.insert(rel, format!("link -> {}", std::fs::read_link(&path).unwrap().display()));
        } else {
            let bytes = std::fs::read(&path).unwrap_or_default();
            into.insert(rel, format!("{} bytes, xxh3 {:016x}", bytes.len(), maxrun_runtime::format::checksum(&bytes)));
        }
    }
}

fn inputs_snapshot(p: &Paths) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    snapshot(&p.dir, &p.out_dir, &mut m, &p.dir);
    m
}

/// What one case did.
struct Outcome {
    command: String,
    status: String,
    stderr: String,
    problems: Vec<String>,
    elapsed: Duration,
}

fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%{}".contains(c)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

fn run_case(case: &Case, shared: &Shared) -> Outcome {
    let start = Instant::now();
    let root = temp_dir(&format!("bad-input-{}", case.name));
    let p = Paths::new(root.join("case"));
    let mut o = Outcome { command: String::new(), status: "not run".into(), stderr: String::new(), problems: Vec::new(), elapsed: Duration::ZERO };
    let setup = std::fs::create_dir_all(&p.dir)
        .map_err(|e| e.to_string())
        .and_then(|_| prepare(case, &p, shared))
        .and_then(|_| split_args(&case.args))
        .and_then(|w| w.iter().map(|w| p.expand(w)).collect::<Result<Vec<_>, _>>());
    let args = match setup {
        Ok(a) => a,
        Err(e) => {
            o.problems.push(format!("the table's line {} cannot be set up: {e}", case.line));
            return o;
        }
    };
    o.command = std::iter::once(case.tool.clone())
        .chain(args.iter().map(|a| shell_quote(&a.replace(&*p.dir.to_string_lossy(), "{dir}"))))
        .collect::<Vec<_>>()
        .join(" ");
    let before = inputs_snapshot(&p);
    let (stdout_path, stderr_path) = (root.join("stdout"), root.join("stderr"));
    let child = Command::new(bin(&case.tool))
        .args(args.iter().map(OsString::from))
        .current_dir(&p.dir)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&stdout_path).unwrap())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            o.problems.push(format!("{} does not start: {e}", case.tool));
            return o;
        }
    };
    let status = loop {
        match child.try_wait().unwrap() {
            Some(s) => break Some(s),
            None if start.elapsed() > TIMEOUT => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            None => std::thread::sleep(Duration::from_millis(3)),
        }
    };
    o.elapsed = start.elapsed();
    // The case's folder is `{dir}` in stderr, so that fragments never match the
    // digits or names of the temporary path.
    let read = |f: &Path| String::from_utf8_lossy(&std::fs::read(f).unwrap_or_default()).replace(&*p.dir.to_string_lossy(), "{dir}");
    o.stderr = read(&stderr_path);
    let stdout = read(&stdout_path);
    match status {
        None => {
            o.status = format!("killed after {} s", TIMEOUT.as_secs());
            o.problems.push(format!("ran past {} s", TIMEOUT.as_secs()));
        }
        Some(s) => match (s.code(), s.signal()) {
            (Some(code), _) => {
                o.status = format!("exit {code}");
                if code != case.exit {
                    o.problems.push(format!("exit code {code}, expected {}", case.exit));
                }
                if code == 101 {
                    o.problems.push("exit 101 (a Rust panic)".into());
                }
            }
            (None, sig) => {
                o.status = format!("killed by signal {}", sig.unwrap_or(-1));
                o.problems.push(o.status.clone());
            }
        },
    }
    if o.stderr.contains("panicked") {
        o.problems.push("stderr says `panicked`".into());
    }
    for f in &case.fragments {
        let (stream, text, f) = match f.strip_prefix("stdout:") {
            Some(f) => ("stdout", &stdout, f),
            None => ("stderr", &o.stderr, f.as_str()),
        };
        match f.strip_prefix('!') {
            Some(not) if text.contains(not) => o.problems.push(format!("{stream} says `{not}`")),
            Some(_) => {}
            None if !text.contains(f) => o.problems.push(format!("{stream} lacks `{f}`")),
            None => {}
        }
    }
    if case.exit != 0 && !matches!(status.map(|s| s.code()), Some(Some(0))) {
        let left: Vec<String> =
            std::fs::read_dir(&p.out_dir).map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect()).unwrap_or_default();
        if !left.is_empty() {
            o.problems.push(format!("a failed run left {left:?} in the output folder"));
        }
    }
    let after = inputs_snapshot(&p);
    if after != before {
        let changed: Vec<String> = before
            .keys()
            .chain(after.keys())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .filter(|k| before.get(*k) != after.get(*k))
            .map(|k| format!("{k}: {} -> {}", before.get(k).map_or("absent", |s| s), after.get(k).map_or("absent", |s| s)))
            .collect();
        o.problems.push(format!("inputs changed: {}", changed.join("; ")));
    }
    o
}

/// Creates the inputs the case's arguments and edits name, then applies the edits.
fn prepare(case: &Case, p: &Paths, shared: &Shared) -> Result<(), String> {
    let all = format!("{} {}", case.args, case.edits.join(" "));
    let kinds: Vec<&str> = case.edits.iter().map(|e| e.split(' ').next().unwrap()).collect();
    let uses = |ph: &str, prefixes: &[&str]| all.contains(ph) || kinds.iter().any(|k| prefixes.iter().any(|pre| k.starts_with(pre)));
    std::fs::create_dir_all(&p.out_dir).map_err(|e| e.to_string())?;
    if uses("{model}", &["config", "generation", "tokenizer", "safetensors", "file", "rm", "mkdir", "copy", "poke"]) {
        std::fs::create_dir_all(&p.model).map_err(|e| e.to_string())?;
        let src = fixture("tiny-llama");
        for f in MODEL_FILES {
            std::fs::copy(src.join(f), p.model.join(f)).map_err(|e| format!("{f}: {e}"))?;
        }
        // The fixture is read-only: the copies must not be.
        for f in MODEL_FILES {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(p.model.join(f), std::fs::Permissions::from_mode(0o644)).map_err(|e| format!("{f}: {e}"))?;
        }
    }
    let mut gguf = if uses("{gguf}", &["gguf-"]) { Some(shared.gguf.clone().ok_or("no GGUF loaded")?) } else { None };
    let mut artifact = if uses("{artifact}", &["artifact-"]) { Some(shared.artifact.as_ref().ok_or("no artifact compiled")?.0.clone()) } else { None };
    for e in &case.edits {
        apply_edit(e, p, &mut gguf, &mut artifact, shared).map_err(|err| format!("edit `{e}`: {err}"))?;
    }
    if let Some(g) = gguf {
        std::fs::write(&p.gguf, g).map_err(|e| e.to_string())?;
    }
    if let Some(a) = artifact {
        std::fs::write(&p.artifact, a).map_err(|e| e.to_string())?;
    }
    if all.contains("{manifest}") && !p.manifest.exists() {
        return Err("{manifest} without a `manifest` edit".into());
    }
    Ok(())
}

#[test]
fn every_bad_input_of_the_table_is_refused_cleanly() {
    let start = Instant::now();
    let text = std::fs::read_to_string(workspace_root().join(TABLE)).unwrap();
    let mut cases = parse_table(&text).unwrap_or_else(|e| panic!("{e}"));
    if let Ok(only) = std::env::var("BAD_INPUT_ONLY") {
        let only: Vec<&str> = only.split(',').map(str::trim).collect();
        cases.retain(|c| only.contains(&c.name.as_str()));
        assert!(!cases.is_empty(), "BAD_INPUT_ONLY names no case");
    } else {
        assert!(cases.len() >= 70, "{TABLE} holds {} cases; #36 asks for at least 70", cases.len());
    }
    let show = std::env::var_os("BAD_INPUT_SHOW").is_some();

    let needs = |ph: &str, kind: &str| cases.iter().any(|c| c.args.contains(ph) || c.edits.iter().any(|e| e.starts_with(kind) || e.contains(ph)));
    let gguf = needs("{gguf}", "gguf-").then(|| std::fs::read(smollm2_gguf()).unwrap());
    let artifact = needs("{artifact}", "artifact-").then(|| {
        let out = temp_file("bad-input-artifact", "tiny.mef");
        let os = std::ffi::OsStr::new;
        let r = run_bin("maxc", &[os("compile"), os("--model"), fixture("tiny-llama").as_os_str(), os("-o"), out.as_os_str(), os("--quiet")]);
        assert_eq!(r.0, 0, "compiling tiny-llama for the artifact cases failed: {}", r.2);
        let header = maxrun_runtime::artifact::Artifact::open(&out).unwrap().header;
        let bytes = std::fs::read(&out).unwrap();
        (bytes, header)
    });
    let shared = Shared { gguf, artifact };

    // Two cases at a time: most fail within a fraction of a second, in one thread.
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Outcome>>> = Mutex::new((0..cases.len()).map(|_| None).collect());
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 2);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(case) = cases.get(i) else { break };
                let o = run_case(case, &shared);
                if show {
                    eprintln!(
                        "--- {} (line {}): {} [{:.2} s]\n$ {}\n{}",
                        case.name,
                        case.line,
                        o.status,
                        o.elapsed.as_secs_f64(),
                        o.command,
                        o.stderr.trim_end()
                    );
                }
                results.lock().unwrap()[i] = Some(o);
            });
        }
    });
    let results: Vec<Outcome> = results.into_inner().unwrap().into_iter().map(Option::unwrap).collect();

    let mut per_category: BTreeMap<&str, usize> = BTreeMap::new();
    for c in &cases {
        *per_category.entry(c.name.split('_').next().unwrap()).or_default() += 1;
    }
    let slowest =
        results.iter().zip(&cases).max_by_key(|(o, _)| o.elapsed).map(|(o, c)| format!("{} {:.2} s", c.name, o.elapsed.as_secs_f64())).unwrap_or_default();
    eprintln!("{} cases in {:.1} s (slowest: {slowest}); per category: {per_category:?}", cases.len(), start.elapsed().as_secs_f64());

    // An open defect fails only on a broken invariant, or once it is fixed.
    let expectation = |p: &String| p.starts_with("exit code") || p.contains(" lacks `") || p.contains(" says `");
    let mut open = Vec::new();
    let mut results = results;
    for (c, o) in cases.iter().zip(results.iter_mut()) {
        if !c.open_defect {
            continue;
        }
        if o.problems.is_empty() {
            o.problems.push("passes now: remove its `# DEFECT` comment from the table".into());
        } else if o.problems.iter().all(expectation) {
            open.push(c.name.clone());
            o.problems.clear();
        }
    }
    eprintln!("{} open defects (lines marked `# DEFECT`): {}", open.len(), open.join(", "));
    let failures: Vec<String> = cases
        .iter()
        .zip(&results)
        .filter(|(_, o)| !o.problems.is_empty())
        .map(|(c, o)| {
            let mut stderr = o.stderr.trim_end().to_string();
            if stderr.len() > 3000 {
                let cut = (0..=3000).rev().find(|&i| stderr.is_char_boundary(i)).unwrap();
                stderr.truncate(cut);
                stderr.push_str(" [...]");
            }
            format!(
                "- {} ({TABLE}:{}): {}\n  edits: {}\n  $ {}\n  {} (expected exit {}, fragments {:?})\n  stderr: {}",
                c.name,
                c.line,
                o.problems.join("; "),
                if c.edits.is_empty() { "-".to_string() } else { c.edits.join(" && ") },
                o.command,
                o.status,
                c.exit,
                c.fragments,
                stderr.replace('\n', "\n          ")
            )
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} bad-input cases failed ({{dir}}: the case's folder of edited inputs; MAXC_KEEP_TEST_FILES=1 keeps it):\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
