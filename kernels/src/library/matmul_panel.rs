//! Matmul / GEMV on panel-packed float weights: `out[m, n] = x[m, k] @ w[n, k]^T`
//! with `w` stored as `[n / PANEL][k][PANEL]` (the weight-layout pass packs it so
//! at compile time; docs/mef.md, layout `panel16`). The elements are f32, bf16 or
//! f16 values, or fp8 e4m3fn codes with one scale per output column
//! ([`PanelWeights`]): a code decodes to a half's bits in two integer operations
//! and one conversion (`dequant::e4m3_half_bits_of_signed`), and the column's
//! scale multiplies the sum once, in the epilogue.
//!
//! For each k, a task broadcasts one activation per row against [`PANEL`]
//! consecutive weights of each of its panels and accumulates [`PANEL`] outputs per
//! register: no horizontal reductions, and every weight load is a contiguous
//! vector. A task owns [`PANELS_PER_TASK`] panels; in prefill they are walked in
//! [`RegisterTile`]s of `rows` x `panels` (sized to the target's registers:
//! [`RegisterTile::for_float_panels`]), so
//! each weight vector feeds `rows` FMAs and each broadcast activation `panels`;
//! decode takes one row and all of the task's panels, and prefetches each panel's
//! weights `DECODE_PREFETCH_BYTES` ahead (`matmul_interleaved.rs`), since it
//! streams every weight once; so do steps of few rows (`FEW_ROWS`, the batched
//! engine's decode steps), one panel at a time in tiles of the prefill tile's
//! rows ([`panel_tasks_by_rows`]).

use maxc_format::WeightEncoding;

use super::dequant::e4m3_half_bits_of_signed;
use super::elementwise::Broadcast;
use super::matmul_interleaved::{DECODE_PREFETCH_BYTES, FEW_ROWS};
use super::matmul::{epilogue, float_suffix, row_range_tiles, TaskRows, TileBuilder};
use super::{RegisterTile, SeqMode};
use crate::ir::dsl::*;
use crate::ir::*;

/// Output columns per panel (one 512-bit register of f32).
pub const PANEL: u64 = 16;
/// Panels per task.
pub const PANELS_PER_TASK: u64 = 2;

/// What a panel's elements are.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PanelWeights {
    /// Values: `F32`, `BF16` or `F16` elements.
    Float(ElemType),
    /// fp8 e4m3fn codes, read as signed bytes (`I8`: the sign extension is half
    /// the decoding), and a parameter of one f32 scale per output column (the
    /// `float8_e4m3fn` encoding: weight-only, per channel).
    Float8E4M3,
    /// `BF16` elements multiplied in pairs of k with the activations rounded to
    /// bfloat16 (`x` is then a bf16 parameter, [`round_bf16`]'s output): one
    /// [`Stmt::PairDot`] per two k of a tile cell, `vdpbf16ps` on x86 with
    /// AVX512_BF16, which does twice the multiply-adds of an f32 FMA per
    /// instruction. `k` must be even.
    ///
    /// [`round_bf16`]: super::quantize_activations::round_bf16
    BFloat16Pairs,
}

impl PanelWeights {
    /// The panel form of weights stored in `encoding`, if it has one.
    pub fn of(encoding: WeightEncoding) -> Option<PanelWeights> {
        match encoding {
            WeightEncoding::Float32 => Some(PanelWeights::Float(ElemType::F32)),
            WeightEncoding::BFloat16 => Some(PanelWeights::Float(ElemType::BF16)),
            WeightEncoding::Float16 => Some(PanelWeights::Float(ElemType::F16)),
            WeightEncoding::Float8E4M3 => Some(PanelWeights::Float8E4M3),
            WeightEncoding::Q8_0 | WeightEncoding::Q4_0 | WeightEncoding::Q4_1 | WeightEncoding::Q4K | WeightEncoding::Q5_0 | WeightEncoding::Q5_1 | WeightEncoding::Q6K | WeightEncoding::Q5K => None,
        }
    }

