//! Criterion benches of `maxrun`'s sampler on one row of SmolLM2-sized logits
//! (a 49,152-token vocabulary): greedy, temperature alone, with top-p, and with
//! top-k + top-p + min-p, beside the full sort of the vocabulary that the
//! sampler did before it selected (the cost it removed). SmolLM2's whole q4_1
//! decode step takes 3-4 ms on two threads, so a sampler's time per token is
//! read against that.
//!
//! `cargo bench -p maxc-tests --bench sampling` (docs/performance.md has figures).

use criterion::{criterion_group, criterion_main, Criterion};
use maxrun_runtime::sampler::{sample, Rng, SamplingParams};
use std::hint::black_box;

const VOCAB: usize = 49_152;

/// Logits shaped like a language model's: most of the vocabulary far below a
/// few dozen plausible tokens (seeded, so every run draws the same row).
fn logits() -> Vec<f32> {
    let mut rng = Rng::new(11);
    (0..VOCAB)
        .map(|_| {
            let u = rng.next_f32();
            if u < 0.001 { 12.0 + 8.0 * rng.next_f32() } else { 12.0 * rng.next_f32() - 4.0 }
        })
        .collect()
}

fn sampling(c: &mut Criterion) {
    let row = logits();
    let mut group = c.benchmark_group("sample_49k");
    let cases = [
        ("greedy", SamplingParams::default()),
        ("temperature", SamplingParams { temperature: 0.8, ..Default::default() }),
        ("top_p", SamplingParams { temperature: 0.8, top_p: 0.95, ..Default::default() }),
        ("top_k_top_p_min_p", SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05 }),
    ];
    for (name, params) in cases {
        let mut rng = Rng::new(1);
        group.bench_function(name, |b| b.iter(|| sample(black_box(&row), &params, &mut rng)));
    }
    group.bench_function("full_sort_before", |b| {
        b.iter(|| {
            let mut cand: Vec<(u32, f32)> = black_box(&row).iter().enumerate().map(|(i, &l)| (i as u32, l / 0.8)).collect();
            cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            cand[0].0
        })
    });
    group.finish();
}

criterion_group!(benches, sampling);
criterion_main!(benches);
