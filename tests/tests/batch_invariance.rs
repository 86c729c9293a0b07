//! Batch invariance (issue #65): a row's result is the same bits whichever plan
//! computes it: alone (single-stream decode), as one of several rows of its
//! own sequence (a prompt chunk, speculative verification), or beside other
//! sequences' rows in a batch step (the batched engine's decode and mixed
//! plans). Speculative decoding promises output identical to plain decoding,
//! and the engine promises each request the text it gets alone, on this.
//!
//! Kernel level, compiled by LLVM for this machine and for x86-64-v3 and by
//! Cranelift: attention in its four forms (single-stream decode's split
//! attention and merge, single-stream prefill's whole attention, the batch
//! decode plan's split paged attention, the mixed plan's whole paged
//! attention) at positions on either side of every chunk boundary, with
//! grouped heads, windows, soft-capping and half caches; and the float panel
//! matmuls (float32, bfloat16, float16 and float8 weights) at one row against
//! steps of 2, 7 and 33 rows, and the experts' grouped panel matmul at one
//! row against groups of 2, 7 and 33. The integer matmuls' and bfloat16 pair dots'
//! cases are in kernels_llvm.rs (`integer_rows_alone_and_in_a_batch_give_the_same_bits`);
//! the grouped interleaved matmul is the dense one's tiles (bit for bit in the
//! interpreter, `kernels/src/library/moe.rs`), compiled here through the q8_0
//! mixture-of-experts artifacts.

use maxc_codegen::{llvm::compile_shared, CpuTarget};
use maxc_kernels::interp::{run, Buffer};
use maxc_kernels::ir::{ElemType, Kernel};
use maxc_kernels::library::attention::{attention, attention_combine, attention_paged, attention_partial, kv_store, kv_store_paged, AttentionShape, KeyLayout, Paging, DECODE_SPLITS};
use maxc_kernels::library::elementwise::Broadcast;
use maxc_kernels::library::matmul_panel::{matmul_panel, PanelWeights};
use maxc_kernels::library::moe::moe_matmul_panel;
use maxc_kernels::library::{RegisterTile, SeqMode};
use maxc_tests::kernel_check::{inputs, Case, Rng};
use maxrun_runtime::code::LoadedCode;

/// A backend: its name, the register tile its matmuls take, and how it compiles.
type Backend = (&'static str, RegisterTile, Box<dyn Fn(&[Kernel]) -> Vec<u8>>);

/// LLVM for this machine and for x86-64-v3, and Cranelift.
fn backends() -> Vec<Backend> {
    let mut all: Vec<Backend> = vec![
        ("llvm cpu", RegisterTile::for_cpu(CpuTarget::host().has_avx512()), Box::new(|k: &[Kernel]| compile_shared(k, &CpuTarget::host()).unwrap().shared_object)),
        ("llvm x86-64-v3", RegisterTile::YMM, Box::new(|k: &[Kernel]| compile_shared(k, &CpuTarget::parse("cpu:x86-64-v3").unwrap()).unwrap().shared_object)),
        ("cranelift", RegisterTile::for_cpu(false), Box::new(|k: &[Kernel]| maxc_codegen::cranelift::compile_shared(k).unwrap().shared_object)),
    ];
    if let Ok(only) = std::env::var("ONLY") { all.retain(|b| b.0 == only); }
    all
}

/// Runs compiled `kernel` over `rows` rows of `bufs`.
fn call(code: &LoadedCode, kernel: &Kernel, bufs: &mut [Buffer], rows: u64) {
    let f = code.kernel(&kernel.name).unwrap();
    let ptrs: Vec<*mut u8> = bufs.iter_mut().map(Buffer::as_mut_ptr).collect();
    let dims = [rows as i64, rows as i64];
    // SAFETY: every buffer is sized for `rows` rows of this kernel's shapes.
    unsafe { f(ptrs.as_ptr(), dims.as_ptr(), 0, kernel.tasks.eval(rows)) };
}

fn bits(b: &Buffer) -> Vec<u32> {
    match b {
        Buffer::F32(x) => x.iter().map(|v| v.to_bits()).collect(),
        _ => unreachable!("f32 outputs"),
    }
}

fn random(n: usize, rng: &mut Rng, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.f() * scale).collect()
}