    /// Bytes per stored weight.
    pub(super) fn elem_bytes(self) -> i64 {
        match self {
            PanelWeights::Float(elem) => elem.size() as i64,
            PanelWeights::Float8E4M3 => 1,
            PanelWeights::BFloat16Pairs => 2,
        }
    }

    /// The kernel-name suffix (`""`, `_bf16`, `_f16`, `_float8_e4m3fn`).
    pub(super) fn suffix(self) -> &'static str {
        match self {
            PanelWeights::Float(elem) => float_suffix(elem),
            PanelWeights::Float8E4M3 => "_float8_e4m3fn",
            PanelWeights::BFloat16Pairs => "_bf16_pairs",
        }
    }
}

/// The weight parameters of a panel matmul: the panels, and the column scales of fp8 codes.
#[derive(Copy, Clone)]
pub(super) struct PanelParams {
    w: ParamId,
    scales: Option<ParamId>,
    /// bfloat16 weights, widened a panel row at a time ([`Stmt::WidenBf16`]).
    bf16: bool,
}

impl PanelParams {
    /// Declares the weight's parameters: `w` (fp8: `w.quants`, `w.scales`).
    pub(super) fn declare(b: &mut KernelBuilder, weights: PanelWeights) -> PanelParams {
        match weights {
            PanelWeights::Float(elem) => PanelParams { w: b.param("w", elem, false), scales: None, bf16: elem == ElemType::BF16 },
            PanelWeights::BFloat16Pairs => PanelParams { w: b.param("w", ElemType::BF16, false), scales: None, bf16: false },
            PanelWeights::Float8E4M3 => PanelParams { w: b.param("w.quants", ElemType::I8, false), scales: Some(b.param("w.scales", ElemType::F32, false)), bf16: false },
        }
    }

    /// Element `index` of the panels as f32, up to the column factor [`Self::finish`] applies.
    pub(super) fn element(self, index: Expr) -> Expr {
        match self.scales {
            None => ld(self.w, index),
            // The code's value times 2^-8; the factor 256 rides on the column scale.
            Some(_) => un(UnOp::HalfBitsToF32, e4m3_half_bits_of_signed(ld(self.w, index))),
        }
    }

    /// Column `col`'s sum of [`Self::element`] products, scaled to the output.
    pub(super) fn finish(self, sum: Expr, col: Expr) -> Expr {
        match self.scales {
            None => sum,
            Some(scales) => mul(sum, mul(ld(scales, col), f(256.0))),
        }
    }
}

/// A tile's accumulators, one local of [`PANEL`] per row and panel, and the
/// statements that zero them (`l`: the lane variable).
fn zeroed_accumulators(b: &mut KernelBuilder, rows: i64, panels: i64, l: VarId) -> (Vec<Vec<LocalId>>, Vec<Stmt>) {
    let acc: Vec<Vec<LocalId>> = (0..rows).map(|_| (0..panels).map(|_| b.local(PANEL)).collect()).collect();
    let zero = acc.iter().flatten().map(|&a| for_vec(l, i(0), i(PANEL as i64), vec![store(a, v(l), f(0.0))])).collect();
    (acc, zero)
}

/// Weight panel `p0 + p`: of the whole tensor, or (`wp`, the grouped expert
/// matmuls of `moe.rs`) of the expert whose first panel is `wp`.
fn weight_panel(wp: Option<VarId>, p0: VarId, p: i64) -> Expr {
    match wp {
        None => add(v(p0), i(p)),
        Some(wp) => add(v(wp), add(v(p0), i(p))),
    }
}

