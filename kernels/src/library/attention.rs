//! Attention over the KV cache. `kv_store` writes this step's keys and values at
//! their positions; `attention` then runs causal (optionally sliding-window)
//! attention for one (token, KV head) per task, covering the query heads that
//! share that KV head.
//!
//! Both caches are laid out `[kv_heads, max_len, head_dim]`: one KV head's keys
//! (and values) for every position are one contiguous run, so a task streams two
//! runs of `positions * head_dim` floats, and a decode step's store is one
//! contiguous head row per KV head in each cache (`2 * kv_heads * head_dim`
//! floats on adjacent cache lines). With [`KeyLayout::Rows`] (the GPU forms) a
//! score is a dot product over the head dimension (a vector reduction per key
//! position, then a horizontal sum). With [`KeyLayout::Panels`] (CPU code) each
//! run of 16 positions of the key cache is stored transposed, `[head_dim][16]`,
//! so 16 scores are one register tile: per element of the head dimension, one
//! vector of 16 keys times each query head's element broadcast, no horizontal
//! sums (the value cache stays in rows). The weighted sum of values is
//! vectorized over the head dimension. Scores live in a scratch row per query
//! head of the task.
//!
//! Decode has one token, so one task per KV head leaves threads idle (SmolLM2: 3
//! tasks). `attention_partial` splits each KV head's positions into chunks, one
//! task each, writing every query head's unnormalized output with the chunk's
//! max and sum of exponentials, and `attention_combine` merges the chunks
//! (flash-decoding).

use super::SeqMode;
use crate::ir::dsl::*;
use crate::ir::*;

/// Shape attributes of one attention layer.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct AttentionShape {
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub scale: f32,
    pub window: Option<u64>,
    /// Positions in the cache (the artifact's maximum length).
    pub max_len: u64,
    /// Scores become `tanh(score / c) * c` (Gemma 2's attention logit soft-capping).
    pub softcap: Option<f32>,
    /// `false` for encoders: every token sees every token of the step.
    pub causal: bool,
    /// The KV cache's element type: `F32`, or `F16` (`--kv-cache-encoding
    /// float16`: stores round to nearest even, loads widen).
    pub cache: ElemType,
    /// How the key cache holds a KV head's positions.
    pub keys: KeyLayout,
    /// A learned logit per query head that joins the softmax's denominator and
    /// attends to nothing (gpt-oss's attention sinks): `out = sum_j e^(s_j - M)
    /// v_j / (e^(z - M) + sum_j e^(s_j - M))`. Whole attention and the combine
    /// take a `sinks: f32[heads]` parameter; split attention's chunks do not
    /// (the combine adds the sink once).
    pub sinks: bool,
}

/// How the key cache holds a KV head's positions (the value cache always holds
/// rows).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum KeyLayout {
    /// `[positions, head_dim]`: each key one contiguous row.
    Rows,
    /// `[positions / 16, head_dim, 16]`: each run of [`KEY_PANEL`] positions
    /// (aligned) transposed, so that one vector load holds element `d` of 16
    /// keys. Needs the cache's length (or a paged cache's block size) to be a
    /// multiple of [`KEY_PANEL`].
    Panels,
}

/// Positions per key panel ([`KeyLayout::Panels`]): one zmm of f32 scores.
pub const KEY_PANEL: u64 = 16;

/// Accumulators per query head of a panel's scores: enough that the group's
/// heads keep about eight multiply-add chains going, at most eight, a divisor
/// of `head_dim`.
fn panel_score_ways(group: u64, head_dim: u64) -> u64 {
    let want = 8u64.div_ceil(group).min(8);
    (1..=want).rev().find(|w| head_dim.is_multiple_of(*w)).unwrap_or(1)
}

impl KeyLayout {
    /// The layout of CPU code for a cache of runs of `run` positions (its
    /// length, or a paged cache's block size): panels where whole panels fit.
    pub fn for_cpu(run: u64) -> KeyLayout {
        if run.is_multiple_of(KEY_PANEL) {
            KeyLayout::Panels
        } else {
            KeyLayout::Rows
        }
    }

    /// The kernel-name suffix: none for rows.
    fn tag(self) -> &'static str {
        match self {
            KeyLayout::Rows => "",
            KeyLayout::Panels => "_kp16",
        }
    }

    /// Where element `d` of the key at position `p` lives, given `run(p0)`: where
    /// element 0 of position `p0` lives in the rows layout.
    fn element(self, run: impl Fn(Expr) -> Expr, p: Expr, d: Expr) -> Expr {
        match self {
            KeyLayout::Rows => add(run(p), d),
            KeyLayout::Panels => {
                let lane = rem(p.clone(), i(KEY_PANEL as i64));
                add(add(mul(d, i(KEY_PANEL as i64)), lane.clone()), run(sub(p, lane)))
            }
        }
    }
}

impl AttentionShape {
    fn tag(&self) -> String {
        let w = self.window.map_or("full".to_string(), |w| format!("w{w}"));
        let cap = self.softcap.map_or(String::new(), |c| format!("_c{:08x}", c.to_bits()));
        let cap = if self.causal { cap } else { format!("{cap}_bidi") };
        let sinks = if self.sinks { "_sk" } else { "" };
        format!("h{}_kv{}_d{}_s{:08x}_{w}_l{}{cap}{sinks}{}{}", self.heads, self.kv_heads, self.head_dim, self.scale.to_bits(), self.max_len, cache_tag(self.cache), self.keys.tag())
    }

    /// Scratch floats per task of unsplit attention: a score row for each
    /// query head of the group.
    pub fn scratch_per_task(&self) -> u64 {
        self.heads / self.kv_heads * self.score_row(None)
    }

    /// Floats of a task's local array in causal unsplit CPU attention: a partial row
    /// per query head and chunk (it computes the decode plans'
    /// [`DECODE_SPLITS`] chunks one after another and merges them as
    /// [`attention_combine`] does: docs/serving.md, Batch invariance).
    pub fn parts_per_task(&self) -> u64 {
        DECODE_SPLITS * self.heads / self.kv_heads * partial_row(self.head_dim)
    }

    /// Floats of one query head's score row: the positions a task scores, and
    /// with key panels the panels' positions around them (a task scores whole
    /// panels, from the one holding its first position to the one holding its
    /// last: at most `2 * (KEY_PANEL - 1)` more).
    fn score_row(&self, splits: Option<u64>) -> u64 {
        let slack = match self.keys {
            KeyLayout::Rows => 0,
            KeyLayout::Panels => 2 * KEY_PANEL,
        };
        self.scored_positions(splits) + slack
    }
}

/// The kernel-name suffix of a KV cache element type (none for f32).
fn cache_tag(cache: ElemType) -> &'static str {
    match cache {
        ElemType::F16 => "_f16",
        _ => "",
    }
}

/// Where element `d` of KV head `h` at position `p` lives in a cache laid out
/// `[kv_heads, max_len, head_dim]`.
fn cache_index(h: Expr, p: Expr, d: Expr, head_dim: i64, max_len: i64) -> Expr {
    add(mul(add(mul(h, i(max_len)), p), i(head_dim)), d)
}

/// `k, v: f32[seq, kv_heads*hd]`, `pos: i32[seq]` -> `k_cache`, `v_cache`, both
/// `[kv_heads, max_len, head_dim]`, the keys as `keys` lays them out (the
/// runtime checks positions < max_len). One task per token: it writes one
/// contiguous head row per KV head in each cache (with key panels, the key's
/// elements 16 apart in its panel).
pub fn kv_store(kv_heads: u64, head_dim: u64, max_len: u64, cache: ElemType, keys: KeyLayout, seq: SeqMode) -> Kernel {
    assert!(matches!(cache, ElemType::F32 | ElemType::F16), "a KV cache of {cache:?}");
    assert!(keys == KeyLayout::Rows || max_len.is_multiple_of(KEY_PANEL), "key panels in a cache of {max_len} positions");
    let mut b = KernelBuilder::new();
    let k = b.param("k", ElemType::F32, false);
    let v_ = b.param("v", ElemType::F32, false);
    let pos = b.param("pos", ElemType::I32, false);
    let kc = b.param("k_cache", cache, true);
    let vc = b.param("v_cache", cache, true);
    let (t, h, p, d) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let (hd, len, w) = (head_dim as i64, max_len as i64, (kv_heads * head_dim) as i64);
    let at = cache_index(v(h), v(p), v(d), hd, len);
    let key_at = keys.element(|p| cache_index(v(h), p, i(0), hd, len), v(p), v(d));
    let from = add(add(mul(v(t), i(w)), mul(v(h), i(hd))), v(d));
    let body = vec![set(p, ld(pos, v(t))), for_(h, i(0), i(kv_heads as i64), store_head_row(keys, d, hd, (k, kc, key_at), (v_, vc, at), from))];
    let name = format!("kv_store_kv{kv_heads}_d{head_dim}_l{max_len}{}{}_{}", cache_tag(cache), keys.tag(), seq.tag());
    b.finish(name, "kv_store", TaskCount { per_seq: 1, fixed: 0 }, t, body)
}