/// Query positions on either side of the chunk boundaries: one chunk up to
/// 32 visible positions, then 2, 3, 4, 8, 16 chunks of uneven lengths.
const POSITIONS: [usize; 13] = [0, 15, 16, 31, 32, 33, 63, 100, 257, 480, 511, 512, 1000];

/// Attention of every row of `POSITIONS` for one sequence four ways, each
/// compared bit for bit with single-stream decode (split attention over the
/// contiguous cache, then the merge, one row):
/// - single-stream prefill: whole attention over the contiguous cache, all
///   the rows in one launch;
/// - the batch decode plan: split paged attention and the merge, the row
///   among 1, 6 and 32 rows of other sequences;
/// - the mixed plan: whole paged attention, the rows as one sequence's chunk
///   beside 1, 6 and 32 rows of other sequences.
#[test]
fn attention_rows_get_the_same_bits_in_every_plan() {
    let max_len = 1024u64;
    let paging = Paging { block_size: 16, blocks_per_seq: max_len / 16 };
    // SmolLM2's heads with a half cache; four heads per KV head of 128 with a
    // window and soft-capping.
    let shapes = [
        AttentionShape { heads: 9, kv_heads: 3, head_dim: 64, scale: 0.125, window: None, max_len, softcap: None, causal: true, cache: ElemType::F16, keys: KeyLayout::Panels, sinks: false },
        AttentionShape { heads: 8, kv_heads: 2, head_dim: 128, scale: 0.088, window: Some(300), max_len, softcap: Some(30.0), causal: true, cache: ElemType::F32, keys: KeyLayout::Panels, sinks: false },
        AttentionShape { heads: 4, kv_heads: 2, head_dim: 16, scale: 0.25, window: None, max_len, softcap: None, causal: true, cache: ElemType::F32, keys: KeyLayout::Panels, sinks: false },
        // gpt-oss: sinks, with a window and without.
        AttentionShape { heads: 8, kv_heads: 2, head_dim: 64, scale: 0.125, window: Some(128), max_len, softcap: None, causal: true, cache: ElemType::F32, keys: KeyLayout::Panels, sinks: true },
        AttentionShape { heads: 8, kv_heads: 2, head_dim: 64, scale: 0.125, window: None, max_len, softcap: None, causal: true, cache: ElemType::F32, keys: KeyLayout::Panels, sinks: true },
    ];
    for (backend, _, compile) in backends() {
        for shape in shapes {
            let splits = DECODE_SPLITS;
            let decode = (attention_partial(shape, splits, SeqMode::Fixed(1)), attention_combine(shape, splits, SeqMode::Fixed(1)));
            let prefill = attention(shape, SeqMode::Dynamic);
            let batch_decode = (attention_paged(shape, paging, Some(splits)), attention_combine(shape, splits, SeqMode::Dynamic));
            let mixed = attention_paged(shape, paging, None);
            let kernels = [decode.0.clone(), decode.1.clone(), prefill.clone(), batch_decode.0.clone(), batch_decode.1.clone(), mixed.clone()];
            let code = LoadedCode::load(&compile(&kernels)).unwrap();
            let (qw, kvw) = ((shape.heads * shape.head_dim) as usize, (shape.kv_heads * shape.head_dim) as usize);
            let len = max_len as usize;
            let mut rng = Rng(0xa77e_0001 + shape.head_dim);
            // One sequence's keys and values at every position, in both caches:
            // contiguous, and paged in scattered blocks of a pool that also holds
            // 32 other sequences' (random) blocks.
            let (k, v) = (random(len * kvw, &mut rng, 2.0), random(len * kvw, &mut rng, 1.0));
            let cache = |n: usize| if shape.cache == ElemType::F16 { Buffer::F16(vec![0; n]) } else { Buffer::F32(vec![0.0; n]) };
            let mut bufs = vec![Buffer::F32(k.clone()), Buffer::F32(v.clone()), Buffer::I32((0..len as i32).collect()), cache(len * kvw), cache(len * kvw)];
            run(&kv_store(shape.kv_heads, shape.head_dim, max_len, shape.cache, shape.keys, SeqMode::Dynamic), &mut bufs, len as u64);
            let (kc, vc) = (bufs[3].clone(), bufs[4].clone());
            let others = 32usize;
            let per_seq = paging.blocks_per_seq as usize;
            let pool = (others + 1) * per_seq;
            let mut order: Vec<i32> = (0..pool as i32).collect();
            for i in (1..pool).rev() {
                order.swap(i, (rng.0 as usize >> 7) % (i + 1));
                rng.f();
            }
            let tables: Vec<i32> = order.clone();
            let slots: Vec<i32> = (0..len).map(|p| tables[p / 16] * 16 + (p % 16) as i32).collect();
            let block = paging.block_elems(shape.kv_heads, shape.head_dim) as usize;
            let noise = |rng: &mut Rng| match shape.cache {
                ElemType::F16 => Buffer::F16((0..pool * block).map(|_| ::half::f16::from_f32(rng.f()).to_bits()).collect()),
                _ => Buffer::F32(random(pool * block, rng, 1.0)),
            };
            let (pk, pv) = (noise(&mut rng), noise(&mut rng));
            let mut bufs = vec![Buffer::F32(k), Buffer::F32(v), Buffer::I32(slots), pk, pv];
            run(&kv_store_paged(shape.kv_heads, shape.head_dim, paging, shape.cache, shape.keys), &mut bufs, len as u64);
            let (pk, pv) = (bufs[3].clone(), bufs[4].clone());
            let q = random(POSITIONS.len() * qw, &mut rng, 1.0);
            let row = |r: usize| q[r * qw..(r + 1) * qw].to_vec();
            // Whole attention and the merge take the sinks before their scratch
            // and output.
            let sinks: Vec<Buffer> = if shape.sinks { vec![Buffer::F32(random(shape.heads as usize, &mut rng, 3.0))] } else { vec![] };
            let with_sinks = |mut b: Vec<Buffer>, at: usize| {
                for (i, s) in sinks.iter().enumerate() {
                    b.insert(at + i, s.clone());
                }
                b
            };

            // Single-stream decode, one row at a time: the reference.
            let alone: Vec<Vec<u32>> = (0..POSITIONS.len())
                .map(|r| {
                    let scratch = Buffer::F32(vec![f32::NAN; shape.split_scratch_per_token(splits) as usize]);
                    let partials = Buffer::F32(vec![f32::NAN; shape.partials_per_token(splits) as usize]);
                    let pos = Buffer::I32(vec![POSITIONS[r] as i32]);
                    let mut b = vec![Buffer::F32(row(r)), pos.clone(), kc.clone(), vc.clone(), scratch, partials];
                    call(&code, &decode.0, &mut b, 1);
                    let mut m = with_sinks(vec![b.swap_remove(5), pos, Buffer::F32(vec![f32::NAN; qw])], 2);
                    call(&code, &decode.1, &mut m, 1);
                    bits(m.last().unwrap())
                })
                .collect();
            let check = |what: &str, out: &[u32], row_of: &dyn Fn(usize) -> usize| {
                for (r, want) in alone.iter().enumerate() {
                    let at = row_of(r) * qw;
                    let differ = (0..qw).filter(|&e| out[at + e] != want[e]).count();
                    assert_eq!(differ, 0, "{backend}, {}: position {} in {what} differs from single-stream decode in {differ} of {qw} outputs", prefill.name, POSITIONS[r]);
                }
            };

            // Single-stream prefill: every row in one launch.
            let n = POSITIONS.len();
            let pos = Buffer::I32(POSITIONS.iter().map(|&p| p as i32).collect());
            let scratch = Buffer::F32(vec![f32::NAN; n * (shape.kv_heads * shape.scratch_per_task()) as usize]);
            let mut b = with_sinks(vec![Buffer::F32(q.clone()), pos, kc.clone(), vc.clone(), scratch, Buffer::F32(vec![f32::NAN; n * qw])], 4);
            call(&code, &prefill, &mut b, n as u64);
            check("single-stream prefill", &bits(b.last().unwrap()), &|r| r);

            // Batch steps: this sequence's rows after `before` rows of other
            // sequences (sequence s + 1 holds table row s + 1, random blocks).
            for before in [1usize, 6, 32] {
                let rows = before + n;
                let mut seqs: Vec<i32> = (1..=before as i32).collect();
                seqs.extend(std::iter::repeat_n(0, n));
                let mut pos: Vec<i32> = (0..before).map(|i| (37 * i % len) as i32).collect();
                pos.extend(POSITIONS.iter().map(|&p| p as i32));
                let mut qs = random(before * qw, &mut rng, 1.0);
                qs.extend_from_slice(&q);
                let pos = Buffer::I32(pos);
                let paged = |scratch: usize, out: usize| {
                    vec![Buffer::F32(qs.clone()), pos.clone(), Buffer::I32(seqs.clone()), Buffer::I32(tables.clone()), pk.clone(), pv.clone(), Buffer::F32(vec![f32::NAN; scratch]), Buffer::F32(vec![f32::NAN; out])]
                };
                let mut b = paged(rows * shape.split_scratch_per_token(splits) as usize, rows * shape.partials_per_token(splits) as usize);
                call(&code, &batch_decode.0, &mut b, rows as u64);
                let mut m = with_sinks(vec![b.swap_remove(7), pos.clone(), Buffer::F32(vec![f32::NAN; rows * qw])], 2);
                call(&code, &batch_decode.1, &mut m, rows as u64);
                check(&format!("the batch decode plan after {before} rows"), &bits(m.last().unwrap()), &|r| before + r);
                let mut b = with_sinks(paged(rows * (shape.kv_heads * shape.scratch_per_task()) as usize, rows * qw), 6);
                call(&code, &mixed, &mut b, rows as u64);
                check(&format!("the mixed plan after {before} rows"), &bits(b.last().unwrap()), &|r| before + r);
            }
        }
    }
}