/// Sets each of `bases` to where weight panel `p0 + p`'s row `kk` starts (and
/// prefetches the weights `prefetch_ahead` elements past it).
fn panel_row_starts(bases: &[VarId], (wp, p0): (Option<VarId>, VarId), (k, kk): (i64, Expr), w: PanelParams, prefetch_ahead: Option<i64>) -> Vec<Stmt> {
    let mut stmts = Vec::new();
    for (p, &base) in bases.iter().enumerate() {
        stmts.push(set(base, mul(add(mul(weight_panel(wp, p0, p as i64), i(k)), kk.clone()), i(PANEL as i64))));
        if let Some(ahead) = prefetch_ahead {
            stmts.push(prefetch(w.w, add(v(base), i(ahead))));
        }
    }
    stmts
}

/// Each accumulator's finished sum (plus the addend) stored to its row's outputs.
fn stored_tile(acc: &[Vec<LocalId>], l: VarId, (r0, wp, p0): (VarId, Option<VarId>, VarId), (w, out): (PanelParams, ParamId), n: i64, addend: Option<(ParamId, Broadcast)>) -> Vec<Stmt> {
    let lanes = PANEL as i64;
    let mut stmts = Vec::new();
    for (r, row_acc) in acc.iter().enumerate() {
        for (p, &a) in row_acc.iter().enumerate() {
            let row = add(v(r0), i(r as i64));
            let col = add(mul(add(v(p0), i(p as i64)), i(lanes)), v(l));
            // The weight's own column (an expert's is past the earlier experts').
            let w_col = match wp {
                None => col.clone(),
                Some(_) => add(mul(weight_panel(wp, p0, p as i64), i(lanes)), v(l)),
            };
            let value = epilogue(w.finish(ld(a, v(l)), w_col), row.clone(), col.clone(), n, addend);
            stmts.push(for_vec(l, i(0), i(lanes), vec![store(out, add(v(l), add(mul(row, i(n)), mul(add(v(p0), i(p as i64)), i(lanes)))), value)]));
        }
    }
    stmts
}

/// The tile `rows x panels` at row `r0` and first panel `p0` (variables; the
/// weights' panels counted from `wp` when set, an expert's first).
#[allow(clippy::too_many_arguments)]
pub(super) fn tile(b: &mut KernelBuilder, rows: i64, panels: i64, r0: VarId, (wp, p0): (Option<VarId>, VarId), (x, w, out): (ParamId, PanelParams, ParamId), (k, n): (i64, i64), addend: Option<(ParamId, Broadcast)>, prefetch_ahead: Option<i64>) -> Vec<Stmt> {
    let (l, kk) = (b.var(ValType::I64), b.var(ValType::I64));
    let (acc, mut body) = zeroed_accumulators(b, rows, panels, l);
    let xs: Vec<VarId> = (0..rows).map(|_| b.var(ValType::F32)).collect();
    let bases: Vec<VarId> = (0..panels).map(|_| b.var(ValType::I64)).collect();
    let mut per_k = Vec::new();
    for (r, &xv) in xs.iter().enumerate() {
        per_k.push(set(xv, ld(x, add(mul(add(v(r0), i(r as i64)), i(k)), v(kk)))));
    }
    // Panel (p0 + p), row kk: PANEL consecutive weights (bfloat16 ones widened
    // to f32 once per panel row, as the target does it cheapest).
    per_k.extend(panel_row_starts(&bases, (wp, p0), (k, v(kk)), w, prefetch_ahead));
    let widened: Option<Vec<LocalId>> = w.bf16.then(|| (0..panels).map(|_| b.local(PANEL)).collect());
    for (p, &dst) in widened.iter().flatten().enumerate() {
        per_k.push(Stmt::WidenBf16 { dst, weights: w.w, start: v(bases[p]) });
    }
    // One lane loop for the whole tile: its body is too big for LLVM to unroll it
    // away before vectorizing, so the loop over k stays the outer loop.
    let mut lane_body = Vec::new();
    for (r, row_acc) in acc.iter().enumerate() {
        for (p, &a) in row_acc.iter().enumerate() {
            // The lane is the first operand of the index (see dequant.rs: LLVM keeps it consecutive).
            let wv = match &widened {
                Some(rows) => ld(rows[p], v(l)),
                None => w.element(add(v(l), v(bases[p]))),
            };
            lane_body.push(store(a, v(l), add(ld(a, v(l)), mul(v(xs[r]), wv))));
        }
    }
    per_k.push(for_vec(l, i(0), i(PANEL as i64), lane_body));
    body.push(for_(kk, i(0), i(k), per_k));
    body.extend(stored_tile(&acc, l, (r0, wp, p0), (w, out), n, addend));
    body
}