/// One KV head's row of a token stored: `k[from]` to `k_cache[key_at]` and
/// `v[from]` to `v_cache[value_at]` for `d` in `0..hd`; one vector loop for rows,
/// the key's strided stores in a loop of their own for panels.
fn store_head_row(keys: KeyLayout, d: VarId, hd: i64, (k, kc, key_at): (ParamId, ParamId, Expr), (v_, vc, value_at): (ParamId, ParamId, Expr), from: Expr) -> Vec<Stmt> {
    let key = store(kc, key_at, ld(k, from.clone()));
    let value = store(vc, value_at, ld(v_, from));
    match keys {
        KeyLayout::Rows => vec![for_vec(d, i(0), i(hd), vec![key, value])],
        KeyLayout::Panels => vec![for_(d, i(0), i(hd), vec![key]), for_vec(d, i(0), i(hd), vec![value])],
    }
}

/// The KV cache of a batch plan: per layer, blocks of `block_size` positions
/// from one pool, laid out `[blocks, kv_heads, block_size, head_dim]` (a KV head's
/// positions of one block are one run). Row `t` of a step belongs to the step's
/// sequence `seqs[t]`, whose block `b` is `tables[seqs[t] * blocks_per_seq + b]`;
/// its keys and values are stored at `slots[t]` (block `slot / block_size`,
/// offset `slot % block_size`). Many sequences of different lengths share a step
/// and the pool, and no sequence reserves the whole context.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Paging {
    pub block_size: u64,
    pub blocks_per_seq: u64,
}

impl Paging {
    fn tag(&self) -> String {
        format!("_pb{}x{}", self.block_size, self.blocks_per_seq)
    }

    /// Floats (or halves) of one block of one layer's keys: `kv_heads * block_size * head_dim`.
    pub fn block_elems(&self, kv_heads: u64, head_dim: u64) -> u64 {
        kv_heads * self.block_size * head_dim
    }
}

/// Where element `d` of KV head `h` at offset `off` of block `block` lives in a
/// paged cache ([`Paging`]).
fn paged_index(block: Expr, h: Expr, off: Expr, d: Expr, kv_heads: i64, head_dim: i64, block_size: i64) -> Expr {
    add(mul(add(mul(add(mul(block, i(kv_heads)), h), i(block_size)), off), i(head_dim)), d)
}

/// `k, v: f32[rows, kv_heads*hd]`, `slots: i32[rows]` -> a paged `k_cache`,
/// `v_cache` ([`Paging`]; the runtime gives each row a slot of a block its
/// sequence holds), the keys as `keys` lays them out. One task per row: one head
/// row per KV head in each cache.
pub fn kv_store_paged(kv_heads: u64, head_dim: u64, paging: Paging, cache: ElemType, keys: KeyLayout) -> Kernel {
    assert!(matches!(cache, ElemType::F32 | ElemType::F16), "a KV cache of {cache:?}");
    assert!(keys == KeyLayout::Rows || paging.block_size.is_multiple_of(KEY_PANEL), "key panels in blocks of {} positions", paging.block_size);
    let mut b = KernelBuilder::new();
    let k = b.param("k", ElemType::F32, false);
    let v_ = b.param("v", ElemType::F32, false);
    let slots = b.param("slots", ElemType::I32, false);
    let kc = b.param("k_cache", cache, true);
    let vc = b.param("v_cache", cache, true);
    let (t, h, slot, d) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let (hd, bs, w) = (head_dim as i64, paging.block_size as i64, (kv_heads * head_dim) as i64);
    let at = paged_index(div(v(slot), i(bs)), v(h), rem(v(slot), i(bs)), v(d), kv_heads as i64, hd, bs);
    let key_at = keys.element(|off| paged_index(div(v(slot), i(bs)), v(h), off, i(0), kv_heads as i64, hd, bs), rem(v(slot), i(bs)), v(d));
    let from = add(add(mul(v(t), i(w)), mul(v(h), i(hd))), v(d));
    let body = vec![set(slot, ld(slots, v(t))), for_(h, i(0), i(kv_heads as i64), store_head_row(keys, d, hd, (k, kc, key_at), (v_, vc, at), from))];
    let name = format!("kv_store_paged_kv{kv_heads}_d{head_dim}_b{}{}{}_sN", paging.block_size, cache_tag(cache), keys.tag());
    b.finish(name, "kv_store", TaskCount { per_seq: 1, fixed: 0 }, t, body)
}

/// Decode attention splits each KV head's positions into at most this many
/// chunks, one task each (flash-decoding): a step has `kv_heads * DECODE_SPLITS`
/// tasks to share between threads instead of `kv_heads` (SmolLM2: 3, so with two
/// threads one of them did two thirds of the work), and a combine kernel merges
/// the chunks' softmax parts.
pub const DECODE_SPLITS: u64 = 16;

/// No chunk of a split decode attention is shorter than this many positions
/// (but the last), so short contexts are not cut into slivers whose partial
/// results cost more to write and merge than they save; whole causal attention
/// computes the same chunks for every row (batch invariance), where slivers
/// cost most. A multiple of [`KEY_PANEL`] and of the KV blocks.
pub const MIN_SPLIT_POSITIONS: u64 = 128;

/// Chunk lengths are multiples of this many positions: chunks start on key
/// panels and KV blocks.
const CHUNK_ALIGN: u64 = 16;

/// Floats per query head in a split attention's partial results: the head's
/// unnormalized output row, then its running max and its sum of exponentials.
pub fn partial_row(head_dim: u64) -> u64 {
    head_dim + 2
}

impl AttentionShape {
    /// Positions one task scores: every position of the cache, or with `splits`
    /// the longest chunk (`max(ceil(max_len / splits), MIN_SPLIT_POSITIONS)`,
    /// at most `max_len`).
    fn scored_positions(&self, splits: Option<u64>) -> u64 {
        match splits {
            None => self.max_len,
            Some(n) => self.max_len.div_ceil(n).max(MIN_SPLIT_POSITIONS).next_multiple_of(CHUNK_ALIGN).min(self.max_len),
        }
    }

    /// Scratch floats per token of [`attention_partial`] with `splits` chunks:
    /// a score row per query head, per chunk, per KV head.
    pub fn split_scratch_per_token(&self, splits: u64) -> u64 {
        self.kv_heads * splits * self.heads / self.kv_heads * self.score_row(Some(splits))
    }

    /// Floats per token of [`attention_partial`]'s output: a partial row per
    /// query head and chunk.
    pub fn partials_per_token(&self, splits: u64) -> u64 {
        self.heads * splits * partial_row(self.head_dim)
    }
}

/// `q: f32[seq, heads*hd]`, `pos: i32[seq]`, caches,
/// `scratch: f32[seq*kv_heads, group*max_len]` -> `out: f32[seq, heads*hd]`.
///
/// One task is one (token, KV head) and computes all `group = heads / kv_heads`
/// query heads that share that KV head together, so each key and value row is
/// read once per task, not once per query head. Scores: one key row per step,
/// dotted with every query head of the group; output: four key positions per
/// sweep over the output rows (the remainders one at a time).
pub fn attention(shape: AttentionShape, seq: SeqMode) -> Kernel {
    attention_over(shape, seq, None, None)
}

