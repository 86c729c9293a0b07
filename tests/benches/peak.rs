//! The machine's compute peak per core and per instruction mix, the yardstick
//! prefill is reported against (docs/performance-log.md "Compute peak"): chains of
//! independent multiply-accumulates with no loads, one instruction kind per
//! bench, on one thread and on every core at once. Criterion's throughput
//! (elements/s) is operations/s, a multiply-accumulate counting 2:
//!
//! - `fma_f32`: `vfmadd231ps` (zmm with AVX-512, ymm with AVX2): the float32 paths.
//! - `vnni_u8i8`: `vpdpbusd` zmm (AVX-512 VNNI): the int8-activation paths.
//! - `bf16_dot`: `vdpbf16ps` zmm (AVX512_BF16): what bfloat16 weights could use.
//! - `madd_u8i8_ymm`: `vpmaddubsw` ymm (AVX2), byte products summed in pairs:
//!   the multiply of the int8 / int16-activation paths on CPUs without VNNI
//!   (each dot step adds a `vpaddw`, and each block a `vpmaddwd`, on top).
//! - `madd_i16_ymm`: `vpmaddwd` ymm (AVX2), word products summed in pairs:
//!   Q8_0's word activations, and the widening of the byte pairs.
//!
//! Each is skipped where the CPU lacks its instructions.
//!
//!     cargo bench -p maxc-tests --bench peak

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};

/// Independent accumulators per chain: more than latency x throughput (4 x 2).
const CHAINS: usize = 12;
/// Iterations per call (each issues `CHAINS` instructions).
const STEPS: usize = 1 << 14;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{CHAINS, STEPS};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub fn fma_zmm(seed: f32) -> f32 {
        let mut acc = [_mm512_set1_ps(seed); CHAINS];
        let (a, b) = (_mm512_set1_ps(1.000_001), _mm512_set1_ps(1e-7));
        for _ in 0..STEPS {
            for x in &mut acc {
                *x = _mm512_fmadd_ps(*x, a, b);
            }
        }
        acc.iter().map(|&x| _mm512_reduce_add_ps(x)).sum()
    }

    #[target_feature(enable = "avx2,fma")]
    pub fn fma_ymm(seed: f32) -> f32 {
        let mut acc = [_mm256_set1_ps(seed); CHAINS];
        let (a, b) = (_mm256_set1_ps(1.000_001), _mm256_set1_ps(1e-7));
        for _ in 0..STEPS {
            for x in &mut acc {
                *x = _mm256_fmadd_ps(*x, a, b);
            }
        }
        let mut out = [0f32; 8];
        acc.iter().fold(0.0, |s, &x| {
            // SAFETY: `out` holds 8 floats.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), x) };
            s + out.iter().sum::<f32>()
        })
    }

    #[target_feature(enable = "avx512f,avx512vnni")]
    pub fn vnni_zmm(seed: i32) -> i32 {
        let mut acc = [_mm512_set1_epi32(seed); CHAINS];
        let (a, b) = (_mm512_set1_epi8(3), _mm512_set1_epi8(-2));
        for _ in 0..STEPS {
            for x in &mut acc {
                *x = _mm512_dpbusd_epi32(*x, a, b);
            }
        }
        acc.iter().map(|&x| _mm512_reduce_add_epi32(x)).fold(0, i32::wrapping_add)
    }

    /// Each accumulator fed back as the unsigned bytes of the next multiply
    /// (saturating: the values do not matter, the instruction count does).
    #[target_feature(enable = "avx2")]
    pub fn maddubs_ymm(seed: i8) -> i32 {
        let mut acc = [_mm256_set1_epi8(seed); CHAINS];
        let b = _mm256_set1_epi8(-3);
        for _ in 0..STEPS {
            for x in &mut acc {
                *x = _mm256_maddubs_epi16(*x, b);
            }
        }
        reduce_ymm(&acc)
    }

    #[target_feature(enable = "avx2")]
    pub fn maddwd_ymm(seed: i16) -> i32 {
        let mut acc = [_mm256_set1_epi16(seed); CHAINS];
        let b = _mm256_set1_epi16(-3);
        for _ in 0..STEPS {
            for x in &mut acc {
                *x = _mm256_madd_epi16(*x, b);
            }
        }
        reduce_ymm(&acc)
    }

    /// The accumulators' i32 lanes summed (wrapping), so that none is dead code.
    #[target_feature(enable = "avx2")]
    fn reduce_ymm(acc: &[__m256i]) -> i32 {
        let mut out = [0i32; 8];
        acc.iter().fold(0, |s: i32, &x| {
            // SAFETY: `out` holds 8 i32.
            unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), x) };
            out.iter().fold(s, |t, &v| t.wrapping_add(v))
        })
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    pub fn bf16_zmm(seed: f32) -> f32 {
        let mut acc = [_mm512_set1_ps(seed); CHAINS];
        let a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1.0), _mm512_set1_ps(0.5));
        let b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3), _mm512_set1_ps(2e-3));
        for _ in 0..STEPS {
            for x in &mut acc {
                *x = _mm512_dpbf16_ps(*x, a, b);
            }
        }
        acc.iter().map(|&x| _mm512_reduce_add_ps(x)).sum()
    }
}