/// [`tile`] for [`PanelWeights::BFloat16Pairs`]: per two k, one pair dot per
/// cell (the panel's rows `kk` and `kk + 1` against the row's two bf16
/// activations), so each cell sums its k in the same order in every tile.
#[allow(clippy::too_many_arguments)]
pub(super) fn pair_tile(b: &mut KernelBuilder, rows: i64, panels: i64, r0: VarId, (wp, p0): (Option<VarId>, VarId), (x, w, out): (ParamId, PanelParams, ParamId), (k, n): (i64, i64), addend: Option<(ParamId, Broadcast)>, prefetch_ahead: Option<i64>) -> Vec<Stmt> {
    let (l, kp) = (b.var(ValType::I64), b.var(ValType::I64));
    let (acc, mut body) = zeroed_accumulators(b, rows, panels, l);
    let bases: Vec<VarId> = (0..panels).map(|_| b.var(ValType::I64)).collect();
    let kk = mul(v(kp), i(2));
    // Panel (p0 + p), rows kk and kk + 1: 2 x PANEL consecutive weights.
    let mut per_pair = panel_row_starts(&bases, (wp, p0), (k, kk.clone()), w, prefetch_ahead);
    for (r, row_acc) in acc.iter().enumerate() {
        for (p, &a) in row_acc.iter().enumerate() {
            let act_start = add(mul(add(v(r0), i(r as i64)), i(k)), kk.clone());
            per_pair.push(Stmt::PairDot { acc: a, weights: w.w, w_start: v(bases[p]), act: x, act_start });
        }
    }
    body.push(for_(kp, i(0), i(k / 2), per_pair));
    body.extend(stored_tile(&acc, l, (r0, wp, p0), (w, out), n, addend));
    body
}

/// The task structure of the panel-shaped matmuls (this file's and
/// `matmul_interleaved.rs`): task `t` owns `panels_per_task` panels of [`PANEL`]
/// output columns (`n` a multiple of [`PANEL`]), walked `register_tile.panels`
/// at a time (all together at decode); `tile(b, rows, panels, r0, p0)` runs over
/// `row_tiles` (`matmul.rs`) of `register_tile.rows` rows; a last task with fewer panels
/// takes them one at a time. Returns the body, the task count and the task variable.
pub(super) fn panel_tasks(b: &mut KernelBuilder, n: u64, seq: SeqMode, panels_per_task: i64, register_tile: RegisterTile, tile: &mut TileBuilder<'_>) -> (Vec<Stmt>, TaskCount, VarId) {
    let (t, p0, pp, rb, r0) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let panels_total = (n / PANEL) as i64;
    let mut body = vec![set(p0, mul(v(t), i(panels_per_task)))];
    body.extend(task_panels(b, panels_total, &TaskRows::of(seq), panels_per_task, register_tile, (p0, pp, rb, r0), tile));
    (body, TaskCount { per_seq: 0, fixed: (panels_total as u64).div_ceil(panels_per_task as u64) }, t)
}

