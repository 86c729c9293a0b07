//! Graph IR and pass tests: text round trips of real builder graphs, per-pass
//! snapshots (tests/ir/<pass>/*.mxir, re-bless with MAXC_BLESS=1), and every pass
//! checked against the reference interpreter.

use std::collections::HashMap;

use maxc::builders::build_graph;
use maxc::graph::text::{parse, print};
use maxc::graph::verify::verify;
use maxc::graph::{DType, Dim, Graph, Op};
use maxc::import::import;
use maxc::interp::{run_tokens, Interpreter, Tensor, WeightSource};
use maxc::passes::{by_name, pipeline, run_pipeline, PipelineOptions};
use maxc_tests::*;

/// A small deterministic generator (xorshift), so random inputs are reproducible.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Random weights and inputs for every leaf of `g` (seq = 3), by name.
fn random_env(g: &Graph, seed: u64) -> (HashMap<String, Vec<f32>>, HashMap<String, Tensor>) {
    let mut rng = Rng(seed);
    let seq = 3usize;
    let concrete = |shape: &[Dim]| -> Vec<usize> { shape.iter().map(|d| d.fixed().map_or(seq, |n| n as usize)).collect() };
    let (mut weights, mut inputs) = (HashMap::new(), HashMap::new());
    for n in &g.nodes {
        match &n.op {
            Op::Weight { name, ty, .. } => {
                let len = concrete(&ty.shape).iter().product();
                weights.entry(name.clone()).or_insert_with(|| (0..len).map(|_| rng.next()).collect());
            }
            Op::Input { name, ty } => {
                let shape = concrete(&ty.shape);
                let len = shape.iter().product();
                let t = match ty.dtype {
                    DType::I32 if name == "positions" => Tensor::i32(shape, (0..len as i32).collect()),
                    DType::I32 => Tensor::i32(shape, (0..len).map(|_| ((rng.next() + 1.0) * 3.0) as i32).collect()),
                    _ => Tensor::f32(shape, (0..len).map(|_| rng.next()).collect()),
                };
                inputs.insert(name.clone(), t);
            }
            _ => {}
        }
    }
    (weights, inputs)
}

fn outputs(g: &Graph, w: &dyn WeightSource, inputs: &HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    Interpreter::new(g, w).run(inputs).unwrap()
}

fn assert_same_outputs(what: &str, a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) {
    assert_eq!(a.len(), b.len(), "{what}: output count");
    for (name, x) in a {
        let y = &b[name];
        assert_eq!(x.shape, y.shape, "{what}: {name} shape");
        for (u, v) in x.as_f32().iter().zip(y.as_f32()) {
            assert!((u - v).abs() <= 1e-5 * (1.0 + u.abs()), "{what}: {name}: {u} vs {v}");
        }
    }
}

#[test]
fn pass_snapshots() {
    let bless = std::env::var_os("MAXC_BLESS").is_some();
    let root = workspace_root().join("tests/ir");
    let mut checked = 0;
    // bfloat16 so that the quantize pass has something to do; the others ignore it.
    for pass in maxc::passes::pipeline_for(maxc::graph::WeightEncoding::BFloat16) {
        let dir = root.join(pass.name());
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|_| panic!("{} has no snapshot directory", dir.display()))
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "mxir") && !p.to_string_lossy().ends_with(".expected.mxir"))
            .collect();
        files.sort();
        assert!(!files.is_empty(), "no snapshots for pass {}", pass.name());
        for input in files {
            let what = input.display().to_string();
            let before = parse(&std::fs::read_to_string(&input).unwrap()).unwrap();
            verify(&before).unwrap();
            let mut after = before.clone();
            pass.run(&mut after).unwrap();
            verify(&after).unwrap_or_else(|e| panic!("{what}: {e}"));
            let (w, inputs) = random_env(&before, 7);
            if pass.name() != "quantize" {
                assert_same_outputs(&what, &outputs(&before, &w, &inputs), &outputs(&after, &w, &inputs));
            }
            let expected_path = input.with_extension("expected.mxir");
            let text = print(&after);
            if bless {
                std::fs::write(&expected_path, &text).unwrap();
            } else {
                let expected = std::fs::read_to_string(&expected_path).unwrap_or_else(|_| panic!("{} missing", expected_path.display()));
                assert_eq!(text, expected, "{what}: snapshot differs (MAXC_BLESS=1 to update after review)");
            }
            checked += 1;
        }
    }
    assert!(checked >= 8);
}

#[test]
fn builder_graphs_round_trip_through_text() {
    for name in ["tiny-llama", "tiny-qwen2"] {
        let model = import(&fixture(name), None).unwrap();
        let mut g = build_graph(&model).unwrap();
        verify(&g).unwrap();
        for stage in ["built", "optimized"] {
            let text = print(&g);
            let parsed = parse(&text).unwrap_or_else(|e| panic!("{name} {stage}: {e}"));
            assert_eq!(parsed, g, "{name} {stage}: parse(print(g)) != g");
            assert_eq!(print(&parsed), text);
            run_pipeline(&mut g, &PipelineOptions { verify_each: true, ..Default::default() }).unwrap();
        }
    }
}

/// Each pass, applied in pipeline order to a real model, keeps its logits;
/// stack-linear turns 7 matmuls per layer into 4 (QKV, o, gate/up, down), and the
/// fusions put the residual adds of o and down into their matmuls and the SwiGLU
/// activation into one op.
#[test]
fn every_pass_keeps_real_model_logits() {
    for name in ["tiny-llama", "tiny-qwen2"] {
        let model = import(&fixture(name), None).unwrap();
        let mut g = build_graph(&model).unwrap();
        let layers = model.config.num_layers;
        assert_eq!(g.count("matmul"), 7 * layers + 1);
        let ids = [5u32, 900, 17, 4000, 2];
        let reference = run_tokens(&mut Interpreter::new(&g, &model.weights), &ids, 0).unwrap();
        for pass in pipeline() {
            pass.run(&mut g).unwrap();
            verify(&g).unwrap_or_else(|e| panic!("{name} after {}: {e}", pass.name()));
            let logits = run_tokens(&mut Interpreter::new(&g, &model.weights), &ids, 0).unwrap();
            let (err, _) = logits_error(logits.as_f32(), reference.as_f32());
            assert!(err <= 1e-4, "{name}: pass {} changed the logits by {err}", pass.name());
        }
        assert_eq!(g.count("matmul"), 2 * layers + 1, "{name}: QKV, gate/up and the lm_head stay plain matmuls");
        assert_eq!(g.count("matmul_add"), 2 * layers, "{name}: o_proj and down_proj carry the residual add");
        assert_eq!(g.count("swiglu"), layers);
        assert_eq!(g.count("silu") + g.count("mul"), 0);
        assert_eq!(g.count("concat"), 2 * layers);
        assert_eq!(g.count("attention"), layers);
    }
}

#[test]
fn passes_are_found_by_name() {
    for p in pipeline() {
        assert_eq!(by_name(p.name()).unwrap().name(), p.name());
    }
    assert!(by_name("no-such-pass").is_none());
}