/// [`attention`] (`splits: None`) or [`attention_partial`] over a paged cache
/// for the rows of a batch step: `q`, `pos`, `seqs: i32[rows]`, `tables:
/// i32[sequences, blocks_per_seq]`, caches, scratch -> `out` or `partials`,
/// each row over its own sequence's positions ([`Paging`]).
pub fn attention_paged(shape: AttentionShape, paging: Paging, splits: Option<u64>) -> Kernel {
    assert!(shape.causal, "paged attention is for causal attention");
    attention_over(shape, SeqMode::Dynamic, splits, Some(paging))
}

/// Positions per chunk of a split attention over `n` visible positions (the
/// last chunk may be shorter): `n / splits` rounded up, at least
/// [`MIN_SPLIT_POSITIONS`], rounded up to a multiple of [`CHUNK_ALIGN`].
fn chunk_positions(n: Expr, splits: i64) -> Expr {
    let a = CHUNK_ALIGN as i64;
    let even = max(div(add(n, i(splits - 1)), i(splits)), i(MIN_SPLIT_POSITIONS as i64));
    mul(div(add(even, i(a - 1)), i(a)), i(a))
}

/// How many chunks of [`chunk_positions`] cover `n` visible positions (at most `splits`).
fn chunks_used(n: Expr, splits: i64) -> Expr {
    chunks_of(n.clone(), chunk_positions(n, splits))
}

/// How many chunks of `chunk` positions cover `n` positions.
fn chunks_of(n: Expr, chunk: Expr) -> Expr {
    div(sub(add(n, chunk.clone()), i(1)), chunk)
}

/// The first and one-past-last visible position of a token at position `p`.
fn visible(shape: &AttentionShape, p: Expr) -> (Expr, Expr) {
    let start = match shape.window {
        None => i(0),
        Some(w) => max(sub(add(p.clone(), i(1)), i(w as i64)), i(0)),
    };
    (start, add(p, i(1)))
}

/// Causal attention in `splits` chunks of positions per (token, KV head) task,
/// the first half of flash-decoding: `q`, `pos`, caches,
/// `scratch: f32[seq, split_scratch_per_token]` ->
/// `partials: f32[seq, kv_heads, splits, group, head_dim + 2]`, each query head's
/// output over its chunk before normalization, the chunk's max score and its sum
/// of `exp(score - max)`. The token's `n` visible positions make
/// [`chunks_used`] chunks of [`chunk_positions`] each (the last may be shorter); the tasks of the other chunks write nothing, and
/// [`attention_combine`] reads only the chunks there are.
pub fn attention_partial(shape: AttentionShape, splits: u64, seq: SeqMode) -> Kernel {
    assert!(shape.causal && splits >= 1, "split attention is for causal attention");
    attention_over(shape, seq, Some(splits), None)
}