/// The body of one [`panel_tasks`] task whose first panel `p0` is set: its
/// `panels_per_task` panels (of `panels_total`) over `rows`, in tiles of
/// `register_tile` (all of the task's panels together at decode), a last task
/// with fewer panels taking them one at a time (`pp`); `rb`, `r0` as
/// `row_tiles` takes them.
pub(super) fn task_panels(b: &mut KernelBuilder, panels_total: i64, rows: &TaskRows, panels_per_task: i64, register_tile: RegisterTile, (p0, pp, rb, r0): (VarId, VarId, VarId, VarId), tile: &mut TileBuilder<'_>) -> Vec<Stmt> {
    let group = if rows.decode { panels_per_task } else { register_tile.panels };
    assert!(group > 0 && panels_per_task % group == 0, "a task's {panels_per_task} panels are not whole tiles of {group}");
    let mut all = Vec::new();
    for first in (0..panels_per_task).step_by(group as usize) {
        // The tile's first panel: the task's first, or a variable set to a later one.
        let tile_p0 = if first == 0 {
            p0
        } else {
            let at = b.var(ValType::I64);
            all.push(set(at, add(v(p0), i(first))));
            at
        };
        all.extend(row_range_tiles(b, rows, register_tile.rows, (rb, r0), &mut |b, rows| tile(b, rows, group, r0, tile_p0)));
    }
    let single = row_range_tiles(b, rows, register_tile.rows, (rb, r0), &mut |b, rows| tile(b, rows, 1, r0, pp));
    vec![
        if_(le(add(v(p0), i(panels_per_task)), i(panels_total)), all),
        // The leftover panels one at a time.
        if_(lt(v(p0), i(panels_total)), vec![if_(lt(i(panels_total), add(v(p0), i(panels_per_task))), vec![for_(pp, v(p0), i(panels_total), single)])]),
    ]
}

/// [`panel_tasks`] for a kernel whose steps of few rows (at most [`FEW_ROWS`])
/// take their own tile and tile builder (`few`: one panel at a time, prefetched
/// ahead) and steps of more rows the prefill tile (`many`). A fixed row count
/// builds only the structure it runs (decode: `many`'s); a dynamic one branches
/// on the step's rows over both, which share the task count and variable.
pub(super) fn panel_tasks_by_rows(b: &mut KernelBuilder, n: u64, seq: SeqMode, panels_per_task: i64, (many_tile, few_tile): (RegisterTile, RegisterTile), many: &mut TileBuilder<'_>, few: &mut TileBuilder<'_>) -> (Vec<Stmt>, TaskCount, VarId) {
    match seq {
        SeqMode::Fixed(rows) if rows > 1 && rows as i64 <= FEW_ROWS => panel_tasks(b, n, seq, panels_per_task, few_tile, few),
        SeqMode::Fixed(_) => panel_tasks(b, n, seq, panels_per_task, many_tile, many),
        SeqMode::Dynamic => {
            let (many, tasks, t) = panel_tasks(b, n, seq, panels_per_task, many_tile, many);
            let (few, _, t_few) = panel_tasks(b, n, seq, panels_per_task, few_tile, few);
            let few: Vec<Stmt> = std::iter::once(set(t_few, v(t))).chain(few).collect();
            (vec![if_(le(seq.expr(), i(FEW_ROWS)), few), if_(lt(i(FEW_ROWS), seq.expr()), many)], tasks, t)
        }
    }
}