/// Float panel matmuls (float32, bfloat16, float16 weights and float8 codes
/// with their scales; float32 activations), without and with a residual:
/// each of 33 rows alone through the one-row kernel (single-stream decode)
/// against the same rows in steps of 2, 7 and 33 (the few-rows path and the
/// prefill tiles).
#[test]
fn float_panel_rows_get_the_same_bits_alone_and_in_a_batch() {
    const ROWS: usize = 33;
    let (k, n) = (256usize, 48usize);
    for (backend, tile, compile) in backends() {
        for weights in [PanelWeights::Float(ElemType::F32), PanelWeights::Float(ElemType::BF16), PanelWeights::Float(ElemType::F16), PanelWeights::Float8E4M3] {
            for addend in [None, Some(Broadcast::None)] {
                let alone = matmul_panel(k as u64, n as u64, weights, addend, SeqMode::Fixed(1), tile);
                let batch = matmul_panel(k as u64, n as u64, weights, addend, SeqMode::Dynamic, tile);
                let code = LoadedCode::load(&compile(&[alone.clone(), batch.clone()])).unwrap();
                let mut rng = Rng(0xf10a_7000);
                let mut sizes: Vec<usize> = batch.params.iter().map(|_| 0).collect();
                sizes[0] = ROWS * k;
                sizes[1] = n * k;
                if weights == PanelWeights::Float8E4M3 {
                    sizes[2] = n;
                }
                let last = sizes.len() - 1;
                sizes[last] = ROWS * n;
                if addend.is_some() {
                    sizes[last - 1] = ROWS * n;
                }
                let case = Case { kernel: batch.clone(), sizes, int_max: 1, seq: ROWS as u64, tol: 0.0 };
                let bufs = inputs(&case, &mut rng);
                let run_rows = |kernel: &Kernel, from: usize, rows: usize| -> Vec<u32> {
                    let mut b = bufs.clone();
                    let slice = |buf: &Buffer, width: usize| match buf {
                        Buffer::F32(x) => Buffer::F32(x[from * width..(from + rows) * width].to_vec()),
                        _ => unreachable!("f32 activations and addends"),
                    };
                    b[0] = slice(&bufs[0], k);
                    if addend.is_some() {
                        b[last - 1] = slice(&bufs[last - 1], n);
                    }
                    b[last] = Buffer::F32(vec![f32::NAN; rows * n]);
                    call(&code, kernel, &mut b, rows as u64);
                    bits(&b[last])
                };
                let one: Vec<Vec<u32>> = (0..ROWS).map(|r| run_rows(&alone, r, 1)).collect();
                for rows in [2usize, 7, 33] {
                    for from in [0, ROWS - rows] {
                        let got = run_rows(&batch, from, rows);
                        for r in 0..rows {
                            let differ = (0..n).filter(|&j| got[r * n + j] != one[from + r][j]).count();
                            assert_eq!(differ, 0, "{backend}: row {} in a step of {rows} through {} differs from {} alone in {differ} of {n} outputs", from + r, batch.name, alone.name);
                        }
                    }
                }
            }
        }
    }
}