fn attention_over(shape: AttentionShape, seq: SeqMode, splits: Option<u64>, paging: Option<Paging>) -> Kernel {
    // A chunk of split attention is the same with or without sinks: the combine
    // adds them.
    let shape = if splits.is_some() { AttentionShape { sinks: false, ..shape } } else { shape };
    let mut b = KernelBuilder::new();
    let q = b.param("q", ElemType::F32, false);
    let pos = b.param("pos", ElemType::I32, false);
    let tables = paging.map(|_| (b.param("seqs", ElemType::I32, false), b.param("tables", ElemType::I32, false)));
    let kc = b.param("k_cache", shape.cache, false);
    let vc = b.param("v_cache", shape.cache, false);
    let sinks = shape.sinks.then(|| b.param("sinks", ElemType::F32, false));
    let sc = b.param("scratch", ElemType::F32, true);
    // CPU causal attention without splits (key panels) takes the decode plans'
    // chunks in turn, each into a partial row of a local array of the task's
    // (apart from the score rows, as flash-decoding's partials are; on the
    // stack, where the arena would grow by it per row), so that a row's output
    // does not depend on which plan computes it. The GPU forms (key rows)
    // reassociate anyway, and take one softmax over the row.
    let canonical = splits.is_none() && shape.causal && shape.keys == KeyLayout::Panels;
    let parts = canonical.then(|| b.local(shape.parts_per_task()));
    let out = b.param(if splits.is_some() { "partials" } else { "out" }, ElemType::F32, true);
    let ivar = |b: &mut KernelBuilder| b.var(ValType::I64);
    let t = ivar(&mut b);
    let (s, g, p, start, end, j, d, jb, jj) =
        (ivar(&mut b), ivar(&mut b), ivar(&mut b), ivar(&mut b), ivar(&mut b), ivar(&mut b), ivar(&mut b), ivar(&mut b), ivar(&mut b));
    let (nh, nkv, hd, len) = (shape.heads as i64, shape.kv_heads as i64, shape.head_dim as i64, shape.max_len as i64);
    let group = (nh / nkv) as usize;
    let row_len = shape.score_row(splits) as i64;
    let panels = shape.keys == KeyLayout::Panels;
    let fvars = |b: &mut KernelBuilder, n: usize| -> Vec<VarId> { (0..n).map(|_| b.var(ValType::F32)).collect() };
    let ivars = |b: &mut KernelBuilder, n: usize| -> Vec<VarId> { (0..n).map(|_| b.var(ValType::I64)).collect() };
    // Per query head of the group: its q row offset, output offset, score row
    // offset, max, sum and running dot product.
    let (qo, oo, so) = (ivars(&mut b, group), ivars(&mut b, group), ivars(&mut b, group));
    let (m, l, dot) = (fvars(&mut b, group), fvars(&mut b, group), fvars(&mut b, group));
    // Per (head, unrolled step): a probability; per step: a row offset.
    let coef: Vec<Vec<VarId>> = (0..group).map(|_| fvars(&mut b, 4)).collect();
    let rows = ivars(&mut b, 4);
    let pj = b.var(ValType::F32);
    let start_expr = visible(&shape, v(p)).0;
    // Score rows are indexed from the task's first position (with key panels,
    // the first position of its first panel).
    let first = ivar(&mut b);
    let score = |h: usize, j: Expr| add(sub(j, v(first)), v(so[h]));
    let o = |h: usize, d: Expr| add(d, v(qo[h]));
    let o_out = |h: usize, d: Expr| add(d, v(oo[h]));
    // The start of KV head g's row at position j in either cache: the token's
    // sequence's row of the block tables starts at `table` when paged.
    let table = ivar(&mut b);
    let row = |j: Expr| match (paging, tables) {
        (Some(pg), Some((_, tb))) => {
            let bs = pg.block_size as i64;
            paged_index(ld(tb, add(v(table), div(j.clone(), i(bs)))), v(g), rem(j, i(bs)), i(0), nkv, hd, bs)
        }
        _ => cache_index(v(g), j, i(0), hd, len),
    };

    let split = splits.unwrap_or(1) as i64;
    let mut body = vec![
        set(s, div(v(t), i(nkv * split))),
        set(g, rem(v(t), i(nkv * split))),
        set(p, ld(pos, v(s))),
        set(table, match (paging, tables) {
            (Some(pg), Some((seqs, _))) => mul(ld(seqs, v(s)), i(pg.blocks_per_seq as i64)),
            _ => i(0),
        }),
        set(start, start_expr),
        // Causal: keys up to this token; bidirectional: up to the step's last token.
        set(end, if shape.causal { add(v(p), i(1)) } else { add(ld(pos, sub(seq.expr(), i(1))), i(1)) }),
    ];
    if splits.is_some() {
        // g is (KV head, chunk) here: chunk c of the n = end - start positions.
        let (c, chunk) = (ivar(&mut b), ivar(&mut b));
        body.extend([
            set(c, rem(v(g), i(split))),
            set(g, div(v(g), i(split))),
            set(chunk, chunk_positions(sub(v(end), v(start)), split)),
            set(start, min(add(v(start), mul(v(c), v(chunk))), v(end))),
            set(end, min(add(v(start), v(chunk)), v(end))),
        ]);
    }
    body.push(set(first, if panels { sub(v(start), rem(v(start), i(KEY_PANEL as i64))) } else { v(start) }));
    let prelude = body.len();
    let out_row = partial_row(shape.head_dim) as i64;
    let per_task = group as i64 * row_len;
    for h in 0..group {
        let head = add(mul(v(g), i(group as i64)), i(h as i64));
        body.push(set(qo[h], mul(add(mul(v(s), i(nh)), head), i(hd))));
        body.push(set(oo[h], if splits.is_some() { mul(add(mul(v(t), i(group as i64)), i(h as i64)), i(out_row)) } else { v(qo[h]) }));
        body.push(set(so[h], add(mul(v(t), i(per_task)), i(h as i64 * row_len))));
    }

    // Decode: while keys are scored, the value rows of their positions are
    // fetched for the output sweep (one prefetch per cache line), so the value
    // run streams beside the key run instead of after it.
    let prefetch_values = seq.is_decode() || (splits.is_some() && paging.is_some());
    if panels {
        // Scores of one key panel (positions jb * 16 ..): per element d, the
        // panel's 16 keys times each head's q_h[d], accumulated in a register
        // per head; a task scores the whole panels its positions touch (the
        // score row has room for them, and the positions outside are never read).
        let lane = ivar(&mut b);
        let width = KEY_PANEL as i64;
        // Each head sums the elements d in `ways` interleaved accumulators per
        // panel, and panels go two at a time (the odd one alone, its sums in the
        // same order), so that eight or more multiply-add chains are in flight
        // (one per head and panel left three chains of 4-cycle latency on two FMA
        // units) and each broadcast of q_h[d] serves two panels.
        let ways = panel_score_ways(group as u64, shape.head_dim) as usize;
        let acc: Vec<Vec<Vec<LocalId>>> = (0..2).map(|_| (0..group).map(|_| (0..ways).map(|_| b.local(KEY_PANEL)).collect()).collect()).collect();
        let qd: Vec<Vec<VarId>> = (0..group).map(|_| fvars(&mut b, ways)).collect();
        let (pair, panel_count) = (ivar(&mut b), ivar(&mut b));
        let element = |w: usize| add(mul(v(d), i(ways as i64)), i(w as i64));
        // Panels jb .. jb + count: both caches' rows of a panel's first position
        // start at the same place (the keys' panel, then its values' 16 rows).
        let panels_from_jb = |count: usize| -> Vec<Stmt> {
            let mut block = Vec::new();
            for c in 0..count {
                block.push(set(rows[c], row(mul(add(v(jb), i(c as i64)), i(width)))));
            }
            block.extend(acc[..count].iter().flatten().flatten().map(|&a| for_vec(lane, i(0), i(width), vec![store(a, v(lane), f(0.0))])));
            let mut per_step: Vec<Stmt> = (0..group).flat_map(|h| (0..ways).map(move |w| (h, w))).map(|(h, w)| set(qd[h][w], ld(q, o(h, element(w))))).collect();
            // Decode: each step also fetches the next part of the panels' 16
            // value rows for the output sweep, so that the value runs stream
            // beside the key panels, a few lines per step rather than a burst per
            // panel (64 prefetches at once per panel ran 1.47x slower than
            // rows at depth 4000, and none 1.30x).
            if prefetch_values {
                let step_elems = KEY_PANEL as i64 * ways as i64;
                let line_elems = 64 / shape.cache.size() as i64;
                for c in 0..count {
                    for line in 0..(step_elems + line_elems - 1) / line_elems {
                        per_step.push(prefetch(vc, add(add(v(rows[c]), mul(v(d), i(step_elems))), i(line * line_elems))));
                    }
                }
            }
            // The lane is the first operand of the index (LLVM keeps it consecutive).
            let key = |c: usize, w: usize| ld(kc, add(v(lane), add(v(rows[c]), mul(element(w), i(width)))));
            let mut lanes = Vec::new();
            for (c, panel_acc) in acc[..count].iter().enumerate() {
                for (h, head_acc) in panel_acc.iter().enumerate() {
                    for (w, &a) in head_acc.iter().enumerate() {
                        lanes.push(store(a, v(lane), mul_add(v(qd[h][w]), key(c, w), ld(a, v(lane)))));
                    }
                }
            }
            per_step.push(for_vec(lane, i(0), i(width), lanes));
            block.push(for_(d, i(0), i(hd / ways as i64), per_step));
            for (c, panel_acc) in acc[..count].iter().enumerate() {
                for (h, head_acc) in panel_acc.iter().enumerate() {
                    let sum = head_acc.iter().skip(1).fold(ld(head_acc[0], v(lane)), |s, &a| add(s, ld(a, v(lane))));
                    let at = score(h, mul(add(v(jb), i(c as i64)), i(width)));
                    block.push(for_vec(lane, i(0), i(width), vec![store(sc, add(v(lane), at), mul(sum, f(shape.scale)))]));
                }
            }
            block
        };
        let first_panel = div(v(first), i(width));
        let last_panel = div(add(v(end), i(width - 1)), i(width));
        if splits.is_some() {
            // Split attention (decode) streams its keys and values from memory:
            // one panel at a time keeps one key stream beside one value stream
            // (two panels at a time ran 1.1x slower at depth 4000).
            body.push(for_(jb, first_panel, last_panel, panels_from_jb(1)));
        } else {
            body.push(set(panel_count, sub(last_panel, first_panel.clone())));
            let mut two = vec![set(jb, add(first_panel.clone(), mul(v(pair), i(2))))];
            two.extend(panels_from_jb(2));
            body.push(for_(pair, i(0), div(v(panel_count), i(2)), two));
            let mut last = vec![set(jb, sub(add(first_panel, v(panel_count)), i(1)))];
            last.extend(panels_from_jb(1));
            body.push(if_(eq(rem(v(panel_count), i(2)), i(1)), last));
        }
    } else {
        // Scores: s_h[j] = scale * sum_d q_h[d] K[g, j, d], every head of the group
        // against one key row.
        let mut per_key = vec![set(rows[0], row(v(j)))];
        if prefetch_values {
            per_key.extend((0..(hd * 4 + 63) / 64).map(|c| prefetch(vc, add(v(rows[0]), i(c * 16)))));
        }
        per_key.extend((0..group).map(|h| set(dot[h], f(0.0))));
        let lanes = (0..group).map(|h| set(dot[h], add(v(dot[h]), mul(ld(q, o(h, v(d))), ld(kc, add(v(rows[0]), v(d))))))).collect();
        per_key.push(for_vec(d, i(0), i(hd), lanes));
        per_key.extend((0..group).map(|h| store(sc, score(h, v(j)), mul(v(dot[h]), f(shape.scale)))));
        body.push(for_(j, v(start), v(end), per_key));
    }

    // The softmax and the weighted sum of values over positions `start..end`
    // into `acc` at `oo[h]`: the output row before normalization, then (split
    // and canonical attention) the chunk's max and its sum of exponentials.
    let acc: Buf = parts.map_or(out.into(), Into::into);
    // CPU code (key panels) keeps its float order, so that a row's bits are
    // the same in every plan (docs/serving.md, Batch invariance); the GPU forms
    // (key rows) let LLVM reassociate.
    let ordered = panels;
    if ordered {
        b.keep_float_order();
    }
    let (lsum, lane16, group16) = (b.local(16), ivar(&mut b), ivar(&mut b));
    let mut chunk_body = Vec::new();
    for h in 0..group {
        // Soft-capping (Gemma 2): s = tanh(s / c) * c.
        if let Some(c) = shape.softcap {
            chunk_body.push(for_vec(j, v(start), v(end), vec![store(sc, score(h, v(j)), mul(un(UnOp::Tanh, div(ld(sc, score(h, v(j))), f(c))), f(c)))]));
        }
        // Softmax over the row.
        chunk_body.push(set(m[h], f(-3.0e38)));
        chunk_body.push(for_vec(j, v(start), v(end), vec![set(m[h], max(v(m[h]), ld(sc, score(h, v(j)))))]));
        if ordered {
            // The exponentials, then their sum in a fixed order: 16 lanes by
            // position from the start (positions past the end add nothing:
            // the score row has room past it), then the lanes pairwise.
            let p_at = |k: Expr| score(h, add(v(lane16), add(v(start), mul(k, i(16)))));
            chunk_body.push(for_vec(j, v(start), v(end), vec![store(sc, score(h, v(j)), fast_exp(sub(ld(sc, score(h, v(j))), v(m[h]))))]));
            chunk_body.push(for_vec(lane16, i(0), i(16), vec![store(lsum, v(lane16), f(0.0))]));
            let in_chunk = lt(add(v(lane16), add(v(start), mul(v(group16), i(16)))), v(end));
            chunk_body.push(for_(
                group16,
                i(0),
                div(add(sub(v(end), v(start)), i(15)), i(16)),
                vec![for_vec(lane16, i(0), i(16), vec![store(lsum, v(lane16), add(ld(lsum, v(lane16)), select(in_chunk.clone(), ld(sc, p_at(v(group16))), f(0.0))))])],
            ));
            for width in [8, 4, 2, 1] {
                chunk_body.push(for_vec(lane16, i(0), i(width), vec![store(lsum, v(lane16), add(ld(lsum, v(lane16)), ld(lsum, add(v(lane16), i(width)))))]));
            }
            chunk_body.push(set(l[h], ld(lsum, i(0))));
        } else {
            chunk_body.push(set(l[h], f(0.0)));
            chunk_body.push(for_vec(
                j,
                v(start),
                v(end),
                vec![set(pj, fast_exp(sub(ld(sc, score(h, v(j))), v(m[h])))), store(sc, score(h, v(j)), v(pj)), set(l[h], add(v(l[h]), v(pj)))],
            ));
        }
        chunk_body.push(for_vec(d, i(0), i(hd), vec![store(acc, o_out(h, v(d)), f(0.0))]));
    }

    // out_h = sum_j p_h[j] V[g, j] / l_h, four key positions per sweep.
    let out_sweep = |positions: &[Expr], coef: &[Vec<VarId>], rows: &[VarId]| -> Vec<Stmt> {
        let mut sweep = Vec::new();
        for (u, j_u) in positions.iter().enumerate() {
            for h in 0..group {
                sweep.push(set(coef[h][u], ld(sc, score(h, j_u.clone()))));
            }
            sweep.push(set(rows[u], row(j_u.clone())));
        }
        let mut lanes = Vec::new();
        for h in 0..group {
            let mut sum = ld(acc, o_out(h, v(d)));
            for u in 0..positions.len() {
                sum = mul_add(v(coef[h][u]), ld(vc, add(v(d), v(rows[u]))), sum);
            }
            lanes.push(store(acc, o_out(h, v(d)), sum));
        }
        sweep.push(for_vec(d, i(0), i(hd), lanes));
        sweep
    };
    chunk_body.push(set(jb, div(sub(v(end), v(start)), i(4))));
    let four: Vec<Expr> = (0..4).map(|u| add(add(v(start), mul(v(jj), i(4))), i(u))).collect();
    chunk_body.push(for_(jj, i(0), v(jb), out_sweep(&four, &coef, &rows)));
    chunk_body.push(for_(j, add(v(start), mul(v(jb), i(4))), v(end), out_sweep(&[v(j)], &coef, &rows)));
    for h in 0..group {
        if splits.is_some() || canonical {
            // The chunk's softmax parts, for the combine.
            chunk_body.push(store(acc, o_out(h, i(hd)), v(m[h])));
            chunk_body.push(store(acc, o_out(h, i(hd + 1)), v(l[h])));
        } else {
            if let Some(sk) = sinks {
                // The sink's exponential joins the denominator (relative to the
                // scores' max: one that overflows leaves an output of zero,
                // what a sink that large means).
                let head = add(mul(v(g), i(group as i64)), i(h as i64));
                chunk_body.push(set(l[h], add(v(l[h]), fast_exp(sub(ld(sk, head), v(m[h]))))));
            }
            chunk_body.push(set(l[h], div(f(1.0), v(l[h]))));
            chunk_body.push(for_vec(d, i(0), i(hd), vec![store(out, o_out(h, v(d)), mul(ld(out, o_out(h, v(d))), v(l[h])))]));
        }
    }
    if canonical {
        // The decode plans' chunks, one after another in this task, each into
        // a partial row of the local array, then merged as `attention_combine`
        // merges them: the same statements in the same order, so that a row
        // gets the bits here that it gets from flash-decoding.
        let (row_start, row_end, c, chunk, used, base) = (ivar(&mut b), ivar(&mut b), ivar(&mut b), ivar(&mut b), ivar(&mut b), ivar(&mut b));
        let (big_m, sum, w) = (b.var(ValType::F32), b.var(ValType::F32), b.var(ValType::F32));
        let split = DECODE_SPLITS as i64;
        let part_row = move |c: Expr, h: usize| mul(add(mul(c, i(group as i64)), i(h as i64)), i(out_row));
        body.extend([
            set(row_start, v(start)),
            set(row_end, v(end)),
            set(chunk, chunk_positions(sub(v(row_end), v(row_start)), split)),
            set(used, chunks_of(sub(v(row_end), v(row_start)), v(chunk))),
        ]);
        let mut per_chunk = vec![set(start, min(add(v(row_start), mul(v(c), v(chunk))), v(row_end))), set(end, min(add(v(start), v(chunk)), v(row_end)))];
        per_chunk.extend((0..group).map(|h| set(oo[h], part_row(v(c), h))));
        per_chunk.extend(chunk_body);
        body.push(for_(c, i(0), v(used), per_chunk));
        for h in 0..group {
            let o = |d: Expr| add(d, v(qo[h]));
            let sink = sinks.map(|sk| ld(sk, add(mul(v(g), i(group as i64)), i(h as i64))));
            body.extend(merge_chunks(acc, &|c| part_row(c, h), sink, out, &o, hd, (used, c, base, d), (big_m, sum, w)));
        }
    } else {
        body.extend(chunk_body);
    }
    if splits.is_some() {
        // A chunk past the token's last one returns at once (the combine does not
        // read it): at short contexts most tasks are such (one in 16 at 32
        // positions), and their setup alone cost 18% of the kernel.
        let work = body.split_off(prelude);
        body.push(if_(lt(v(start), v(end)), work));
    }
    let tasks = TaskCount { per_seq: shape.kv_heads * splits.unwrap_or(1), fixed: 0 };
    let paged = paging.map_or(String::new(), |p| p.tag());
    let name = match splits {
        None => format!("attention_{}{paged}_{}", shape.tag(), seq.tag()),
        Some(n) => format!("attention_split{n}_{}{paged}_{}", shape.tag(), seq.tag()),
    };
    b.finish(name, "attention", tasks, t, body)
}

