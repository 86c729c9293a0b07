//! `maxrun inspect`'s report of everything an artifact records, as data (the
//! JSON that `--json` prints and `maxc compile --json` reads numbers from);
//! the maxrun CLI's `inspect_text.rs` renders it for people.

use serde_json::{json, Value};

use crate::artifact::Artifact;
use crate::format::{Plan, SectionKind, WeightEncoding, FORMAT_MAJOR};

fn plan_json(plan: &Plan, vocab: u64) -> Value {
    json!({
        "max_seq": plan.max_seq,
        "inputs": [
            {"name": "tokens", "dtype": "i32", "shape": ["seq"]},
            {"name": "positions", "dtype": "i32", "shape": ["seq"]},
        ],
        "outputs": [{"name": "logits", "dtype": "f32", "shape": ["seq", vocab]}],
        "launches": plan.launches.len(),
        "arena_bytes": plan.arena_bytes,
    })
}

/// The inspection report as JSON (the text form is rendered from it).
pub fn report(a: &Artifact) -> Value {
    let h = &a.header;
    let weights_bytes = h.total_weight_bytes();
    // Tensors and bytes per encoding; a block-quantized tensor counts once (its
    // first part) however many parts it is stored as.
    let mut per_encoding = serde_json::Map::new();
    // Tensors per element order (`row_major`, `panel16`, `interleaved16`).
    let mut per_layout = serde_json::Map::new();
    for w in &h.weights {
        let first_part = WeightEncoding::from_name(&w.encoding).is_none_or(|e| e.parts()[0].0 == w.part);
        let e = per_encoding.entry(w.encoding.clone()).or_insert(json!({"tensors": 0, "bytes": 0}));
        e["tensors"] = json!(e["tensors"].as_u64().unwrap() + u64::from(first_part));
        e["bytes"] = json!(e["bytes"].as_u64().unwrap() + w.len);
        let l = per_layout.entry(w.layout.clone()).or_insert(json!(0));
        *l = json!(l.as_u64().unwrap() + u64::from(first_part));
    }
    let kv_per_token = h.kv_cache.bytes_per_token() * h.sub_models.len() as u64;
    let mut arenas = 0;
    let mut sub_models = Vec::new();
    for (d, m) in h.sub_models.iter().enumerate() {
        let mut plans = serde_json::Map::new();
        plans.insert("prefill".into(), plan_json(&m.prefill, h.model.vocab_size));
        plans.insert("decode".into(), plan_json(&m.decode, h.model.vocab_size));
        if let Some(p) = &m.prefill_last {
            let mut j = plan_json(p, h.model.vocab_size);
            j["outputs"] = json!([{"name": "logits", "dtype": "f32", "shape": [1, h.model.vocab_size]}]);
            plans.insert("prefill_last".into(), j);
        }
        if let Some(b) = &m.batch {
            for (name, p) in [("batch_mixed", &b.mixed), ("batch_decode", &b.decode), ("batch_single", &b.single)] {
                let mut j = plan_json(p, h.model.vocab_size);
                j["inputs"] = json!([
                    {"name": "tokens", "dtype": "i32", "shape": ["rows"]},
                    {"name": "positions", "dtype": "i32", "shape": ["rows"]},
                    {"name": "slots", "dtype": "i32", "shape": ["rows"]},
                    {"name": "row_sequences", "dtype": "i32", "shape": ["rows"]},
                    {"name": "block_tables", "dtype": "i32", "shape": ["sequences", h.batch.map_or(0, |l| l.blocks_per_sequence)]},
                    {"name": "logit_rows", "dtype": "i32", "shape": ["logit_rows"]},
                ]);
                j["outputs"] = json!([{"name": "logits", "dtype": "f32", "shape": ["logit_rows", h.model.vocab_size]}]);
                plans.insert(name.into(), j);
            }
        }
        if let Some(e) = &m.encode_batch {
            let width = h.model.embedding_width.unwrap_or(0);
            let mut j = plan_json(&e.plan, h.model.vocab_size);
            j["inputs"] = json!([
                {"name": "tokens", "dtype": "i32", "shape": ["rows"]},
                {"name": "positions", "dtype": "i32", "shape": ["rows"]},
                {"name": "row_sequences", "dtype": "i32", "shape": ["rows"]},
                {"name": "sequence_starts", "dtype": "i32", "shape": ["sequences + 1"]},
            ]);
            j["outputs"] = json!([{"name": "embedding", "dtype": "f32", "shape": ["sequences", width]}]);
            plans.insert("encode_batch".into(), j);
        }
        let arena: u64 = m.plans().map(|p| p.arena_bytes).sum();
        arenas += arena;
        let weight_bytes: u64 = h.weights.iter().filter(|w| w.device as usize == d).map(|w| w.len).sum();
        sub_models.push(json!({
            "name": m.name,
            "device": m.device,
            "weight_bytes": weight_bytes,
            "weight_section_bytes": m.weight_bytes,
            "activation_arena_bytes": arena,
            "kv_bytes_per_token": m.kv_bytes_per_token,
            "collectives": m.decode.collectives.len(),
            "plans": plans,
        }));
    }
    let tensors = per_encoding.values().map(|e| e["tensors"].as_u64().unwrap_or(0)).sum::<u64>();
    json!({
        "file": a.path.display().to_string(),
        "file_bytes": a.file_len(),
        "format": {"major": FORMAT_MAJOR, "minor": a.minor},
        "model": h.model,
        "provenance": h.provenance,
        "target": h.target,
        "mesh": {"kind": h.mesh.kind.name(), "devices": h.mesh.len(), "spec": h.mesh.spec()},
        "sub_models": sub_models,
        "kernels": {
            "count": h.kernels.len(),
            "code_bytes": a.code().len(),
            "names": h.kernels.iter().map(|k| k.symbol.clone()).collect::<Vec<_>>(),
        },
        "weights": {"count": h.weights.len(), "tensors": tensors, "bytes": weights_bytes, "by_encoding": per_encoding, "by_layout": per_layout},
        // A mixture of experts: a token reads the dense weights and its experts'.
        "experts": h.model.experts.as_ref().map(|e| json!({
            "experts": e.experts,
            "top_k": e.top_k,
            "routing": e.routing,
            "routed_layers": e.routed_layers,
            "expert_bytes": e.expert_bytes,
            "weight_bytes_per_token": h.decode_weight_bytes(),
        })),
        "cpu_code": h.has_cpu_code(),
        // Every CPU code variant as written; `selected`: the one this machine runs.
        "cpu_variants": a.cpu_variants.iter().enumerate().map(|(i, t)| json!({
            "spec": crate::artifact::variant_name(t), "triple": t.triple, "cpu": t.cpu, "required_features": t.required_features,
            "code_bytes": a.section(SectionKind::cpu_code(i)).len(), "selected": i == a.cpu_variant,
        })).collect::<Vec<_>>(),
        "gpu": h.gpu_archs.iter().enumerate().map(|(i, arch)| json!({
            "arch": arch, "ptx_bytes": a.section(SectionKind::Ptx(i as u32)).len(),
        })).collect::<Vec<_>>(),
        "memory": {
            "weights_bytes": weights_bytes,
            "activation_arena_bytes": arenas,
            "kv_bytes_per_token": kv_per_token,
            "kv_encoding": h.kv_cache.encoding.name(),
            "max_length": h.max_length,
            "total_bytes_at_max_length": weights_bytes + arenas + kv_per_token * h.max_length,
        },
        "sections": h.sections.iter().map(|s| json!({
            "kind": format!("{:?}", s.kind), "offset": s.offset, "bytes": s.len, "xxh3": format!("{:016x}", s.checksum),
        })).collect::<Vec<_>>(),
        "generation": h.generation,
        "tokenizer": h.tokenizer,
        "batch": h.batch.map(|b| json!({
            "block_size": b.block_size,
            "blocks_per_sequence": b.blocks_per_sequence,
            "max_batch_tokens": b.max_rows,
            "max_sequences": b.max_sequences,
            "max_logit_rows": b.max_logit_rows,
            // Keys plus values of every layer.
            "kv_bytes_per_block": b.block_bytes(&h.kv_cache).map(|x| x * 2 * h.kv_cache.layers),
        })),
        "encode_batch": h.main().encode_batch.as_ref().map(|e| json!({
            "max_batch_tokens": e.max_rows,
            "max_sequences": e.max_sequences,
        })),
    })
}