/// The rows of one batch step, built up sequence by sequence.
#[derive(Default)]
struct Step {
    tokens: Vec<i32>,
    positions: Vec<i32>,
    slots: Vec<i32>,
    row_sequences: Vec<i32>,
    tables: Vec<i32>,
    logit_rows: Vec<i32>,
}

impl Step {
    /// `tokens` of a sequence whose block table is `table`, from `position`;
    /// the logits of `logits` of them (indices into `tokens`) come back.
    fn add(&mut self, table: &[i32], block_size: usize, position: usize, tokens: &[u32], logits: impl IntoIterator<Item = usize>) {
        let s = (self.tables.len() / table.len()) as i32;
        let first = self.tokens.len() as i32;
        self.tables.extend_from_slice(table);
        for (i, &t) in tokens.iter().enumerate() {
            let p = position + i;
            self.tokens.push(t as i32);
            self.positions.push(p as i32);
            self.slots.push(table[p / block_size] * block_size as i32 + (p % block_size) as i32);
            self.row_sequences.push(s);
        }
        self.logit_rows.extend(logits.into_iter().map(|i| first + i as i32));
    }

    /// Runs the step (the decode plans where `decode_only`) and returns its logits.
    fn run(&self, executor: &mut dyn maxrun_runtime::executor::Executor, decode_only: bool) -> Vec<f32> {
        let step = maxrun_runtime::executor::BatchStep {
            tokens: &self.tokens,
            positions: &self.positions,
            slots: &self.slots,
            row_sequences: &self.row_sequences,
            adapters: &[],
            block_tables: &self.tables,
            logit_rows: &self.logit_rows,
            decode_only,
        };
        executor.step(&step).unwrap().to_vec()
    }
}