/// The second half of flash-decoding: `partials` of [`attention_partial`] with
/// `splits` chunks, `pos: i32[seq]` (how many chunks each token's parts fill)
/// -> `out: f32[seq, heads*hd]`. One task per token, every
/// query head in turn: `out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c` with `M` the
/// largest chunk max, exactly softmax attention over all the chunks' positions.
pub fn attention_combine(shape: AttentionShape, splits: u64, seq: SeqMode) -> Kernel {
    attention_combine_in(shape, splits, seq, false)
}

/// The GPU form of [`attention_combine`]: one task per (token, query head).
/// (One task per token merged a decode step's 32 heads one after another in one
/// thread block: 54 us on an H100, docs/gpu.md.)
pub fn attention_combine_gpu(shape: AttentionShape, splits: u64, seq: SeqMode) -> Kernel {
    attention_combine_in(shape, splits, seq, true)
}

fn attention_combine_in(shape: AttentionShape, splits: u64, seq: SeqMode, gpu: bool) -> Kernel {
    let mut b = KernelBuilder::new();
    // The CPU form merges in the order canonical attention does (both keep
    // their float order).
    if !gpu {
        b.keep_float_order();
    }
    let part = b.param("partials", ElemType::F32, false);
    let pos = b.param("pos", ElemType::I32, false);
    let sinks = shape.sinks.then(|| b.param("sinks", ElemType::F32, false));
    let out = b.param("out", ElemType::F32, true);
    let (t, s, hq, c, base, d) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let used = b.var(ValType::I64);
    let (big_m, sum, w) = (b.var(ValType::F32), b.var(ValType::F32), b.var(ValType::F32));
    let (nh, nkv, hd) = (shape.heads as i64, shape.kv_heads as i64, shape.head_dim as i64);
    let (group, row, n) = (nh / nkv, partial_row(shape.head_dim) as i64, splits as i64);
    // Query head hq = g * group + h reads rows ((s * kv_heads + g) * splits + c) * group + h.
    let chunk_row = |c: Expr| {
        let g = div(v(hq), i(group));
        let h = rem(v(hq), i(group));
        mul(add(mul(add(mul(add(mul(v(s), i(nkv)), g), i(n)), c), i(group)), h), i(row))
    };
    let o = |d: Expr| add(mul(add(mul(v(s), i(nh)), v(hq)), i(hd)), d);
    let per_head = merge_chunks(part.into(), &chunk_row, sinks.map(|sk| ld(sk, v(hq))), out, &o, hd, (used, c, base, d), (big_m, sum, w));
    let (first, end) = visible(&shape, ld(pos, v(s)));
    let used_chunks = set(used, chunks_used(sub(end, first), n));
    let (body, tasks) = if gpu {
        let mut body = vec![set(s, div(v(t), i(nh))), set(hq, rem(v(t), i(nh))), used_chunks];
        body.extend(per_head);
        (body, TaskCount { per_seq: shape.heads, fixed: 0 })
    } else {
        // One task per token: a decode step's merge (a few KiB) runs on the calling
        // thread, where a launch of a task per head cost more in hand-outs and the
        // barrier than the merge itself.
        (vec![set(s, v(t)), used_chunks, for_(hq, i(0), i(nh), per_head)], TaskCount { per_seq: 1, fixed: 0 })
    };
    b.finish(format!("attention_combine{splits}_{}_{}", shape.tag(), seq.tag()), "attention_combine", tasks, t, body)
}