/// Calls per thread per measured iteration: enough work that starting the
/// threads (tens of microseconds) does not count.
const CALLS: usize = 64;

/// Runs `f` [`CALLS`] times on each of `threads` threads at once (each its own chains).
fn on_threads(threads: usize, f: &(dyn Fn() + Sync)) {
    let calls = || (0..CALLS).for_each(|_| f());
    if threads == 1 {
        calls();
        return;
    }
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(calls);
        }
    });
}

fn peak(c: &mut Criterion) {
    #[cfg(target_arch = "x86_64")]
    {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // (name, operations per instruction, available, one call)
        type Bench = (&'static str, u64, bool, fn());
        let benches: [Bench; 6] = [
            ("fma_f32_zmm", 16 * 2, is_x86_feature_detected!("avx512f"), || {
                // SAFETY: guarded by the feature check above.
                black_box(unsafe { x86::fma_zmm(black_box(1.0)) });
            }),
            ("fma_f32_ymm", 8 * 2, is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"), || {
                // SAFETY: guarded by the feature check above.
                black_box(unsafe { x86::fma_ymm(black_box(1.0)) });
            }),
            ("vnni_u8i8_zmm", 64 * 2, is_x86_feature_detected!("avx512vnni"), || {
                // SAFETY: guarded by the feature check above.
                black_box(unsafe { x86::vnni_zmm(black_box(1)) });
            }),
            ("madd_u8i8_ymm", 32 * 2, is_x86_feature_detected!("avx2"), || {
                // SAFETY: guarded by the feature check above.
                black_box(unsafe { x86::maddubs_ymm(black_box(1)) });
            }),
            ("madd_i16_ymm", 16 * 2, is_x86_feature_detected!("avx2"), || {
                // SAFETY: guarded by the feature check above.
                black_box(unsafe { x86::maddwd_ymm(black_box(1)) });
            }),
            ("bf16_dot_zmm", 32 * 2, is_x86_feature_detected!("avx512bf16"), || {
                // SAFETY: guarded by the feature check above.
                black_box(unsafe { x86::bf16_zmm(black_box(1.0)) });
            }),
        ];
        let mut group = c.benchmark_group("peak");
        for (name, ops, available, run) in benches {
            if !available {
                eprintln!("peak/{name}: skipped (the CPU lacks its instructions)");
                continue;
            }
            for threads in [1, cores] {
                group.throughput(Throughput::Elements(ops * (CHAINS * STEPS * CALLS * threads) as u64));
                group.bench_function(format!("{name}/threads{threads}"), |b| b.iter(|| on_threads(threads, &run)));
                if cores == 1 {
                    break;
                }
            }
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(2));
    targets = peak
}
criterion_main!(benches);