/// `x: f32[seq, k]` times `w` packed as `[n/PANEL][k][PANEL]` (elements as
/// `weights` says), plus `r` broadcast as given when `addend` is set, in prefill
/// register tiles of `register_tile`. `n` must be a multiple of [`PANEL`].
/// Params: `x`, `w`, `scales` (fp8 only), `r`?, `out`.
pub fn matmul_panel(k: u64, n: u64, weights: PanelWeights, addend: Option<Broadcast>, seq: SeqMode, register_tile: RegisterTile) -> Kernel {
    let mut b = KernelBuilder::new();
    let (x, w, addend, out) = panel_params(&mut b, n, weights, addend);
    let (ki, ni) = (k as i64, n as i64);
    let bufs = (x, w, out);
    let elem_bytes = weights.elem_bytes();
    let tile = if weights == PanelWeights::BFloat16Pairs {
        assert_eq!(k % 2, 0, "bfloat16 pair dots need an even k, not {k}");
        pair_tile
    } else {
        tile
    };
    // Decode streams every weight once: each panel's next weights are prefetched
    // DECODE_PREFETCH_BYTES ahead (prefill reuses each weight vector for a tile's rows).
    let prefetch = seq.is_decode().then_some(DECODE_PREFETCH_BYTES / elem_bytes);
    let register_tile = register_tile.for_float_panels();
    // Steps of few rows stream their weights as decode does: one panel at a
    // time, prefetched as far ahead (`FEW_ROWS`).
    let few_tile = RegisterTile { panels: 1, ..register_tile };
    let (body, tasks, t) = panel_tasks_by_rows(
        &mut b,
        n,
        seq,
        PANELS_PER_TASK as i64,
        (register_tile, few_tile),
        &mut |b, rows, panels, r0, p0| tile(b, rows, panels, r0, (None, p0), bufs, (ki, ni), addend, prefetch),
        &mut |b, rows, panels, r0, p0| tile(b, rows, panels, r0, (None, p0), bufs, (ki, ni), addend, Some(DECODE_PREFETCH_BYTES / elem_bytes)),
    );
    let enc = weights.suffix();
    let shape = format!("k{k}_n{n}_{}{}", seq.tag(), tile_tag(seq, register_tile, few_tile));
    let name = match addend {
        None => format!("matmul_panel{enc}_{shape}"),
        Some((_, bc)) => format!("matmul_add_panel{enc}_{}_{shape}", format!("{bc:?}").to_lowercase()),
    };
    b.finish(name, "matmul", tasks, t, body)
}

/// The GPU form of [`matmul_panel`] for artifacts that carry CPU code too (their
/// weights are packed for the CPU): each output is one dot product over k, a
/// plain reduction the GPU mapping deals to a warp's lanes, where the CPU form's
/// per-lane local accumulators would keep every thread doing the same work.
/// Same parameters, tasks and result as [`matmul_panel`].
pub fn matmul_panel_rowwise(k: u64, n: u64, weights: PanelWeights, addend: Option<Broadcast>, seq: SeqMode) -> Kernel {
    let mut b = KernelBuilder::new();
    let (x, w, addend, out) = panel_params(&mut b, n, weights, addend);
    let (t, j, r, kk, acc) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::F32));
    let (ki, ni, lanes) = (k as i64, n as i64, PANEL as i64);
    // Column j is lane j % PANEL of panel j / PANEL: element [j / PANEL][kk][j % PANEL].
    let weight = w.element(add(mul(add(mul(div(v(j), i(lanes)), i(ki)), v(kk)), i(lanes)), rem(v(j), i(lanes))));
    let dot = vec![
        set(acc, f(0.0)),
        for_vec(kk, i(0), i(ki), vec![set(acc, add(v(acc), mul(ld(x, add(mul(v(r), i(ki)), v(kk))), weight)))]),
        store(out, add(mul(v(r), i(ni)), v(j)), epilogue(w.finish(v(acc), v(j)), v(r), v(j), ni, addend)),
    ];
    let per_task = (PANELS_PER_TASK * PANEL) as i64;
    let first = mul(v(t), i(per_task));
    let body = vec![for_(j, first.clone(), min(add(first, i(per_task)), i(ni)), vec![for_(r, i(0), seq.expr(), dot)])];
    let tasks = TaskCount { per_seq: 0, fixed: (n / PANEL).div_ceil(PANELS_PER_TASK) };
    let enc = weights.suffix();
    let name = match addend {
        None => format!("matmul_panel_rows{enc}_k{k}_n{n}_{}", seq.tag()),
        Some((_, bc)) => format!("matmul_add_panel_rows{enc}_{}_k{k}_n{n}_{}", format!("{bc:?}").to_lowercase(), seq.tag()),
    };
    b.finish(name, "matmul", tasks, t, body)
}