/// Chunks `0..used` of one query head's partial rows (`part` at `chunk_row(c)`:
/// the chunk's unnormalized output row, then its max and its sum of
/// exponentials) merged into `out` at `o(d)`: `out = sum_c e^(m_c - M) o_c /
/// (e^(z - M) + sum_c e^(m_c - M) l_c)` with `M` the largest of the chunk maxes
/// and the head's sink `z` (no sink: that term is absent), the chunks in order.
/// [`attention_combine`] and canonical attention share these statements.
#[allow(clippy::too_many_arguments)]
fn merge_chunks(part: Buf, chunk_row: &dyn Fn(Expr) -> Expr, sink: Option<Expr>, out: ParamId, o: &dyn Fn(Expr) -> Expr, hd: i64, (used, c, base, d): (VarId, VarId, VarId, VarId), (big_m, sum, w): (VarId, VarId, VarId)) -> Vec<Stmt> {
    let sum_start = match &sink {
        Some(z) => fast_exp(sub(z.clone(), v(big_m))),
        None => f(0.0),
    };
    vec![
        set(big_m, sink.unwrap_or(f(-3.0e38))),
        for_(c, i(0), v(used), vec![set(big_m, max(v(big_m), ld(part, add(chunk_row(v(c)), i(hd)))))]),
        set(sum, sum_start),
        for_vec(d, i(0), i(hd), vec![store(out, o(v(d)), f(0.0))]),
        for_(
            c,
            i(0),
            v(used),
            vec![
                set(base, chunk_row(v(c))),
                set(w, fast_exp(sub(ld(part, add(v(base), i(hd))), v(big_m)))),
                set(sum, mul_add(v(w), ld(part, add(v(base), i(hd + 1))), v(sum))),
                for_vec(d, i(0), i(hd), vec![store(out, o(v(d)), mul_add(v(w), ld(part, add(v(base), v(d))), ld(out, o(v(d)))))]),
            ],
        ),
        set(sum, div(f(1.0), v(sum))),
        for_vec(d, i(0), i(hd), vec![store(out, o(v(d)), mul(ld(out, o(v(d))), v(sum)))]),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{run, Buffer};
    use crate::library::test_util::*;

    /// Naive softmax attention (soft-capped scores where asked) for one query row
    /// against keys 0..=p; a sink logit joins the denominator as transformers'
    /// gpt-oss does it (the sink appended to the scores, the softmax over all,
    /// the sink's column dropped).
    fn naive(q: &[f32], keys: &[&[f32]], vals: &[&[f32]], scale: f32, softcap: Option<f32>, sink: Option<f32>) -> Vec<f32> {
        let cap = |x: f32| softcap.map_or(x, |c| (x / c).tanh() * c);
        let s: Vec<f32> = keys.iter().map(|k| cap(q.iter().zip(*k).map(|(a, b)| a * b).sum::<f32>() * scale)).collect();
        let mx = s.iter().copied().chain(sink).fold(f32::MIN, f32::max);
        let e: Vec<f32> = s.iter().map(|x| (x - mx).exp()).collect();
        let z: f32 = e.iter().sum::<f32>() + sink.map_or(0.0, |z| (z - mx).exp());
        (0..q.len()).map(|d| e.iter().zip(vals).map(|(w, v)| w / z * v[d]).sum()).collect()
    }

    /// Where element `d` of KV head `h`'s key at position `p` lives in a cache of
    /// `len` positions (`keys` laid out as the kernels do), written out anew.
    fn key_at(keys: KeyLayout, (h, p, d): (usize, usize, usize), hd: usize, len: usize) -> usize {
        match keys {
            KeyLayout::Rows => (h * len + p) * hd + d,
            KeyLayout::Panels => (h * len + p / 16 * 16) * hd + d * 16 + p % 16,
        }
    }

    /// [`check_attention_in`] with the keys in rows, and in panels (the cache's
    /// length rounded up to whole panels).
    fn check_attention(shape: AttentionShape, seq: usize, decode: bool, splits: Option<u64>) {
        check_attention_in(AttentionShape { keys: KeyLayout::Rows, ..shape }, seq, decode, splits);
        check_attention_in(AttentionShape { keys: KeyLayout::Panels, max_len: shape.max_len.next_multiple_of(KEY_PANEL), ..shape }, seq, decode, splits);
    }

    /// Stores `seq` tokens at positions 0.. with `kv_store` (prefill or decode, token
    /// by token) and runs attention over them: the output of every query head
    /// equals naive softmax attention over its window.
    fn check_attention_in(shape: AttentionShape, seq: usize, decode: bool, splits: Option<u64>) {
        let (kvw, qw) = ((shape.kv_heads * shape.head_dim) as usize, (shape.heads * shape.head_dim) as usize);
        let (hd, group, len) = (shape.head_dim as usize, (shape.heads / shape.kv_heads) as usize, shape.max_len as usize);
        let (q, k, v) = (rand(seq * qw, 3), rand(seq * kvw, 4), rand(seq * kvw, 5));
        // Sinks around the scores' size, some well above them (one head's sink
        // takes most of the weight).
        let sinks: Vec<f32> = rand(shape.heads as usize, 6).iter().enumerate().map(|(h, x)| if h == 1 { 4.0 + x } else { 2.0 * x }).collect();
        let sink_of = |h: usize| shape.sinks.then(|| sinks[h]);
        let sink_buf = || shape.sinks.then(|| Buffer::F32(sinks.clone()));
        let half = shape.cache == ElemType::F16;
        let empty = || if half { Buffer::F16(vec![0; len * kvw]) } else { Buffer::F32(vec![0.0; len * kvw]) };
        let (mut kc, mut vc) = (empty(), empty());
        let steps: Vec<(usize, usize)> = if decode { (0..seq).map(|s| (s, s + 1)).collect() } else { vec![(0, seq)] };
        let mode = if decode { SeqMode::Fixed(1) } else { SeqMode::Dynamic };
        for &(a, b) in &steps {
            let pos: Vec<i32> = (a as i32..b as i32).collect();
            let mut bufs = vec![Buffer::F32(k[a * kvw..b * kvw].to_vec()), Buffer::F32(v[a * kvw..b * kvw].to_vec()), Buffer::I32(pos), kc, vc];
            run(&kv_store(shape.kv_heads, shape.head_dim, len as u64, shape.cache, shape.keys, mode), &mut bufs, (b - a) as u64);
            vc = bufs.pop().unwrap();
            kc = bufs.pop().unwrap();
        }
        // What the cache holds of each value: an f16 cache the nearest half (ties
        // to even, by the `half` crate); attention sees those values.
        let cached = |x: &[f32]| -> Vec<f32> { x.iter().map(|&x| if half { ::half::f16::from_f32(x).to_f32() } else { x }).collect() };
        let (k, v) = (cached(&k), cached(&v));
        let widen = |b: &Buffer| -> Vec<f32> {
            match b {
                Buffer::F32(x) => x.clone(),
                Buffer::F16(x) => x.iter().map(|&h| ::half::f16::from_bits(h).to_f32()).collect(),
                _ => unreachable!(),
            }
        };
        // Both caches are [kv_heads, max_len, head_dim]: head h's row at position p
        // holds that token's elements h * hd .. (h + 1) * hd (the keys' elements
        // where their layout puts them).
        let (keys, values) = (widen(&kc), widen(&vc));
        for h in 0..shape.kv_heads as usize {
            for p in 0..len {
                for d in 0..hd {
                    let want = |x: &[f32]| if p < seq { x[p * kvw + h * hd + d] } else { 0.0 };
                    let (key, value) = (keys[key_at(shape.keys, (h, p, d), hd, len)], values[(h * len + p) * hd + d]);
                    assert_eq!((key, value), (want(&k), want(&v)), "{:?}: head {h} position {p} element {d}", shape.keys);
                }
            }
        }
        let pos: Vec<i32> = (0..seq as i32).collect();
        let got = match splits {
            None => {
                let scratch = Buffer::F32(vec![f32::NAN; seq * shape.kv_heads as usize * shape.scratch_per_task() as usize]);
                let mut bufs = vec![Buffer::F32(q.clone()), Buffer::I32(pos), kc, vc];
                bufs.extend(sink_buf());
                bufs.push(scratch);
                bufs.push(Buffer::F32(vec![0.0; seq * qw]));
                run(&attention(shape, SeqMode::Dynamic), &mut bufs, seq as u64);
                bufs.pop().unwrap()
            }
            Some(n) => {
                // Every token at once: each one's own causal range is split.
                let scratch = Buffer::F32(vec![f32::NAN; seq * shape.split_scratch_per_token(n) as usize]);
                let partials = Buffer::F32(vec![f32::NAN; seq * shape.partials_per_token(n) as usize]);
                let mut bufs = vec![Buffer::F32(q.clone()), Buffer::I32(pos), kc, vc, scratch, partials];
                run(&attention_partial(shape, n, SeqMode::Dynamic), &mut bufs, seq as u64);
                let mut bufs = vec![bufs.swap_remove(5), Buffer::I32((0..seq as i32).collect())];
                bufs.extend(sink_buf());
                bufs.push(Buffer::F32(vec![f32::NAN; seq * qw]));
                let gpu_inputs = bufs.clone();
                run(&attention_combine(shape, n, SeqMode::Dynamic), &mut bufs, seq as u64);
                // The GPU form (a task per (token, head)), serially and as its lanes
                // run it, merges each head in the same order: the same bits.
                let gpu = attention_combine_gpu(shape, n, SeqMode::Dynamic);
                assert_eq!(gpu.tasks.eval(seq as u64), seq as u64 * shape.heads);
                for warp in [false, true] {
                    let mut g = gpu_inputs.clone();
                    run_as(&gpu, &mut g, seq as u64, warp);
                    assert_eq!(g.last(), bufs.last(), "GPU form, lanes {warp}");
                }
                bufs.pop().unwrap()
            }
        };
        let Buffer::F32(got) = &got else { unreachable!() };
        for s in 0..seq {
            for h in 0..shape.heads as usize {
                let kvh = h / group;
                let from = shape.window.map_or(0, |w| (s + 1).saturating_sub(w as usize));
                let keys: Vec<&[f32]> = (from..=s).map(|j| &k[j * kvw + kvh * hd..j * kvw + kvh * hd + hd]).collect();
                let vals: Vec<&[f32]> = (from..=s).map(|j| &v[j * kvw + kvh * hd..j * kvw + kvh * hd + hd]).collect();
                let want = naive(&q[s * qw + h * hd..s * qw + h * hd + hd], &keys, &vals, shape.scale, shape.softcap, sink_of(h));
                close(&got[s * qw + h * hd..s * qw + h * hd + hd], &want, 1e-5);
            }
        }
    }

    /// A batch step over a paged cache: three sequences of different lengths in
    /// scattered blocks of one pool. One `kv_store_paged` launch stores every
    /// row of all three (their rows interleaved); then attention (whole and
    /// split + combined) for every row equals naive softmax attention over its
    /// own sequence's positions up to its own, and only blocks the sequences
    /// hold are touched (the rest of the pool stays NaN).
    #[test]
    fn paged_attention_follows_each_sequences_block_table() {
        // Keys in rows in blocks of 4; in panels in blocks of 16 (a panel is 16
        // positions), the longest sequence in two of them.
        let rows = (Paging { block_size: 4, blocks_per_seq: 5 }, KeyLayout::Rows, [5usize, 13, 3], vec![vec![7, 2], vec![0, 11, 5, 9], vec![4]]);
        let panels = (Paging { block_size: 16, blocks_per_seq: 2 }, KeyLayout::Panels, [5usize, 21, 3], vec![vec![7], vec![0, 11], vec![4]]);
        let layouts = [rows, panels];
        let configs = [(None, None, ElemType::F32), (Some(6), Some(3.0), ElemType::F32), (None, None, ElemType::F16)];
        for ((paging, keys, lens, tables), (window, softcap, cache)) in layouts.iter().flat_map(|l| configs.map(|c| (l.clone(), c))) {
            let shape = AttentionShape { heads: 6, kv_heads: 2, head_dim: 8, scale: 0.3, window, max_len: 32, softcap, causal: true, cache, keys, sinks: false };
            let (kvw, qw, hd) = ((shape.kv_heads * shape.head_dim) as usize, (shape.heads * shape.head_dim) as usize, shape.head_dim as usize);
            let group = (shape.heads / shape.kv_heads) as usize;
            // Each sequence's blocks (`tables`), scattered over a pool of 12.
            let pool = 12usize;
            // Rows: the three sequences' positions, round robin.
            let mut rows: Vec<(usize, usize)> = Vec::new();
            for p in 0..*lens.iter().max().unwrap() {
                for (s, &n) in lens.iter().enumerate() {
                    if p < n {
                        rows.push((s, p));
                    }
                }
            }
            let n = rows.len();
            let (q, k, v) = (rand(n * qw, 11), rand(n * kvw, 12), rand(n * kvw, 13));
            let bs = paging.block_size as usize;
            let slots: Vec<i32> = rows.iter().map(|&(s, p)| tables[s][p / bs] * bs as i32 + (p % bs) as i32).collect();
            let seqs: Vec<i32> = rows.iter().map(|&(s, _)| s as i32).collect();
            let pos: Vec<i32> = rows.iter().map(|&(_, p)| p as i32).collect();
            let per_seq = paging.blocks_per_seq as usize;
            let mut flat = vec![0i32; 3 * per_seq];
            for (s, t) in tables.iter().enumerate() {
                flat[s * per_seq..s * per_seq + t.len()].copy_from_slice(t);
            }
            let elems = pool * paging.block_elems(shape.kv_heads, shape.head_dim) as usize;
            let half = cache == ElemType::F16;
            let poisoned = || if half { Buffer::F16(vec![::half::f16::NAN.to_bits(); elems]) } else { Buffer::F32(vec![f32::NAN; elems]) };
            let mut bufs = vec![Buffer::F32(k.clone()), Buffer::F32(v.clone()), Buffer::I32(slots), poisoned(), poisoned()];
            run(&kv_store_paged(shape.kv_heads, shape.head_dim, paging, cache, keys), &mut bufs, n as u64);
            let vc = bufs.pop().unwrap();
            let kc = bufs.pop().unwrap();
            // Blocks no sequence holds are untouched.
            let block = paging.block_elems(shape.kv_heads, shape.head_dim) as usize;
            for b in [1, 3, 6, 8, 10].into_iter().filter(|b| !tables.iter().flatten().any(|&t| t == *b as i32)) {
                let untouched = match &kc {
                    Buffer::F32(x) => x[b * block..(b + 1) * block].iter().all(|x| x.is_nan()),
                    Buffer::F16(x) => x[b * block..(b + 1) * block].iter().all(|&h| ::half::f16::from_bits(h).is_nan()),
                    _ => unreachable!(),
                };
                assert!(untouched, "block {b} was written");
            }
            let cached = |x: &[f32]| -> Vec<f32> { x.iter().map(|&x| if half { ::half::f16::from_f32(x).to_f32() } else { x }).collect() };
            let (k, v) = (cached(&k), cached(&v));
            // Whole attention, and split attention merged by the combine.
            let scratch = Buffer::F32(vec![f32::NAN; n * shape.kv_heads as usize * shape.scratch_per_task() as usize]);
            let mut b1 = vec![Buffer::F32(q.clone()), Buffer::I32(pos.clone()), Buffer::I32(seqs.clone()), Buffer::I32(flat.clone()), kc.clone(), vc.clone(), scratch, Buffer::F32(vec![0.0; n * qw])];
            run(&attention_paged(shape, paging, None), &mut b1, n as u64);
            let splits = 3;
            let scratch = Buffer::F32(vec![f32::NAN; n * shape.split_scratch_per_token(splits) as usize]);
            let partials = Buffer::F32(vec![f32::NAN; n * shape.partials_per_token(splits) as usize]);
            let mut b2 = vec![Buffer::F32(q.clone()), Buffer::I32(pos.clone()), Buffer::I32(seqs), Buffer::I32(flat), kc, vc, scratch, partials];
            run(&attention_paged(shape, paging, Some(splits)), &mut b2, n as u64);
            let mut b3 = vec![b2.swap_remove(7), Buffer::I32(pos), Buffer::F32(vec![f32::NAN; n * qw])];
            run(&attention_combine(shape, splits, SeqMode::Dynamic), &mut b3, n as u64);
            for got in [&b1[7], &b3[2]] {
                let Buffer::F32(got) = got else { unreachable!() };
                for (r, &(s, p)) in rows.iter().enumerate() {
                    // This sequence's rows up to position p, in position order.
                    let mine: Vec<usize> = (0..=p).map(|j| rows.iter().position(|&x| x == (s, j)).unwrap()).collect();
                    let from = window.map_or(0, |w| (p + 1).saturating_sub(w as usize));
                    for h in 0..shape.heads as usize {
                        let kvh = h / group;
                        let keys: Vec<&[f32]> = mine[from..].iter().map(|&j| &k[j * kvw + kvh * hd..j * kvw + kvh * hd + hd]).collect();
                        let vals: Vec<&[f32]> = mine[from..].iter().map(|&j| &v[j * kvw + kvh * hd..j * kvw + kvh * hd + hd]).collect();
                        let want = naive(&q[r * qw + h * hd..r * qw + h * hd + hd], &keys, &vals, shape.scale, softcap, None);
                        close(&got[r * qw + h * hd..r * qw + h * hd + hd], &want, 1e-5);
                    }
                }
            }
        }
    }

    #[test]
    fn grouped_query_attention_with_window_matches_naive_softmax() {
        let shape = AttentionShape { heads: 4, kv_heads: 2, head_dim: 4, scale: 0.5, window: Some(2), max_len: 8, softcap: None, causal: true, cache: ElemType::F32, keys: KeyLayout::Rows, sinks: false };
        check_attention(shape, 3, false, None);
    }

    /// An f16 KV cache: the stores keep the nearest half of every key and value
    /// (checked element by element), and attention (whole, split and merged)
    /// equals naive softmax attention over those halves.
    #[test]
    fn f16_cache_holds_rounded_values_and_attention_reads_them() {
        let shape = AttentionShape { heads: 6, kv_heads: 2, head_dim: 8, scale: 0.3, window: None, max_len: 80, softcap: None, causal: true, cache: ElemType::F16, keys: KeyLayout::Rows, sinks: false };
        for decode in [false, true] {
            check_attention(shape, 70, decode, None);
        }
        check_attention(shape, 80, false, Some(3));
    }

    /// Longer caches with windows that start past position 0, a cache that the
    /// sequence fills (max_len 16), and a cache longer than the sequence; prefill
    /// and token-by-token decode stores.
    #[test]
    fn attention_over_longer_caches_prefill_and_decode() {
        for (max_len, seq, window) in [(37, 37, None), (37, 30, Some(20)), (48, 40, Some(17)), (16, 16, None)] {
            let shape = AttentionShape { heads: 6, kv_heads: 2, head_dim: 8, scale: 0.3, window, max_len, softcap: None, causal: true, cache: ElemType::F32, keys: KeyLayout::Rows, sinks: false };
            for decode in [false, true] {
                check_attention(shape, seq, decode, None);
            }
        }
    }

    /// Flash-decoding: every token's positions in chunks (one chunk, several,
    /// chunks past the end, windows that start past position 0, soft-capping)
    /// merged by the combine kernel equal naive softmax attention.
    #[test]
    fn split_attention_and_combine_match_naive_softmax() {
        for (max_len, seq, window, splits, softcap) in [(8, 8, None, 1, None), (40, 40, None, 3, None), (150, 150, None, 4, None), (150, 140, Some(70), 2, Some(2.5)), (300, 300, Some(200), 16, None)] {
            let shape = AttentionShape { heads: 6, kv_heads: 2, head_dim: 8, scale: 0.3, window, max_len, softcap, causal: true, cache: ElemType::F32, keys: KeyLayout::Rows, sinks: false };
            check_attention(shape, seq, false, Some(splits));
        }
    }

    /// Attention sinks (gpt-oss): whole attention over key rows and panels
    /// (prefill and decode stores, a window), and split attention merged by
    /// the combine (CPU and GPU forms), equal naive softmax attention with each
    /// head's sink in the denominator; the canonical CPU form (panels) gives a
    /// row the bits flash-decoding's chunks and combine give it.
    #[test]
    fn attention_sinks_join_the_denominator_in_every_form() {
        for (max_len, seq, window, splits) in [(40, 37, None, None), (48, 40, Some(17), None), (150, 150, None, Some(4)), (150, 140, Some(70), Some(2))] {
            let shape = AttentionShape { heads: 6, kv_heads: 2, head_dim: 8, scale: 0.3, window, max_len, softcap: None, causal: true, cache: ElemType::F32, keys: KeyLayout::Rows, sinks: true };
            for decode in [false, true] {
                check_attention(shape, seq, decode, splits);
            }
        }
        // Canonical whole attention against split + combine, bit for bit, at a
        // length of several chunks.
        let shape = AttentionShape { heads: 6, kv_heads: 2, head_dim: 8, scale: 0.3, window: None, max_len: 320, softcap: None, causal: true, cache: ElemType::F32, keys: KeyLayout::Panels, sinks: true };
        let (seq, qw, kvw) = (300usize, 48usize, 16usize);
        let (q, k, vv) = (rand(seq * qw, 7), rand(seq * kvw, 8), rand(seq * kvw, 9));
        let sinks = Buffer::F32(rand(6, 10).iter().map(|x| 3.0 * x).collect());
        let pos = Buffer::I32((0..seq as i32).collect());
        let mut store = vec![Buffer::F32(k), Buffer::F32(vv), pos.clone(), Buffer::F32(vec![0.0; 320 * kvw]), Buffer::F32(vec![0.0; 320 * kvw])];
        run(&kv_store(2, 8, 320, ElemType::F32, KeyLayout::Panels, SeqMode::Dynamic), &mut store, seq as u64);
        let (kc, vc) = (store[3].clone(), store[4].clone());
        let scratch = Buffer::F32(vec![f32::NAN; seq * 2 * shape.scratch_per_task() as usize]);
        let mut whole = vec![Buffer::F32(q.clone()), pos.clone(), kc.clone(), vc.clone(), sinks.clone(), scratch, Buffer::F32(vec![0.0; seq * qw])];
        run(&attention(shape, SeqMode::Dynamic), &mut whole, seq as u64);
        let scratch = Buffer::F32(vec![f32::NAN; seq * shape.split_scratch_per_token(DECODE_SPLITS) as usize]);
        let partials = Buffer::F32(vec![f32::NAN; seq * shape.partials_per_token(DECODE_SPLITS) as usize]);
        let mut split = vec![Buffer::F32(q), pos.clone(), kc, vc, scratch, partials];
        run(&attention_partial(shape, DECODE_SPLITS, SeqMode::Dynamic), &mut split, seq as u64);
        let mut merged = vec![split.swap_remove(5), pos, sinks, Buffer::F32(vec![f32::NAN; seq * qw])];
        run(&attention_combine(shape, DECODE_SPLITS, SeqMode::Dynamic), &mut merged, seq as u64);
        assert_eq!(whole[6], merged[3], "canonical attention and flash-decoding differ with sinks");
    }
}
