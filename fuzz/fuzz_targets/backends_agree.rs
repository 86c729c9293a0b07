//! Differential fuzzing of the two backends: random small kernels (family and
//! shapes from the input bytes) compiled by LLVM and by Cranelift, run on the same
//! random inputs; any disagreement beyond the reduction tolerance is a crash.
#![no_main]

use libfuzzer_sys::fuzz_target;
use maxc_codegen::{cranelift, llvm, CpuTarget};
use maxc_kernels::interp::{run, Buffer};
use maxc_kernels::library::attention::{attention, AttentionShape, KeyLayout};
use maxc_kernels::library::elementwise::{binary, unary, Binary, Broadcast, Unary};
use maxc_kernels::library::matmul::matmul;
use maxc_kernels::library::rms_norm::{layer_norm, rms_norm};
use maxc_kernels::library::SeqMode;
use maxc_kernels::{ElemType, Kernel};
use maxrun_runtime::code::LoadedCode;

fn kernel_from(b: &[u8]) -> Option<(Kernel, Vec<usize>, i32, u64)> {
    let get = |i: usize, m: u64| b.get(i).map_or(1, |&x| x as u64 % m + 1);
    let (s, k, n) = (get(1, 4), get(2, 48), get(3, 24));
    let seq = SeqMode::Dynamic;
    let su = s as usize;
    Some(match b.first()? % 6 {
        0 => (matmul(k, n, ElemType::F32, seq), vec![su * k as usize, (n * k) as usize, su * n as usize], 1, s),
        1 => (rms_norm(k, k, 1e-5, seq), vec![su * k as usize, k as usize, su * k as usize], 1, s),
        2 => (layer_norm(k, 1e-5, seq), vec![su * k as usize, k as usize, k as usize, su * k as usize], 1, s),
        3 => {
            let op = [Unary::Silu, Unary::GeluTanh, Unary::Gelu, Unary::Exp, Unary::Tanh][get(4, 5) as usize - 1];
            (unary(op, k, seq), vec![su * k as usize, su * k as usize], 1, s)
        }
        4 => (binary(Binary::Max, k, Broadcast::Row, seq), vec![su * k as usize, k as usize, su * k as usize], 1, s),
        _ => {
            let (heads, hd) = (get(4, 3), 2 * get(5, 8));
            let shape = AttentionShape { heads, kv_heads: heads, head_dim: hd, scale: 0.4, window: None, max_len: 16, softcap: None, causal: true, cache: ElemType::F32, keys: KeyLayout::Rows, sinks: false };
            let w = (heads * hd) as usize;
            (attention(shape, seq), vec![su * w, su, 16 * w, 16 * w, su * heads as usize * 16, su * w], 16, s)
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((kernel, sizes, int_max, seq)) = kernel_from(data) else { return };
    let mut state = data.iter().fold(0x9e37_79b9_7f4a_7c15u64, |h, &b| h.rotate_left(5) ^ b as u64) | 1;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let inputs: Vec<Buffer> = kernel
        .params
        .iter()
        .zip(&sizes)
        .map(|(p, &n)| match p.elem {
            ElemType::I32 => Buffer::I32((0..n).map(|_| ((next() + 1.0) * 0.5 * int_max as f32) as i32 % int_max).collect()),
            _ => Buffer::F32((0..n).map(|_| next() * 2.0).collect()),
        })
        .collect();
    let mut reference = inputs.clone();
    run(&kernel, &mut reference, seq);
    let target = CpuTarget::parse("cpu").unwrap();
    for code in [llvm::compile_shared(std::slice::from_ref(&kernel), &target).unwrap(), cranelift::compile_shared(std::slice::from_ref(&kernel)).unwrap()] {
        let loaded = LoadedCode::load(&code.shared_object).unwrap();
        let f = loaded.kernel(&kernel.name).unwrap();
        let mut bufs = inputs.clone();
        let ptrs: Vec<*mut u8> = bufs.iter_mut().map(Buffer::as_mut_ptr).collect();
        let dims = [seq as i64];
        // SAFETY: the buffers are sized for the kernel (the interpreter ran it with bounds checks).
        unsafe { f(ptrs.as_ptr(), dims.as_ptr(), 0, kernel.tasks.eval(seq)) };
        for (a, b) in bufs.iter().zip(&reference) {
            if let (Buffer::F32(a), Buffer::F32(b)) = (a, b) {
                for (x, y) in a.iter().zip(b) {
                    let tol = 2e-4 * (1.0 + y.abs());
                    assert!((x - y).abs() <= tol || (x.is_nan() && y.is_nan()), "{}: {x} vs interpreter {y}", kernel.name);
                }
            }
        }
    }
});
