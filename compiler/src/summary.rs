//! `maxc compile --json`: the one JSON object a compile prints on stdout for CI
//! (docs/ci.md), the summary of the artifact read back from the written file or,
//! on failure, the error with the file and field it names.

use std::path::Path;

use serde_json::{json, Value};

use crate::driver::Phase;

/// The summary of the artifact at `output`: what it is (bytes, build id,
/// targets, encodings, memory at its maximum length, kernels and launches),
/// read back from its header with the numbers `maxrun inspect --json` shows,
/// and how it was made (`wall_s`, `phases`, `cache`, `notes`).
pub fn success(output: &Path, wall_s: f64, phases: &[Phase], notes: &[String], cache: Value) -> anyhow::Result<Value> {
    let artifact = maxrun_runtime::artifact::Artifact::open(output)?;
    let report = maxrun_runtime::inspect::report(&artifact);
    let h = &artifact.header;
    // Every CPU code variant (one, or several in a multi-ISA artifact), then
    // every GPU architecture.
    let cpu = h
        .cpu_targets()
        .filter(|t| !t.triple.is_empty())
        .map(|t| json!({"kind": "cpu", "spec": t.spec, "triple": t.triple, "cpu": t.cpu, "required_features": t.required_features, "backend": t.backend}));
    let gpu = h.gpu_archs.iter().map(|arch| json!({"kind": "cuda", "arch": arch}));
    Ok(json!({
        "artifact": output.display().to_string(),
        "bytes": artifact.file_len(),
        "build_id": h.provenance.build_id,
        "target_spec": h.provenance.target_spec,
        "targets": cpu.chain(gpu).collect::<Vec<_>>(),
        "mesh": report["mesh"],
        "encodings": {
            "weights": report["weights"]["by_encoding"],
            "kv_cache": h.kv_cache.encoding.name(),
        },
        "memory": report["memory"],
        "kernels": h.kernels.len(),
        "prefill_launches": h.main().prefill.launches.len(),
        "decode_launches": h.main().decode.launches.len(),
        "wall_s": wall_s,
        "phases": phases.iter().map(|p| json!({
            "name": p.name, "wall_s": p.wall_s, "peak_rss_bytes": p.peak_rss_bytes, "peak_anon_bytes": p.peak_anon_bytes,
        })).collect::<Vec<_>>(),
        "cache": cache,
        "notes": notes,
    }))
}

/// `{"error": {...}}` for a failed command: the message as stderr shows it,
/// the exit code, a `kind`, and the `file`, `field`, `flag` and `tensor` the
/// error names (null where it names none).
pub fn error(e: &anyhow::Error) -> Value {
    use crate::Error;
    let (mut kind, mut file, mut field, mut flag, mut tensor) = ("error", None, None, None, None);
    if e.downcast_ref::<maxrun_runtime::usage::Usage>().is_some() {
        kind = "usage";
    }
    if let Some(err) = e.chain().find_map(|c| c.downcast_ref::<Error>()) {
        let shown = |p: &Path| Some(p.display().to_string());
        match err {
            Error::Io { path, .. } => (kind, file) = ("io", shown(path)),
            Error::Write { path, .. } => (kind, file) = ("write", shown(path)),
            Error::Invalid { path, field: f, .. } => (kind, file, field) = ("invalid", shown(path), Some(f.clone())),
            Error::UnsupportedArchitecture { path, .. } => (kind, file, field) = ("unsupported_architecture", shown(path), Some("architecture".to_string())),
            Error::MissingWeight { path, name, .. } => (kind, file, tensor) = ("missing_weight", shown(path), Some(name.clone())),
            Error::WeightShape { path, name, .. } => (kind, file, tensor) = ("weight_shape", shown(path), Some(name.clone())),
            Error::IrParse { .. } => kind = "ir_parse",
            Error::Verify(_) => kind = "verify",
            Error::Codegen(_) => kind = "codegen",
            Error::Flag { flag: f, .. } => (kind, flag) = ("flag", Some(f.clone())),
        }
    }
    json!({"error": {
        "message": format!("{e:#}"),
        "kind": kind,
        "exit_code": maxrun_runtime::usage::exit_status(e),
        "file": file,
        "field": field,
        "flag": flag,
        "tensor": tensor,
    }})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_their_file_field_and_exit_code() {
        let e = anyhow::Error::from(crate::Error::invalid("m.toml", "compile.target", "`cpu:z80`: unknown"));
        let j = error(&e);
        assert_eq!(j["error"]["kind"], "invalid");
        assert_eq!(j["error"]["file"], "m.toml");
        assert_eq!(j["error"]["field"], "compile.target");
        assert_eq!(j["error"]["exit_code"], 1);
        assert_eq!(j["error"]["message"], "m.toml: compile.target: `cpu:z80`: unknown");
        let j = error(&maxrun_runtime::usage::usage("give -o OUT.mef"));
        assert_eq!((j["error"]["kind"].as_str(), j["error"]["exit_code"].as_u64(), j["error"]["file"].is_null()), (Some("usage"), Some(2), true));
        let j = error(&anyhow::Error::from(crate::Error::Flag { flag: "--stop-after".into(), message: "x".into() }).context("compiling"));
        assert_eq!((j["error"]["kind"].as_str(), j["error"]["flag"].as_str()), (Some("flag"), Some("--stop-after")));
    }
}
