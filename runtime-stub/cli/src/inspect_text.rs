//! `maxrun inspect`'s text: the runtime's inspect report (`maxrun_runtime::inspect::report`,
//! JSON data) rendered for people.

use serde_json::Value;

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

/// Renders the report for people.
pub fn render_text(r: &Value) -> String {
    let mut s = String::new();
    let mut line = |k: &str, v: String| s.push_str(&format!("{k:<22} {v}\n"));
    line("file", format!("{} ({})", r["file"].as_str().unwrap_or(""), mib(r["file_bytes"].as_u64().unwrap_or(0))));
    line("format", format!("{}.{}", r["format"]["major"], r["format"]["minor"]));
    line("model", format!("{} ({}, {} layers, vocab {})", r["model"]["name"].as_str().unwrap_or(""), r["model"]["architecture"].as_str().unwrap_or(""), r["model"]["num_layers"], r["model"]["vocab_size"]));
    let p = &r["provenance"];
    line("maxc", format!("{} (git {})", p["maxc_version"].as_str().unwrap_or(""), p["maxc_git_revision"].as_str().unwrap_or("")));
    line("build id", p["build_id"].as_str().unwrap_or("").to_string());
    line("flags", p["flags"].as_array().map(|f| f.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(" ")).unwrap_or_default());
    for i in p["inputs"].as_array().into_iter().flatten() {
        line("input", format!("{} ({} bytes, xxh3 {:016x})", i["path"].as_str().unwrap_or(""), i["bytes"], i["xxh3"].as_u64().unwrap_or(0)));
    }
    let t = &r["target"];
    line("target", format!("{} cpu={} backend={} (spec `{}`)", t["triple"].as_str().unwrap_or(""), t["cpu"].as_str().unwrap_or(""), t["backend"].as_str().unwrap_or(""), p["target_spec"].as_str().unwrap_or("")));
    line("required features", t["required_features"].as_array().map(|f| f.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(",")).unwrap_or_default());
    if r["cpu_code"] == false {
        line("cpu code", "none (GPU-only artifact)".into());
    }
    let variants = r["cpu_variants"].as_array().cloned().unwrap_or_default();
    if variants.len() > 1 {
        for v in &variants {
            let chosen = if v["selected"] == true { "  <- runs here" } else { "" };
            line("cpu variant", format!("{} ({} code bytes, {} features){chosen}", v["spec"].as_str().unwrap_or(""), v["code_bytes"], v["required_features"].as_array().map_or(0, Vec::len)));
        }
    }
    for g in r["gpu"].as_array().into_iter().flatten() {
        line("gpu code", format!("PTX for {}, {} bytes", g["arch"].as_str().unwrap_or(""), g["ptx_bytes"]));
    }
    let subs = r["sub_models"].as_array().cloned().unwrap_or_default();
    if subs.len() > 1 {
        line("device mesh", format!("{} ({} devices)", r["mesh"]["spec"].as_str().unwrap_or(""), subs.len()));
        for m in &subs {
            line(
                &format!("sub-model {}", m["name"].as_str().unwrap_or("")),
                format!("on {}: weights {}, KV {} bytes per token, {} collectives per decode step", m["device"].as_str().unwrap_or(""), mib(m["weight_bytes"].as_u64().unwrap_or(0)), m["kv_bytes_per_token"], m["collectives"]),
            );
        }
    }
    for (name, plan) in r["sub_models"][0]["plans"].as_object().into_iter().flatten() {
        let dims = |v: &Value| -> String { v.as_array().into_iter().flatten().map(|d| d.as_str().map_or(d.to_string(), str::to_string)).collect::<Vec<_>>().join(", ") };
        let inputs: Vec<String> = plan["inputs"].as_array().into_iter().flatten().map(|i| format!("{} {}[{}]", i["name"].as_str().unwrap_or(""), i["dtype"].as_str().unwrap_or(""), dims(&i["shape"]))).collect();
        let rows = if name.starts_with("batch") || name == "encode_batch" { "rows" } else { "seq" };
        let output = &plan["outputs"][0];
        line(
            &format!("plan {name}"),
            format!(
                "{} -> {} f32[{}]; {rows} <= {}; {} launches; arena {}",
                inputs.join(", "),
                output["name"].as_str().unwrap_or("logits"),
                dims(&output["shape"]),
                plan["max_seq"],
                plan["launches"],
                mib(plan["arena_bytes"].as_u64().unwrap_or(0))
            ),
        );
    }
    if let Some(b) = r["batch"].as_object() {
        line(
            "batched engine",
            format!(
                "{} sequences, {} rows per step, {} with logits (drafts verified); KV blocks of {} positions, {} bytes each (all layers' keys and values), up to {} per sequence",
                b["max_sequences"], b["max_batch_tokens"], b["max_logit_rows"], b["block_size"], b["kv_bytes_per_block"], b["blocks_per_sequence"]
            ),
        );
    }
    if let Some(e) = r["encode_batch"].as_object() {
        line("encoder batch", format!("{} sequences, {} rows per step (each input whole in one step; no KV cache)", e["max_sequences"], e["max_batch_tokens"]));
    }
    line("kernels", format!("{} kernels, {} bytes of code", r["kernels"]["count"], r["kernels"]["code_bytes"]));
    let by_encoding: Vec<String> = r["weights"]["by_encoding"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(e, v)| format!("{} {e}", v["tensors"]))
        .collect();
    line("weights", format!("{} tensors in {} stored parts ({}), {}", r["weights"]["tensors"], r["weights"]["count"], by_encoding.join(", "), mib(r["weights"]["bytes"].as_u64().unwrap_or(0))));
    let by_layout: Vec<String> = r["weights"]["by_layout"].as_object().into_iter().flatten().map(|(l, n)| format!("{n} {l}")).collect();
    line("weight layouts", by_layout.join(", "));
    if let Some(e) = r["experts"].as_object() {
        line(
            "experts",
            format!(
                "{} per layer, top {} ({}), {} routed layers; {} of experts, {} of weights read per token",
                e["experts"],
                e["top_k"],
                e["routing"].as_str().unwrap_or("?"),
                e["routed_layers"],
                mib(e["expert_bytes"].as_u64().unwrap_or(0)),
                mib(e["weight_bytes_per_token"].as_u64().unwrap_or(0))
            ),
        );
    }
    let m = &r["memory"];
    line("KV cache", format!("{} bytes per token ({}), max length {}", m["kv_bytes_per_token"], m["kv_encoding"].as_str().unwrap_or("?"), m["max_length"]));
    line("memory at max length", mib(m["total_bytes_at_max_length"].as_u64().unwrap_or(0)));
    for sec in r["sections"].as_array().into_iter().flatten() {
        line(&format!("section {}", sec["kind"].as_str().unwrap_or("")), format!("{} bytes at {}, xxh3 {}", sec["bytes"], sec["offset"], sec["xxh3"].as_str().unwrap_or("")));
    }
    s
}