fn argmax(x: &[f32]) -> u32 {
    x.iter().enumerate().fold((0, f32::MIN), |m, (i, &v)| if v > m.1 { (i, v) } else { m }).0 as u32
}

/// One artifact's plans against each other: a prompt of more than 32 tokens
/// and its greedy continuation through the single-stream plans (prefill, then
/// decode token by token) give the reference logits; then, through the CPU
/// executor's batch plans, bit for bit the same logits:
/// - the sequence alone: its prompt in one mixed step, each token a step of
///   one row (the single plan);
/// - among 1, 6 and 32 other sequences (steps of 2, 7 and 33 decode rows):
///   its prompt beside other prompts' chunks,
///   then each token a row of the decode plan beside theirs, every other step
///   a mixed step beside a new prompt's chunk;
/// - verified: its tokens 5 at a time as rows of one mixed step (speculative
///   verification of 4 drafted tokens), all 5 rows' logits, beside another
///   sequence's chunk.
fn check_plans(what: &str, mef: &std::path::Path, prompt: &[u32], generated: usize) {
    let a = maxrun_runtime::artifact::Artifact::open(mef).unwrap();
    let vocab = a.header.model.vocab_size as usize;
    let mut session = maxrun_runtime::session::Session::new(&a, 2).unwrap();
    let mut want = vec![session.forward_last(prompt).unwrap().to_vec()];
    let mut tokens = Vec::new();
    for _ in 0..generated {
        let t = argmax(want.last().unwrap());
        tokens.push(t);
        want.push(session.forward_last(&[t]).unwrap().to_vec());
    }
    let limits = maxrun_runtime::executor::batch_limits(&a).unwrap();
    let (bs, per_seq) = (limits.block_size as usize, limits.blocks_per_sequence as usize);
    assert!(limits.max_sequences >= 34, "{what}: compile with --max-sequences 40");
    // Our sequence's blocks scattered over the first per_seq blocks; each
    // other sequence one block of its own (its positions overwrite each other
    // there, which changes nothing of ours).
    let ours: Vec<i32> = (0..per_seq as i32).map(|b| (b * 7 + 3) % per_seq as i32).collect();
    let other = |j: usize| vec![(per_seq + j) as i32; per_seq];
    let blocks = per_seq as u64 + 40;
    let kv_bytes = blocks * maxrun_runtime::executor::block_bytes_all_layers(&a.header, &limits);
    let open = || maxrun_runtime::executor::cpu::CpuExecutor::new(&a, 2, Some(kv_bytes)).unwrap();
    let same = |how: &str, got: &[f32], i: usize| {
        let differ = got.iter().zip(&want[i]).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        assert_eq!(differ, 0, "{what}: the logits of token {i} {how} differ from single-stream decode's in {differ} of {vocab}");
    };
    let n = prompt.len();
    let mut rng = Rng(0x5eed_0065);
    let mut noise = |len: usize| -> Vec<u32> { (0..len).map(|_| ((rng.f() + 1.0) * 0.5 * (vocab - 1) as f32) as u32).collect() };

    // Alone.
    let mut e = open();
    let mut s = Step::default();
    s.add(&ours, bs, 0, prompt, [n - 1]);
    same("alone, prompt in a mixed step", &s.run(&mut e, false), 0);
    for i in 0..generated {
        let mut s = Step::default();
        s.add(&ours, bs, n + i, &tokens[i..=i], [0]);
        same("alone, decoded", &s.run(&mut e, true), i + 1);
    }

    // Among others.
    for others in [1usize, 6, 32] {
        let mut e = open();
        let mut s = Step::default();
        for j in 0..3 {
            s.add(&other(j), bs, 0, &noise(5 + 3 * j), [4]);
        }
        s.add(&ours, bs, 0, prompt, [n - 1]);
        let got = s.run(&mut e, false);
        same(&format!("beside {others} others, prompt"), &got[3 * vocab..4 * vocab], 0);
        for i in 0..generated {
            let mut s = Step::default();
            let mixed = i % 2 == 1;
            let before = (i * 5) % (others + 1);
            for j in 0..others {
                if j == before {
                    s.add(&ours, bs, n + i, &tokens[i..=i], [0]);
                }
                s.add(&other(j), bs, (3 * j + i) % 90, &noise(1), [0]);
            }
            if before == others {
                s.add(&ours, bs, n + i, &tokens[i..=i], [0]);
            }
            if mixed {
                s.add(&other(39), bs, 0, &noise(12), [11]);
            }
            let got = s.run(&mut e, !mixed);
            same(&format!("beside {others} others ({} plan)", if mixed { "mixed" } else { "decode" }), &got[before * vocab..(before + 1) * vocab], i + 1);
        }
    }

    // Verified 5 at a time.
    let mut e = open();
    let mut s = Step::default();
    s.add(&ours, bs, 0, prompt, [n - 1]);
    s.run(&mut e, false);
    let mut i = 0;
    while i + 5 <= generated {
        let mut s = Step::default();
        s.add(&other(0), bs, 0, &noise(9), [8]);
        s.add(&ours, bs, n + i, &tokens[i..i + 5], 0..5);
        let got = s.run(&mut e, false);
        for r in 0..5 {
            same("verified in a row of five", &got[(1 + r) * vocab..(2 + r) * vocab], i + r + 1);
        }
        i += 5;
    }
}