/// The register tiles' name suffix where they shape the kernel (not at decode):
/// the tile of many rows, then `_f{rows}x{panels}`, the tile of few rows'.
pub(super) fn tile_tag(seq: SeqMode, many: RegisterTile, few: RegisterTile) -> String {
    if seq.is_decode() {
        String::new()
    } else {
        format!("{}_f{}x{}", many.tag(), few.rows, few.panels)
    }
}

/// The parameters of a panel matmul: `x`, `w`, `scales` (fp8), `r`?, `out`.
fn panel_params(b: &mut KernelBuilder, n: u64, weights: PanelWeights, addend: Option<Broadcast>) -> (ParamId, PanelParams, Option<(ParamId, Broadcast)>, ParamId) {
    assert_eq!(n % PANEL, 0, "panel-packed weights need n to be a multiple of {PANEL}");
    let x = b.param("x", if weights == PanelWeights::BFloat16Pairs { ElemType::BF16 } else { ElemType::F32 }, false);
    let w = PanelParams::declare(b, weights);
    let addend = addend.map(|bc| (b.param("r", ElemType::F32, false), bc));
    let out = b.param("out", ElemType::F32, true);
    (x, w, addend, out)
}

/// Packs row-major `w[n, k]` (elements of `elem_size` bytes) into `[n/PANEL][k][PANEL]`.
pub fn pack_panels(bytes: &[u8], n: usize, k: usize, elem_size: usize) -> Vec<u8> {
    let p = PANEL as usize;
    assert_eq!(bytes.len(), n * k * elem_size);
    let mut out = vec![0u8; bytes.len()];
    for j in 0..n {
        let (panel, lane) = (j / p, j % p);
        for kk in 0..k {
            let src = (j * k + kk) * elem_size;
            let dst = ((panel * k + kk) * p + lane) * elem_size;
            out[dst..dst + elem_size].copy_from_slice(&bytes[src..src + elem_size]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{run, Buffer};
    use crate::library::test_util::*;

    /// A decode GEMV's name carries no register tile (`tile_tag`), so its IR
    /// must not depend on one: an artifact's symbols, and the tests' shared
    /// compiles, find a kernel by its name.
    #[test]
    fn decode_kernels_are_the_same_for_every_register_tile() {
        for weights in [PanelWeights::Float(ElemType::F32), PanelWeights::Float(ElemType::BF16), PanelWeights::Float(ElemType::F16), PanelWeights::Float8E4M3, PanelWeights::BFloat16Pairs] {
            for addend in [None, Some(Broadcast::None)] {
                let zmm = matmul_panel(64, 32, weights, addend, SeqMode::Fixed(1), RegisterTile::ZMM);
                let ymm = matmul_panel(64, 32, weights, addend, SeqMode::Fixed(1), RegisterTile::YMM);
                assert!(zmm == ymm, "{} differs between the AVX-512 and the AVX2 tile", zmm.name);
            }
        }
    }

    /// An fp8 e4m3fn code's value, from the format's definition.
    fn e4m3_reference(code: u8) -> f32 {
        let (e, m) = (((code >> 3) & 15) as i32, (code & 7) as f32);
        let magnitude = if e == 0 { m / 8.0 * 2f32.powi(-6) } else { (1.0 + m / 8.0) * 2f32.powi(e - 7) };
        if code & 0x80 != 0 {
            -magnitude
        } else {
            magnitude
        }
    }

    /// bfloat16 pair dots, every task shape, row tile and addend, against the
    /// naive product of the activations rounded to bfloat16 (the `half`
    /// crate's rounding) and the weights, at k = 10 (an odd count of pairs).
    #[test]
    fn pair_dots_match_the_naive_product_of_rounded_activations() {
        let (k, n) = (10usize, 48usize);
        let bf16 = |v: &[f32]| v.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect::<Vec<u16>>();
        let value = |b: &[u16]| b.iter().map(|&h| half::bf16::from_bits(h).to_f32()).collect::<Vec<f32>>();
        let w_bits = bf16(&rand(n * k, 2));
        let w_bytes: Vec<u8> = w_bits.iter().flat_map(|h| h.to_le_bytes()).collect();
        let packed: Vec<u16> = pack_panels(&w_bytes, n, k, 2).chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        for ((m, seq, addend), register_tile) in panel_cases() {
            let x_bits = bf16(&rand(m * k, 1));
            let r = rand(if addend == Some(Broadcast::Row) { n } else { m * n }, 5);
            let mut bufs = matmul_buffers(&[], &[Buffer::BF16(packed.clone())], &r, addend, m * n);
            bufs[0] = Buffer::BF16(x_bits.clone());
            run(&matmul_panel(k as u64, n as u64, PanelWeights::BFloat16Pairs, addend, seq, register_tile), &mut bufs, m as u64);
            let Some(Buffer::F32(got)) = bufs.pop() else { unreachable!() };
            close(&got, &naive_matmul(&value(&x_bits), &value(&w_bits), &r, (m, k, n), addend), 1e-5);
        }
    }

    /// Float32 panels and fp8 codes with column scales, every task shape, row
    /// tile and addend, packed and row-wise forms, against the naive product of
    /// the decoded row-major weights.
    #[test]
    fn packed_matmul_matches_the_naive_one() {
        // 48 columns = one full task (2 panels) and one single panel; 6 rows = a
        // row tile and 2 more.
        let (k, n) = (9usize, 48usize);
        let values = rand(n * k, 2);
        let value_bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        // Every code but the NaNs (0x7f, 0xff), subnormals and both signs included.
        let codes: Vec<u8> = (0..n * k).map(|i| (i * 37 % 256) as u8).map(|c| if c & 0x7f == 0x7f { c ^ 1 } else { c }).collect();
        // Decoded weights of magnitude at most 448 * 0.0017 (about 0.76), like the float ones.
        let scales: Vec<f32> = (0..n).map(|j| 0.001 + j as f32 / 65536.0).collect();
        let decoded: Vec<f32> = codes.iter().enumerate().map(|(i, &c)| e4m3_reference(c) * scales[i / k]).collect();
        let forms = [
            (PanelWeights::Float(ElemType::F32), values.clone(), vec![Buffer::F32(pack_panels(&value_bytes, n, k, 4).chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())]),
            (PanelWeights::Float8E4M3, decoded, vec![Buffer::I8(pack_panels(&codes, n, k, 1).into_iter().map(|c| c as i8).collect()), Buffer::F32(scales.clone())]),
        ];
        for (weights, w, packed) in forms {
            for ((m, seq, addend), register_tile) in panel_cases() {
                let x = rand(m * k, 1);
                let r = rand(if addend == Some(Broadcast::Row) { n } else { m * n }, 5);
                let mut bufs = matmul_buffers(&x, &packed, &r, addend, m * n);
                let mut rowwise = bufs.clone();
                run(&matmul_panel(k as u64, n as u64, weights, addend, seq, register_tile), &mut bufs, m as u64);
                run(&matmul_panel_rowwise(k as u64, n as u64, weights, addend, seq), &mut rowwise, m as u64);
                let Some(Buffer::F32(got)) = bufs.pop() else { unreachable!() };
                let Some(Buffer::F32(got_rowwise)) = rowwise.pop() else { unreachable!() };
                let want = naive_matmul(&x, &w, &r, (m, k, n), addend);
                close(&got, &want, 1e-5);
                close(&got_rowwise, &want, 1e-5);
            }
        }
    }
}