/// SmolLM2-135M (30 layers, the README's model) as the README compiles it
/// (q4_1 blocks with int16 activations), and with float32, bfloat16 and q8_0
/// weights; the README artifact also for AVX2 (x86-64-v3 code).
#[test]
fn smollm2_gives_a_row_the_same_logits_in_every_plan() {
    let prompt = long_prompt("smollm2-135m");
    let manifest = maxc_tests::workspace_root().join("manifests/smollm2-135m.toml");
    let base = ["--max-sequences", "40", "--model-override", "transformer.max_length=256"];
    for (what, extra) in [
        ("q4_1 (the README's)", vec![]),
        ("float32", vec!["--quantization-encoding", "float32"]),
        ("bfloat16", vec!["--quantization-encoding", "bfloat16"]),
        ("q8_0", vec!["--quantization-encoding", "q8_0"]),
        ("q4_1 for x86-64-v3", vec!["--target", "cpu:x86-64-v3"]),
    ] {
        let out = maxc_tests::temp_file("invariance-smollm2", "m.mef");
        let mut args: Vec<&std::ffi::OsStr> = vec!["compile".as_ref(), manifest.as_os_str(), "-o".as_ref(), out.as_os_str()];
        args.extend(base.iter().chain(&extra).map(|a| std::ffi::OsStr::new(*a)));
        let (code, _, err) = maxc_tests::run_bin("maxc", &args);
        assert_eq!(code, 0, "{what}: {err}");
        check_plans(&format!("SmolLM2 {what}"), &out, &prompt, 20);
    }
}

/// A prompt of 45 tokens: a fixture's golden prompts one after another.
fn long_prompt(fixture_name: &str) -> Vec<u32> {
    let g = maxc_tests::golden(fixture_name);
    let all: Vec<u32> = maxc_tests::cases(&g).iter().flat_map(|c| maxc_tests::ids(&c["input_ids"])).collect();
    all.iter().cycle().take(45).copied().collect()
}

/// tiny-llama (2 layers, grouped heads) at every weight encoding, with the
/// default activations, and for block encodings with int8 ones (bfloat16 with
/// bfloat16 pair dots), in code for this machine; bfloat16 and q4_k in code
/// for AVX2 and float32 and q4_1 through Cranelift: every plan gives every
/// row the same logits.
#[test]
fn every_encoding_gives_a_row_the_same_logits_in_every_plan() {
    let model = maxc_tests::fixture("tiny-llama");
    let prompt = long_prompt("tiny-llama");
    for encoding in ["float32", "bfloat16", "float16", "float8_e4m3fn", "q8_0", "q4_0", "q4_1", "q4_k", "q5_0", "q5_1", "q5_k", "q6_k"] {
        let other = match encoding {
            "bfloat16" => Some("bfloat16"),
            "float32" | "float16" | "float8_e4m3fn" => None,
            _ => Some("int8"),
        };
        for activations in std::iter::once(None).chain(other.map(Some)) {
            let mut flags = vec!["--quantization-encoding", encoding, "--max-sequences", "40"];
            if let Some(act) = activations {
                flags.extend(["--activation-encoding", act]);
            }
            let mef = maxc_tests::compile_model(&format!("invariance-{encoding}"), &model, &flags);
            check_plans(&format!("tiny-llama {encoding}, {} activations", activations.unwrap_or("default")), &mef, &prompt, 30);
        }
    }
    // Code for AVX2 (its own tiles and dot instructions), and Cranelift's.
    for (encoding, code) in [("bfloat16", ["--target", "cpu:x86-64-v3"]), ("q4_k", ["--target", "cpu:x86-64-v3"]), ("float32", ["--backend", "cranelift"]), ("q4_1", ["--backend", "cranelift"])] {
        let flags = ["--quantization-encoding", encoding, "--max-sequences", "40", code[0], code[1]];
        let mef = maxc_tests::compile_model(&format!("invariance-{encoding}-{}", code[1]), &model, &flags);
        check_plans(&format!("tiny-llama {encoding}, {}", code[1]), &mef, &prompt, 30);
    }
}

/// The mixture-of-experts fixtures (Qwen3-MoE: 8 experts, top 2, a dense
/// first layer; Mixtral: 4 experts, top 2; gpt-oss: 4 experts, top 2, with
/// biases, sinks and a sliding window), float32 and q8_0 (int16
/// activations), and float32 in code for AVX2: a row's experts, their
/// grouped matmuls (whichever tile its expert's group of rows takes) and the
/// weighted sum in rank order give every row the same logits in every plan.
#[test]
fn mixture_of_experts_give_a_row_the_same_logits_in_every_plan() {
    for name in ["arch-qwen3-moe", "arch-mixtral", "arch-gpt-oss"] {
        let model = maxc_tests::fixture(name);
        let prompt = long_prompt(name);
        for (encoding, extra) in [("float32", None), ("q8_0", None), ("float32", Some(["--target", "cpu:x86-64-v3"]))] {
            let mut flags = vec!["--quantization-encoding", encoding, "--max-sequences", "40"];
            flags.extend(extra.iter().flatten());
            let mef = maxc_tests::compile_model(&format!("invariance-{name}-{encoding}"), &model, &flags);
            check_plans(&format!("{name} {encoding} {}", extra.map_or("", |e| e[1])), &mef, &prompt, 30);
        }
    }
}

/// The grouped panel matmul of the experts (float32 weights): each of 33 rows
/// alone through the decode kernel (its expert's group of one row) against
/// the same rows as one group of 2, 7 and 33 rows (the few-rows path and the
/// prefill tiles) after other experts' groups, for every expert, at the
/// fixtures' shapes (gate-and-up k 64, n 64; down k 32): bit for bit.
#[test]
fn grouped_expert_rows_get_the_same_bits_alone_and_in_a_batch() {
    const ROWS: usize = 33;
    let experts = 3usize;
    for (k, n) in [(32usize, 64usize), (64, 64), (64, 48)] {
        for (backend, tile, compile) in backends() {
            let weights = PanelWeights::Float(ElemType::F32);
            let alone = moe_matmul_panel(k as u64, n as u64, experts as u64, weights, SeqMode::Fixed(1), tile);
            let batch = moe_matmul_panel(k as u64, n as u64, experts as u64, weights, SeqMode::Dynamic, tile);
            let code = LoadedCode::load(&compile(&[alone.clone(), batch.clone()])).unwrap();
            let mut rng = Rng(0xf10a_7000);
            let x = random(ROWS * k, &mut rng, 1.0);
            let w = random(experts * n * k, &mut rng, 1.0);
            // Rows `from..from + rows` as expert `e`'s group, after `before` rows of expert 0's (none for expert 0).
            let run = |kernel: &Kernel, from: usize, rows: usize, e: usize| -> Vec<u32> {
                let before = if e == 0 { 0 } else { 3 };
                let mut offsets = vec![0i32; experts + 1];
                for (i, o) in offsets.iter_mut().enumerate().skip(1) {
                    *o = if i <= e { before as i32 } else { (before + rows) as i32 };
                }
                let mut xs = x[..before * k].to_vec();
                xs.extend_from_slice(&x[from * k..(from + rows) * k]);
                let mut b = vec![Buffer::F32(xs), Buffer::I32(offsets), Buffer::F32(w.clone()), Buffer::F32(vec![f32::NAN; (before + rows) * n])];
                call(&code, kernel, &mut b, (before + rows) as u64);
                bits(&b[3])[before * n..].to_vec()
            };
            for e in 0..experts {
                let one: Vec<Vec<u32>> = (0..ROWS).map(|r| run(&alone, r, 1, e)).collect();
                for rows in [1usize, 2, 7, 33] {
                    let got = run(&batch, 0, rows, e);
                    for r in 0..rows {
                        let differ = (0..n).filter(|&j| got[r * n + j] != one[r][j]).count();
                        assert_eq!(differ, 0, "{backend} k{k} n{n}: expert {e} row {r} of {rows} differs in {differ}");
                    }
                }
            }
        }
    }
}

/// An artifact whose single-stream cache cannot hold key panels (a maximum
/// length that is not a multiple of 16) is compiled with a note saying that
/// its serial and batched runs agree within rounding only; a multiple of 16
/// gets no such note.
#[test]
fn a_maximum_length_off_the_key_panels_is_noted() {
    let model = maxc_tests::fixture("tiny-llama");
    for (length, noted) in [(40, true), (48, false)] {
        let out = maxc_tests::temp_file("invariance-length", "m.mef");
        let args: Vec<std::ffi::OsString> = ["compile", "--model"].map(Into::into).into_iter().chain([model.clone().into_os_string(), "-o".into(), out.as_os_str().into(), "--model-override".into(), format!("transformer.max_length={length}").into()]).collect();
        let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
        let (code, _, err) = maxc_tests::run_bin("maxc", &args);
        assert_eq!(code, 0, "{err}");
        assert_eq!(err.contains("is not a multiple of 16") && err.contains("Batch invariance"), noted, "max_length {length}: {err}");
    }
}
