//! Mixture-of-experts kernels: the router's logits and top-k, the grouping of
//! a step's rows by expert, the expert-gathering matmuls and the weighted sum.

/// How a router's logits over the experts become the chosen experts and their
/// weights: the family's rule (one vocabulary for the graph IR's `moe` op and
/// its kernels).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum MoeRouting {
    /// The softmax over every expert's logit, then the `top_k` largest
    /// probabilities; with `renormalize` those divided by their sum (Qwen3-MoE
    /// with `norm_topk_prob`, llama.cpp's `norm_w`), else as they are.
    SoftmaxTopK { renormalize: bool },
    /// The `top_k` largest logits, then the softmax over them (Mixtral,
    /// gpt-oss): the same weights as the renormalized softmax, computed from
    /// the chosen logits only.
    TopKSoftmax,
}

impl MoeRouting {
    /// The name the graph's text form and kernel names use.
    pub fn name(self) -> &'static str {
        match self {
            MoeRouting::SoftmaxTopK { renormalize: false } => "softmax_topk",
            MoeRouting::SoftmaxTopK { renormalize: true } => "softmax_topk_norm",
            MoeRouting::TopKSoftmax => "topk_softmax",
        }
    }

    /// The rule named `name` ([`MoeRouting::name`]).
    pub fn from_name(name: &str) -> Option<MoeRouting> {
        [MoeRouting::SoftmaxTopK { renormalize: false }, MoeRouting::SoftmaxTopK { renormalize: true }, MoeRouting::TopKSoftmax].into_iter().find(|r| r.name() == name)
    }
}

/// The experts' activation between their gate-and-up and down projections,
/// on an expert's `[g; u]` (its gate rows' outputs, then its up rows').
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum MoeActivation {
    /// `silu(g) * u` (Qwen3-MoE, Mixtral).
    SwiGlu,
    /// gpt-oss: `g' = min(g, limit)`, `u' = clamp(u, -limit, limit)`, then
    /// `(u' + 1) * g' * sigmoid(alpha * g')` (transformers' `GptOssExperts`).
    ClampedSwiGlu { alpha: f32, limit: f32 },
}

impl MoeActivation {
    /// The name the graph's text form uses.
    pub fn name(self) -> &'static str {
        match self {
            MoeActivation::SwiGlu => "swiglu",
            MoeActivation::ClampedSwiGlu { .. } => "clamped_swiglu",
        }
    }

    /// The tag kernel names carry: the activation with its constants.
    fn tag(self) -> String {
        match self {
            MoeActivation::SwiGlu => "swiglu".into(),
            MoeActivation::ClampedSwiGlu { alpha, limit } => format!("cswiglu_a{:08x}_l{:08x}", alpha.to_bits(), limit.to_bits()),
        }
    }

    /// The activation of one `(g, u)` pair, in the kernel IR.
    fn apply(self, g: Expr, u: Expr) -> Expr {
        match self {
            MoeActivation::SwiGlu => mul(div(g.clone(), add(f(1.0), fast_exp(un(UnOp::Neg, g)))), u),
            MoeActivation::ClampedSwiGlu { alpha, limit } => {
                let g = min(g, f(limit));
                let u = max(min(u, f(limit)), f(-limit));
                let glu = div(g.clone(), add(f(1.0), fast_exp(un(UnOp::Neg, mul(g, f(alpha))))));
                mul(add(u, f(1.0)), glu)
            }
        }
    }
}

use maxc_format::WeightEncoding;

use super::dequant::{declare, declare_interleaved, WeightParams, INTERLEAVED_ROWS};
use super::matmul::{TaskRows, TileBuilder};
use super::matmul_interleaved::{interleaved_tiles, reads_half_sums, DECODE_PREFETCH_BYTES, FEW_ROWS};
use super::matmul_panel::{task_panels, tile_tag, PanelParams, PanelWeights, PANEL};
use super::quantize_activations::ActivationLevels;
use super::{RegisterTile, SeqMode};
use crate::ir::dsl::*;
use crate::ir::*;

/// Panels of 16 output columns per task of the grouped matmuls.
pub const PANELS_PER_TASK: i64 = 2;

/// Output columns per task of [`moe_matmul_rows`].
pub const ROW_MAJOR_COLS: u64 = 16;

/// `a || b` on booleans.
fn or(a: Expr, b: Expr) -> Expr {
    select(a.clone(), a, b)
}

/// `a && b` on booleans.
fn and_also(a: Expr, b: Expr) -> Expr {
    select(a.clone(), b, a)
}

/// The router's logits: `x: f32[rows, k]`, `router: [experts, k]` (in
/// `encoding`, row-major), with `biased` `router_bias: f32[experts]` (added
/// after the dot product, as `F.linear` does) -> `logits: f32[rows,
/// experts]`, one task per row.
/// A row's logits come from this one kernel in every plan (it does not depend
/// on the step's length), so they are the same bits alone and in a batch
/// whatever the backend does with its sums: the choice of experts compares them.
pub fn moe_router(k: u64, experts: u64, encoding: WeightEncoding, biased: bool) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let w = declare(&mut b, "router", encoding, k);
    let bias = biased.then(|| b.param("router_bias", ElemType::F32, false));
    let logits = b.param("logits", ElemType::F32, true);
    let (t, e, kk, acc) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::F32));
    let ki = k as i64;
    let body = vec![for_(
        e,
        i(0),
        i(experts as i64),
        vec![
            set(acc, f(0.0)),
            for_vec(kk, i(0), i(ki), vec![set(acc, add(v(acc), mul(ld(x, add(v(kk), mul(v(t), i(ki)))), w.value(v(e), v(kk)))))]),
            store(logits, add(v(e), mul(v(t), i(experts as i64))), bias.map_or(v(acc), |bias| add(v(acc), ld(bias, v(e))))),
        ],
    )];
    let tag = if biased { "_bias" } else { "" };
    b.finish(format!("moe_router_{}_e{experts}_k{k}{tag}", encoding.name()), "moe", TaskCount { per_seq: 1, fixed: 0 }, t, body)
}

/// The router of a row: `logits: f32[rows, experts]` -> `ids: i32[rows, top_k]`
/// (the chosen experts in rank order: the largest logit first, ties to the
/// lower index), `weights: f32[rows, top_k]` (by `routing`). One task per
/// row, whatever the step's length, in the IR's float order: a row gets the
/// same experts and the same weights in every plan (batch invariance). Pick
/// `j` is the largest logit below pick `j - 1` in the order (logit
/// descending, index ascending), found by one scan of the row, so that no
/// scratch marks the experts taken. An expert's exponential is `fast_exp` of
/// its logit minus the row's largest.
pub fn moe_route(experts: u64, top_k: u64, routing: MoeRouting) -> Kernel {
    assert!(top_k >= 1 && top_k <= experts, "top {top_k} of {experts} experts");
    let mut b = KernelBuilder::new();
    b.keep_float_order();
    let logits = b.param("logits", ElemType::F32, false);
    let ids = b.param("ids", ElemType::I32, true);
    let weights = b.param("weights", ElemType::F32, true);
    let (t, e) = (b.var(ValType::I64), b.var(ValType::I64));
    let (best_v, best_i, le) = (b.var(ValType::F32), b.var(ValType::I64), b.var(ValType::F32));
    let (top, sum) = (b.var(ValType::F32), b.var(ValType::F32));
    let (ne, k) = (experts as i64, top_k as i64);
    let logit = |at: Expr| ld(logits, add(mul(v(t), i(ne)), at));
    let slot = |j: i64| add(mul(v(t), i(k)), i(j));
    let mut body = Vec::new();
    // The picks' logits go to `weights` first, their ids to `ids`.
    for j in 0..k {
        let better = or(lt(v(best_i), i(0)), lt(v(best_v), v(le)));
        let pick = vec![set(best_v, v(le)), set(best_i, v(e))];
        let scan = if j == 0 {
            vec![set(le, logit(v(e))), if_(better, pick)]
        } else {
            // Below the previous pick in the order: a smaller logit, or an equal one at a higher index.
            let (prev_v, prev_i) = (ld(weights, slot(j - 1)), ld(ids, slot(j - 1)));
            let below = or(lt(v(le), prev_v.clone()), and_also(eq(v(le), prev_v), lt(prev_i, v(e))));
            vec![set(le, logit(v(e))), if_(below, vec![if_(better, pick)])]
        };
        body.extend([set(best_v, f(0.0)), set(best_i, i(-1)), for_(e, i(0), i(ne), scan)]);
        // A row of NaNs picks nothing: expert 0, whose weight is NaN too.
        body.extend([store(ids, slot(j), max(v(best_i), i(0))), store(weights, slot(j), v(best_v))]);
    }
    body.push(set(top, ld(weights, slot(0))));
    let exp_of = |x: Expr| fast_exp(sub(x, v(top)));
    // The denominator: every expert's exponential, or the chosen ones'.
    body.push(set(sum, f(0.0)));
    match routing {
        MoeRouting::SoftmaxTopK { renormalize: false } => body.push(for_(e, i(0), i(ne), vec![set(sum, add(v(sum), exp_of(logit(v(e)))))])),
        MoeRouting::SoftmaxTopK { renormalize: true } | MoeRouting::TopKSoftmax => {
            body.extend((0..k).map(|j| set(sum, add(v(sum), exp_of(ld(weights, slot(j)))))));
        }
    }
    body.extend((0..k).map(|j| store(weights, slot(j), div(exp_of(ld(weights, slot(j))), v(sum)))));
    let name = format!("moe_route_{}_e{experts}_k{top_k}", routing.name());
    b.finish(name, "moe", TaskCount { per_seq: 1, fixed: 0 }, t, body)
}

/// The step's `seq * top_k` (row, rank) slots grouped by expert, a counting
/// sort in one task: `ids: i32[seq * top_k]` -> `offsets: i32[experts + 1]`
/// (expert `e`'s slots are `offsets[e]..offsets[e + 1]` of the order),
/// `cursor: i32[experts]` (scratch), `order: i32[seq * top_k]` (the slot at
/// each place of the grouped order: by expert, then by slot), `place:
/// i32[seq * top_k]` (each slot's place). Ids outside `0..experts` are
/// clamped into it, so that no corrupt id addresses past a group.
pub fn moe_group(experts: u64, top_k: u64) -> Kernel {
    let mut b = KernelBuilder::new();
    let ids = b.param("ids", ElemType::I32, false);
    let offsets = b.param("offsets", ElemType::I32, true);
    let cursor = b.param("cursor", ElemType::I32, true);
    let order = b.param("order", ElemType::I32, true);
    let place = b.param("place", ElemType::I32, true);
    let (t, e, r, id, at) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let ne = experts as i64;
    let slots = mul(seq(), i(top_k as i64));
    let expert_of = |r: VarId| min(max(ld(ids, v(r)), i(0)), i(ne - 1));
    let body = vec![
        for_(e, i(0), i(ne), vec![store(cursor, v(e), i(0))]),
        // Each expert's count, then the starts of the groups.
        for_(r, i(0), slots.clone(), vec![set(id, expert_of(r)), store(cursor, v(id), add(ld(cursor, v(id)), i(1)))]),
        store(offsets, i(0), i(0)),
        for_(e, i(0), i(ne), vec![store(offsets, add(v(e), i(1)), add(ld(offsets, v(e)), ld(cursor, v(e)))), store(cursor, v(e), ld(offsets, v(e)))]),
        for_(r, i(0), slots, vec![set(id, expert_of(r)), set(at, ld(cursor, v(id))), store(order, v(at), v(r)), store(place, v(r), v(at)), store(cursor, v(id), add(v(at), i(1)))]),
    ];
    b.finish(format!("moe_group_e{experts}_k{top_k}"), "moe", TaskCount { per_seq: 0, fixed: 1 }, t, body)
}

/// The rows of `x: f32[seq, width]` in grouped order: `order: i32[seq *
/// top_k]` -> `out: f32[seq * top_k, width]`, `out[p] = x[order[p] / top_k]`;
/// one task per place.
pub fn moe_gather(width: u64, top_k: u64) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let order = b.param("order", ElemType::I32, false);
    let out = b.param("out", ElemType::F32, true);
    let (t, src, c) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let w = width as i64;
    let body = vec![
        set(src, div(ld(order, v(t)), i(top_k as i64))),
        for_vec(c, i(0), i(w), vec![store(out, add(v(c), mul(v(t), i(w))), ld(x, add(v(c), mul(v(src), i(w)))))]),
    ];
    b.finish(format!("moe_gather_w{width}_k{top_k}"), "moe", TaskCount { per_seq: top_k, fixed: 0 }, t, body)
}

/// Each row's experts' outputs summed with their weights: `y: f32[seq *
/// top_k, width]` (grouped order), `place: i32[seq * top_k]`, `weights:
/// f32[seq, top_k]`, with `biases: Some(experts)` also `ids: i32[seq *
/// top_k]` and `bias: f32[experts, width]` (each slot's expert's down bias,
/// added to its output), with `shared` also `x: f32[seq, width]` (the moe
/// op's input), `shared_gate: f32[width]` and `shared: f32[seq, width]` (a
/// shared expert's output, Qwen2-MoE: added after the routed ones, times
/// `sigmoid(x[r] . shared_gate)`) -> `out: f32[seq, width]`, `out[r] = sum over j of
/// weights[r, j] * y[place[r * top_k + j]]`, in rank order `j` (each step one
/// fused multiply-add), whatever the groups were: the same bits for a row
/// alone and in any batch. One task per row.
pub fn moe_combine(width: u64, top_k: u64, biases: Option<u64>, shared: bool) -> Kernel {
    let mut b = KernelBuilder::new();
    b.keep_float_order();
    let y = b.param("y", ElemType::F32, false);
    let place = b.param("place", ElemType::I32, false);
    let weights = b.param("weights", ElemType::F32, false);
    let lookup = biases.map(|experts| (b.param("ids", ElemType::I32, false), b.param("bias", ElemType::F32, false), experts as i64));
    let shared = shared.then(|| (b.param("x", ElemType::F32, false), b.param("shared_gate", ElemType::F32, false), b.param("shared", ElemType::F32, false)));
    let out = b.param("out", ElemType::F32, true);
    let (t, c, acc, gate) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::F32), b.var(ValType::F32));
    let (w, k) = (width as i64, top_k as i64);
    let places: Vec<VarId> = (0..k).map(|_| b.var(ValType::I64)).collect();
    let bias_rows: Vec<VarId> = (0..k).map(|_| b.var(ValType::I64)).collect();
    let slot = |j: usize| add(mul(v(t), i(k)), i(j as i64));
    let mut body: Vec<Stmt> = places.iter().enumerate().map(|(j, &p)| set(p, mul(ld(place, slot(j)), i(w)))).collect();
    if let Some((ids, _, experts)) = lookup {
        body.extend(bias_rows.iter().enumerate().map(|(j, &r)| set(r, mul(min(max(ld(ids, slot(j)), i(0)), i(experts - 1)), i(w)))));
    }
    let mut per_column = vec![set(acc, f(0.0))];
    for (j, &p) in places.iter().enumerate() {
        let y_j = ld(y, add(v(c), v(p)));
        let y_j = match lookup {
            Some((_, bias, _)) => add(y_j, ld(bias, add(v(c), v(bias_rows[j])))),
            None => y_j,
        };
        per_column.push(set(acc, mul_add(ld(weights, slot(j)), y_j, v(acc))));
    }
    if let Some((x, shared_gate, shared)) = shared {
        // The shared expert's gate: sigmoid(x . shared_gate), one dot per row.
        body.push(set(gate, f(0.0)));
        body.push(for_vec(c, i(0), i(w), vec![set(gate, add(v(gate), mul(ld(x, add(v(c), mul(v(t), i(w)))), ld(shared_gate, v(c)))))]));
        body.push(set(gate, div(f(1.0), add(f(1.0), fast_exp(un(UnOp::Neg, v(gate)))))));
        per_column.push(set(acc, mul_add(v(gate), ld(shared, add(v(c), mul(v(t), i(w)))), v(acc))));
    }
    per_column.push(store(out, add(v(c), mul(v(t), i(w))), v(acc)));
    body.push(for_vec(c, i(0), i(w), per_column));
    let mut tag = biases.map_or(String::new(), |e| format!("_bias_e{e}"));
    if shared.is_some() {
        tag.push_str("_shared");
    }
    b.finish(format!("moe_combine_w{width}_k{top_k}{tag}"), "moe", TaskCount { per_seq: 1, fixed: 0 }, t, body)
}

/// The experts' activation on grouped slots where the plain SwiGLU row
/// kernel does not serve: `gate_up: f32[seq * top_k, 2f]` (grouped order,
/// each row an expert's gate outputs then its up outputs), with `biases`
/// also `order: i32[seq * top_k]`, `ids: i32[seq * top_k]` and `bias:
/// f32[experts, 2f]` (each place's expert's gate-and-up bias, added before
/// the activation) -> `out: f32[seq * top_k, f]`. One task per place; a
/// place's result depends on its row and expert only, so it is the same
/// bits in every plan.
pub fn moe_activation(ff: u64, top_k: u64, activation: MoeActivation, biases: Option<u64>) -> Kernel {
    let mut b = KernelBuilder::new();
    let gu = b.param("gate_up", ElemType::F32, false);
    let lookup = biases.map(|experts| (b.param("order", ElemType::I32, false), b.param("ids", ElemType::I32, false), b.param("bias", ElemType::F32, false), experts as i64));
    let out = b.param("out", ElemType::F32, true);
    let (t, c, row) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let fi = ff as i64;
    let mut body = Vec::new();
    let (g, u) = (ld(gu, add(v(c), mul(v(t), i(2 * fi)))), ld(gu, add(add(v(c), i(fi)), mul(v(t), i(2 * fi)))));
    let (g, u) = match lookup {
        Some((order, ids, bias, experts)) => {
            body.push(set(row, mul(min(max(ld(ids, ld(order, v(t))), i(0)), i(experts - 1)), i(2 * fi))));
            (add(g, ld(bias, add(v(c), v(row)))), add(u, ld(bias, add(add(v(c), i(fi)), v(row)))))
        }
        None => (g, u),
    };
    body.push(for_vec(c, i(0), i(fi), vec![store(out, add(v(c), mul(v(t), i(fi))), activation.apply(g, u))]));
    let tag = biases.map_or(String::new(), |e| format!("_bias_e{e}"));
    b.finish(format!("moe_act_{}_f{ff}_k{top_k}{tag}", activation.tag()), "moe", TaskCount { per_seq: top_k, fixed: 0 }, t, body)
}

/// A row-task kernel (`swiglu`, the activation quantizers: one task per row,
/// the task index the row, the step's length never read) run over the step's
/// `seq * top_k` grouped slots: the same body with `top_k` times the tasks
/// per row, named `{name}_x{top_k}`. Panics (a library bug) on a kernel that
/// reads the step's length, whose rows would then be the step's, not its slots.
pub fn over_slots(mut kernel: Kernel, top_k: u64) -> Kernel {
    let text = crate::ir_text::print(&kernel);
    let reads_seq = text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).any(|word| word == "seq");
    assert!(!reads_seq && kernel.tasks.fixed == 0, "`{}` is not a row-task kernel that ignores the step's length", kernel.name);
    kernel.tasks.per_seq *= top_k;
    kernel.name = format!("{}_x{top_k}", kernel.name);
    kernel
}

/// The task structure of the grouped matmuls: task `t` of `experts *
/// tasks_per_expert` takes expert `e = t / tasks_per_expert`'s rows
/// `offsets[e]..offsets[e + 1]` of the grouped activations (none: the task
/// ends at once, so a step reads only the weights of the experts its rows
/// chose) and the panels of `panels_per_task` of that expert's `n / 16`,
/// `matmul_panel.rs`'s task body over them; `wp` is set to the expert's first
/// weight panel, which the tile builders add. A decode step's groups hold one
/// row each (a row's experts differ) and take `many` as a GEMV; other steps
/// take `few` for groups of at most [`FEW_ROWS`] rows, else `many`, as the
/// dense matmuls do for their steps' rows, so that a row's products are the
/// same bits in every plan. Returns the body, the task count and the task variable.
#[allow(clippy::too_many_arguments)]
fn expert_tasks(b: &mut KernelBuilder, (n, experts): (u64, u64), offsets: ParamId, seq: SeqMode, wp: VarId, (many_tile, few_tile): (RegisterTile, RegisterTile), many: &mut TileBuilder<'_>, few: &mut TileBuilder<'_>) -> (Vec<Stmt>, TaskCount, VarId) {
    let (t, e, start, end) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let (p0, pp, rb, r0) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let panels = (n / PANEL) as i64;
    let per_expert = (panels + PANELS_PER_TASK - 1) / PANELS_PER_TASK;
    let rows = TaskRows { decode: seq.is_decode(), start: Some(v(start)), end: v(end) };
    let mut work = Vec::new();
    if seq.is_decode() {
        work.extend(task_panels(b, panels, &rows, PANELS_PER_TASK, many_tile, (p0, pp, rb, r0), many));
    } else {
        let few_rows = task_panels(b, panels, &rows, PANELS_PER_TASK, few_tile, (p0, pp, rb, r0), few);
        let many_rows = task_panels(b, panels, &rows, PANELS_PER_TASK, many_tile, (p0, pp, rb, r0), many);
        work.push(if_(le(rows.count(), i(FEW_ROWS)), few_rows));
        work.push(if_(lt(i(FEW_ROWS), rows.count()), many_rows));
    }
    let body = vec![
        set(e, div(v(t), i(per_expert))),
        set(start, ld(offsets, v(e))),
        set(end, ld(offsets, add(v(e), i(1)))),
        set(wp, mul(v(e), i(panels))),
        set(p0, mul(rem(v(t), i(per_expert)), i(PANELS_PER_TASK))),
        if_(lt(v(start), v(end)), work),
    ];
    (body, TaskCount { per_seq: 0, fixed: experts * per_expert as u64 }, t)
}

/// The experts' matmul on grouped rows, float panels: `x: f32[seq * top_k,
/// k]` (rows grouped by expert, [`moe_gather`]), `offsets: i32[experts + 1]`
/// ([`moe_group`]), `w`: every expert's `[n, k]` stacked and packed as
/// `[experts * n / 16][k][16]` (elements as `weights` says; fp8's column
/// scales `[experts * n]`) -> `out: f32[seq * top_k, n]`, each row times its
/// group's expert. Each active expert's weights are read once per step for
/// all its rows, in `matmul_panel`'s register tiles. `n` must be a multiple
/// of 16. Params: `x`, `offsets`, `w` (fp8: `w.quants`, `w.scales`), `out`.
pub fn moe_matmul_panel(k: u64, n: u64, experts: u64, weights: PanelWeights, seq: SeqMode, register_tile: RegisterTile) -> Kernel {
    assert!(n.is_multiple_of(PANEL) && weights != PanelWeights::BFloat16Pairs, "grouped panels take float or fp8 elements in whole panels, not {weights:?} at n = {n}");
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let offsets = b.param("offsets", ElemType::I32, false);
    let w = PanelParams::declare(&mut b, weights);
    let out = b.param("out", ElemType::F32, true);
    let wp = b.var(ValType::I64);
    let (ki, ni, elem_bytes) = (k as i64, n as i64, weights.elem_bytes());
    let prefetch = seq.is_decode().then_some(DECODE_PREFETCH_BYTES / elem_bytes);
    let register_tile = register_tile.for_float_panels();
    let few_tile = RegisterTile { panels: 1, ..register_tile };
    let (body, tasks, t) = expert_tasks(
        &mut b,
        (n, experts),
        offsets,
        seq,
        wp,
        (register_tile, few_tile),
        &mut |b, rows, panels, r0, p0| super::matmul_panel::tile(b, rows, panels, r0, (Some(wp), p0), (x, w, out), (ki, ni), None, prefetch),
        &mut |b, rows, panels, r0, p0| super::matmul_panel::tile(b, rows, panels, r0, (Some(wp), p0), (x, w, out), (ki, ni), None, Some(DECODE_PREFETCH_BYTES / elem_bytes)),
    );
    let name = format!("moe_matmul_panel{}_e{experts}_k{k}_n{n}_{}{}", weights.suffix(), seq.tag(), tile_tag(seq, register_tile, few_tile));
    b.finish(name, "moe", tasks, t, body)
}

/// The experts' matmul on grouped rows with integer activations and block
/// weights interleaved by 16 rows (`matmul_interleaved`'s tiles and dots):
/// `q`, `s` (and Q6_K's `h`): the grouped rows' activations quantized with
/// `levels`, `offsets: i32[experts + 1]`, `w`: every expert's `[n, k]`
/// stacked, `[experts * n, k]` in `encoding` and layout `interleaved16` ->
/// `out: f32[seq * top_k, n]`. Params: `q`, `s`, `h`?, `offsets`, the
/// weight's parts, `out`.
pub fn moe_matmul_interleaved(k: u64, n: u64, experts: u64, encoding: WeightEncoding, seq: SeqMode, register_tile: RegisterTile, levels: ActivationLevels) -> Kernel {
    assert_eq!(n % INTERLEAVED_ROWS as u64, 0, "interleaved experts need n = {n} in whole groups of 16 rows");
    let mut b = KernelBuilder::new();
    let xq = b.param("q", ElemType::I8, false);
    let xs = b.param("s", ElemType::F32, false);
    let xh = reads_half_sums(encoding, n, k).then(|| b.param("h", ElemType::I32, false));
    let offsets = b.param("offsets", ElemType::I32, false);
    let w = declare_interleaved(&mut b, "w", encoding, experts * n, k);
    let out = b.param("out", ElemType::F32, true);
    let wp = b.var(ValType::I64);
    let form = w.interleaved.expect("declared interleaved");
    let ni = n as i64;
    let acts = (xq, xs, xh, levels);
    let prefetch = seq.is_decode().then_some(DECODE_PREFETCH_BYTES);
    let (register_tile, few_tile) = interleaved_tiles(register_tile, levels, form);
    let tile = super::matmul_interleaved::tile;
    let w_ref: &WeightParams = &w;
    let (body, tasks, t) = expert_tasks(
        &mut b,
        (n, experts),
        offsets,
        seq,
        wp,
        (register_tile, few_tile),
        &mut |b, rows, panels, r0, p0| {
            if !seq.is_decode() {
                return tile(b, rows, panels, (r0, Some(wp), p0), acts, w_ref, form, out, ni, None, prefetch);
            }
            // Decode: the task's panels one after another, as `matmul_interleaved` takes them.
            let mut all = Vec::new();
            for p in 0..panels {
                let at = b.var(ValType::I64);
                all.push(set(at, add(v(p0), i(p))));
                all.extend(tile(b, rows, 1, (r0, Some(wp), at), acts, w_ref, form, out, ni, None, prefetch));
            }
            all
        },
        &mut |b, rows, panels, r0, p0| tile(b, rows, panels, (r0, Some(wp), p0), acts, w_ref, form, out, ni, None, Some(DECODE_PREFETCH_BYTES)),
    );
    let name = format!("moe_matmul_{}x16_{}_e{experts}_k{k}_n{n}_{}{}", levels.tag(), encoding.name(), seq.tag(), tile_tag(seq, register_tile, few_tile));
    b.finish(name, "moe", tasks, t, body)
}

/// The experts' matmul on grouped rows with row-major weights in any
/// encoding, decoded value by value: `x: f32[seq * top_k, k]`, `offsets:
/// i32[experts + 1]`, `w`: `[experts * n, k]` -> `out: f32[seq * top_k, n]`.
/// A task per expert and [`ROW_MAJOR_COLS`] output columns, each output one
/// dot product over `k` (which a GPU deals to a warp's lanes): the form of
/// weights no panel or interleaved kernel takes, and of GPU-only artifacts.
/// Its result does not depend on the step's length, so one kernel serves
/// every plan. Params: `x`, `offsets`, the weight's parts, `out`.
pub fn moe_matmul_rows(k: u64, n: u64, experts: u64, encoding: WeightEncoding) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let offsets = b.param("offsets", ElemType::I32, false);
    let w = declare(&mut b, "w", encoding, k);
    let out = b.param("out", ElemType::F32, true);
    let (t, e, j0, r, j, kk, acc) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::F32));
    let (ki, ni) = (k as i64, n as i64);
    let per_expert = n.div_ceil(ROW_MAJOR_COLS) as i64;
    let dot = vec![
        set(acc, f(0.0)),
        for_vec(kk, i(0), i(ki), vec![set(acc, add(v(acc), mul(ld(x, add(v(kk), mul(v(r), i(ki)))), w.value(add(v(j), mul(v(e), i(ni))), v(kk)))))]),
        store(out, add(v(j), mul(v(r), i(ni))), v(acc)),
    ];
    let body = vec![
        set(e, div(v(t), i(per_expert))),
        set(j0, mul(rem(v(t), i(per_expert)), i(ROW_MAJOR_COLS as i64))),
        for_(r, ld(offsets, v(e)), ld(offsets, add(v(e), i(1))), vec![for_(j, v(j0), min(add(v(j0), i(ROW_MAJOR_COLS as i64)), i(ni)), dot)]),
    ];
    b.finish(format!("moe_matmul_rows_{}_e{experts}_k{k}_n{n}", encoding.name()), "moe", TaskCount { per_seq: 0, fixed: experts * per_expert as u64 }, t, body)
}

/// The GPU form of [`moe_matmul_panel`] for artifacts that carry CPU code too
/// (their experts packed in panels): each output one dot product over `k`,
/// which the GPU mapping deals to a warp's lanes. Same parameters, tasks and
/// result as [`moe_matmul_panel`].
pub fn moe_matmul_panel_rows(k: u64, n: u64, experts: u64, weights: PanelWeights) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let offsets = b.param("offsets", ElemType::I32, false);
    let w = PanelParams::declare(&mut b, weights);
    let out = b.param("out", ElemType::F32, true);
    let (t, e, j0, r, j, kk, acc) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::F32));
    let (ki, ni, lanes) = (k as i64, n as i64, PANEL as i64);
    let panels = ni / lanes;
    let per_expert = (panels + PANELS_PER_TASK - 1) / PANELS_PER_TASK;
    // The weight's column: expert e's column j, lane j % 16 of its panel.
    let col = add(v(j), mul(v(e), i(ni)));
    let weight = w.element(add(mul(add(mul(div(col.clone(), i(lanes)), i(ki)), v(kk)), i(lanes)), rem(col.clone(), i(lanes))));
    let dot = vec![
        set(acc, f(0.0)),
        for_vec(kk, i(0), i(ki), vec![set(acc, add(v(acc), mul(ld(x, add(v(kk), mul(v(r), i(ki)))), weight)))]),
        store(out, add(v(j), mul(v(r), i(ni))), w.finish(v(acc), col)),
    ];
    let cols = PANELS_PER_TASK * lanes;
    let body = vec![
        set(e, div(v(t), i(per_expert))),
        set(j0, mul(rem(v(t), i(per_expert)), i(cols))),
        for_(r, ld(offsets, v(e)), ld(offsets, add(v(e), i(1))), vec![for_(j, v(j0), min(add(v(j0), i(cols)), i(ni)), dot)]),
    ];
    b.finish(format!("moe_matmul_panel_rows{}_e{experts}_k{k}_n{n}", weights.suffix()), "moe", TaskCount { per_seq: 0, fixed: experts * per_expert as u64 }, t, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{run, Buffer};
    use crate::library::matmul_blocks::matmul_blocks;
    use crate::library::matmul_interleaved::matmul_interleaved;
    use crate::library::matmul_panel::{matmul_panel, pack_panels};
    use crate::library::quantize_activations::quantize_to;
    use crate::library::test_util::*;

    fn f32s(b: &Buffer) -> &[f32] {
        let Buffer::F32(v) = b else { panic!("not f32") };
        v
    }

    fn i32s(b: &Buffer) -> &[i32] {
        let Buffer::I32(v) = b else { panic!("not i32") };
        v
    }

    /// The top 3 of 6 logits with a tie (experts 1 and 4 at 0.5, below 2's
    /// 0.9): ranked 2, 1, 4, and each rule's weights worked out in f64.
    #[test]
    fn route_ranks_the_top_k_with_ties_to_the_lower_index() {
        let row = [0.1f32, 0.5, 0.9, -2.0, 0.5, 0.3];
        let exp = |x: f32| ((x - 0.9) as f64).exp();
        let all: f64 = row.iter().map(|&x| exp(x)).sum();
        let chosen = [2usize, 1, 4];
        let picked: f64 = chosen.iter().map(|&e| exp(row[e])).sum();
        for (routing, denominator) in [(MoeRouting::SoftmaxTopK { renormalize: false }, all), (MoeRouting::SoftmaxTopK { renormalize: true }, picked), (MoeRouting::TopKSoftmax, picked)] {
            // Two rows: the second the first reversed (ranks by index then differ).
            let mut logits = row.to_vec();
            logits.extend(row.iter().rev());
            let mut bufs = vec![Buffer::F32(logits), Buffer::I32(vec![-7; 6]), Buffer::F32(vec![f32::NAN; 6])];
            run(&moe_route(6, 3, routing), &mut bufs, 2);
            assert_eq!(i32s(&bufs[1]), &[2, 1, 4, 3, 1, 4], "{routing:?}");
            for (j, &e) in chosen.iter().enumerate() {
                let want = (exp(row[e]) / denominator) as f32;
                for r in 0..2 {
                    let got = f32s(&bufs[2])[r * 3 + j];
                    assert!((got - want).abs() <= 1e-6 * want, "{routing:?} row {r} rank {j}: {got} vs {want}");
                }
            }
        }
    }

    /// Slots grouped by expert, then by slot; an expert nobody chose has an
    /// empty group; an id out of range counts as the nearest expert.
    #[test]
    fn group_orders_slots_by_expert_then_slot() {
        let ids = vec![3, 0, 0, 2, 3, 0, 9, -1];
        let mut bufs = vec![Buffer::I32(ids), Buffer::I32(vec![-7; 5]), Buffer::I32(vec![-7; 4]), Buffer::I32(vec![-7; 8]), Buffer::I32(vec![-7; 8])];
        run(&moe_group(4, 2), &mut bufs, 4);
        assert_eq!(i32s(&bufs[1]), &[0, 4, 4, 5, 8]);
        assert_eq!(i32s(&bufs[3]), &[1, 2, 5, 7, 3, 0, 4, 6]);
        let order = i32s(&bufs[3]).to_vec();
        for (p, &slot) in order.iter().enumerate() {
            assert_eq!(i32s(&bufs[4])[slot as usize], p as i32);
        }
    }

    /// Gathered rows, then the combine, in rank order.
    #[test]
    fn gather_and_combine_follow_the_grouped_order() {
        let (w, k) = (5usize, 2usize);
        let x = rand(3 * w, 1);
        let order = vec![4, 1, 0, 5, 2, 3];
        let mut bufs = vec![Buffer::F32(x.clone()), Buffer::I32(order.clone()), Buffer::F32(vec![f32::NAN; 6 * w])];
        run(&moe_gather(w as u64, k as u64), &mut bufs, 3);
        for (p, &slot) in order.iter().enumerate() {
            assert_eq!(&f32s(&bufs[2])[p * w..(p + 1) * w], &x[(slot as usize / k) * w..(slot as usize / k + 1) * w]);
        }
        let y = rand(6 * w, 2);
        let weights = rand(6, 3);
        let mut place = vec![0; 6];
        for (p, &slot) in order.iter().enumerate() {
            place[slot as usize] = p as i32;
        }
        let mut bufs = vec![Buffer::F32(y.clone()), Buffer::I32(place.clone()), Buffer::F32(weights.clone()), Buffer::F32(vec![f32::NAN; 3 * w])];
        run(&moe_combine(w as u64, k as u64, None, false), &mut bufs, 3);
        for r in 0..3 {
            for c in 0..w {
                let want = (0..k).fold(0.0f32, |acc, j| weights[r * k + j].mul_add(y[place[r * k + j] as usize * w + c], acc));
                assert_eq!(f32s(&bufs[3])[r * w + c], want);
            }
        }
    }

    /// gpt-oss's activation on grouped places with each place's expert's
    /// bias, against transformers' formula in f64 (`min(g, limit)`, `clamp(u,
    /// -limit, limit)`, `(u + 1) * g * sigmoid(alpha * g)`), on values that
    /// cross the limits both ways; and the down biases in the combine, by
    /// each slot's own expert.
    #[test]
    fn clamped_swiglu_and_the_expert_biases_follow_transformers() {
        let (ff, top_k, experts, places) = (6usize, 2usize, 3usize, 8usize);
        let (alpha, limit) = (1.702f32, 1.5f32);
        let gu: Vec<f32> = rand(places * 2 * ff, 7).iter().map(|x| x * 4.0).collect();
        let bias: Vec<f32> = rand(experts * 2 * ff, 8);
        let order = vec![3, 0, 6, 1, 7, 2, 4, 5];
        let ids = vec![2, 0, 1, 1, 0, 2, 0, 9];
        let mut bufs = vec![Buffer::F32(gu.clone()), Buffer::I32(order.clone()), Buffer::I32(ids.clone()), Buffer::F32(bias.clone()), Buffer::F32(vec![f32::NAN; places * ff])];
        run(&moe_activation(ff as u64, top_k as u64, MoeActivation::ClampedSwiGlu { alpha, limit }, Some(experts as u64)), &mut bufs, (places / top_k) as u64);
        let (mut clamped_g, mut clamped_u) = (0, 0);
        for p in 0..places {
            let e = (ids[order[p] as usize] as usize).min(experts - 1);
            for c in 0..ff {
                let g = (gu[p * 2 * ff + c] + bias[e * 2 * ff + c]) as f64;
                let u = (gu[p * 2 * ff + ff + c] + bias[e * 2 * ff + ff + c]) as f64;
                clamped_g += (g > limit as f64) as usize;
                clamped_u += (u.abs() > limit as f64) as usize;
                let (g, u) = (g.min(limit as f64), u.clamp(-limit as f64, limit as f64));
                let want = (u + 1.0) * g / (1.0 + (-(alpha as f64) * g).exp());
                let got = f32s(&bufs[4])[p * ff + c] as f64;
                assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "place {p} column {c}: {got} against {want}");
            }
        }
        assert!(clamped_g > 0 && clamped_u > 0, "the values cross the limit ({clamped_g} gates, {clamped_u} ups)");

        let (w, rows) = (5usize, 3usize);
        let y = rand(rows * top_k * w, 2);
        let weights = rand(rows * top_k, 3);
        let place = vec![4, 1, 0, 5, 2, 3];
        let slot_ids = vec![1, 0, 2, 2, 0, -4];
        let down_bias = rand(experts * w, 4);
        let mut bufs = vec![Buffer::F32(y.clone()), Buffer::I32(place.clone()), Buffer::F32(weights.clone()), Buffer::I32(slot_ids.clone()), Buffer::F32(down_bias.clone()), Buffer::F32(vec![f32::NAN; rows * w])];
        run(&moe_combine(w as u64, top_k as u64, Some(experts as u64), false), &mut bufs, rows as u64);
        for r in 0..rows {
            for c in 0..w {
                let want: f64 = (0..top_k)
                    .map(|j| {
                        let e = slot_ids[r * top_k + j].clamp(0, experts as i32 - 1) as usize;
                        weights[r * top_k + j] as f64 * (y[place[r * top_k + j] as usize * w + c] as f64 + down_bias[e * w + c] as f64)
                    })
                    .sum();
                let got = f32s(&bufs[5])[r * w + c] as f64;
                assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "row {r} column {c}: {got} against {want}");
            }
        }
    }

    /// Qwen2-MoE's shared expert in the combine: its output times the sigmoid
    /// of the row's dot with the gate, after the routed experts (f64 reference).
    #[test]
    fn the_shared_expert_joins_the_combine_through_its_sigmoid_gate() {
        let (w, k, rows) = (6usize, 2usize, 3usize);
        let y = rand(rows * k * w, 2);
        let weights = rand(rows * k, 3);
        let place = vec![4, 1, 0, 5, 2, 3];
        let (x, gate, shared) = (rand(rows * w, 5), rand(w, 6), rand(rows * w, 7));
        let mut bufs = vec![Buffer::F32(y.clone()), Buffer::I32(place.clone()), Buffer::F32(weights.clone()), Buffer::F32(x.clone()), Buffer::F32(gate.clone()), Buffer::F32(shared.clone()), Buffer::F32(vec![f32::NAN; rows * w])];
        run(&moe_combine(w as u64, k as u64, None, true), &mut bufs, rows as u64);
        for r in 0..rows {
            let s: f64 = (0..w).map(|c| x[r * w + c] as f64 * gate[c] as f64).sum();
            let sig = 1.0 / (1.0 + (-s).exp());
            for c in 0..w {
                let routed: f64 = (0..k).map(|j| weights[r * k + j] as f64 * y[place[r * k + j] as usize * w + c] as f64).sum();
                let want = routed + sig * shared[r * w + c] as f64;
                let got = f32s(&bufs[6])[r * w + c] as f64;
                assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "row {r} column {c}: {got} against {want}");
            }
        }
    }

    /// Each group of rows times its expert, by the grouped kernels, is the
    /// dense kernel's result on that group alone with that expert's weights,
    /// bit for bit for the panel and interleaved forms (they share its tiles;
    /// batch invariance rests on it) and within rounding for the row-major
    /// one (against `matmul_blocks`). Groups of 0, 1, 3, 11 and `FEW_ROWS +
    /// 9` rows, decode groups of one row, both register tiles.
    #[test]
    fn grouped_matmuls_equal_the_dense_kernel_per_expert() {
        let many = FEW_ROWS as usize + 9;
        let cases: Vec<(Vec<usize>, SeqMode)> = vec![(vec![3, 0, 11, 1, many], SeqMode::Dynamic), (vec![1, 0, 1, 0, 1], SeqMode::Fixed(1))];
        let (k, n, experts) = (64usize, 48usize, 5usize);
        let per_expert = |encoding: WeightEncoding| -> Vec<Vec<Buffer>> { (0..experts).map(|e| random_parts(encoding, n, k, 10 + e as u64)).collect() };
        let concat = |parts: &[Vec<Buffer>]| -> Vec<Buffer> {
            (0..parts[0].len())
                .map(|p| match &parts[0][p] {
                    Buffer::F32(_) => Buffer::F32(parts.iter().flat_map(|e| f32s(&e[p]).to_vec()).collect()),
                    Buffer::I8(_) => Buffer::I8(parts.iter().flat_map(|e| if let Buffer::I8(v) = &e[p] { v.clone() } else { unreachable!() }).collect()),
                    Buffer::U8(_) => Buffer::U8(parts.iter().flat_map(|e| if let Buffer::U8(v) = &e[p] { v.clone() } else { unreachable!() }).collect()),
                    Buffer::F16(_) => Buffer::F16(parts.iter().flat_map(|e| if let Buffer::F16(v) = &e[p] { v.clone() } else { unreachable!() }).collect()),
                    other => panic!("{other:?}"),
                })
                .collect()
        };
        for (groups, seq) in cases {
            let rows: usize = groups.iter().sum();
            let mut offsets = vec![0i32];
            for g in &groups {
                offsets.push(offsets.last().unwrap() + *g as i32);
            }
            let x = rand(rows * k, 3);
            for tile in [RegisterTile::ZMM, RegisterTile::YMM] {
                // Float panels.
                let experts_f32 = per_expert(WeightEncoding::Float32);
                let packed: Vec<Vec<Buffer>> = experts_f32
                    .iter()
                    .map(|parts| {
                        let bytes: Vec<u8> = f32s(&parts[0]).iter().flat_map(|v| v.to_le_bytes()).collect();
                        vec![Buffer::F32(pack_panels(&bytes, n, k, 4).chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())]
                    })
                    .collect();
                let mut bufs = vec![Buffer::F32(x.clone()), Buffer::I32(offsets.clone())];
                bufs.extend(concat(&packed));
                bufs.push(Buffer::F32(vec![f32::NAN; rows * n]));
                run(&moe_matmul_panel(k as u64, n as u64, experts as u64, PanelWeights::Float(ElemType::F32), seq, tile), &mut bufs, 1);
                let got = f32s(bufs.last().unwrap()).to_vec();
                let mut rowwise = bufs.clone();
                run(&moe_matmul_panel_rows(k as u64, n as u64, experts as u64, PanelWeights::Float(ElemType::F32)), &mut rowwise, 1);
                for e in 0..experts {
                    let (r0, r1) = (offsets[e] as usize, offsets[e + 1] as usize);
                    if r0 == r1 {
                        continue;
                    }
                    let dense = run_matmul(&matmul_panel(k as u64, n as u64, PanelWeights::Float(ElemType::F32), None, seq, tile), vec![Buffer::F32(x[r0 * k..r1 * k].to_vec())], &packed[e], None, (r1 - r0, n));
                    assert_eq!(&got[r0 * n..r1 * n], &dense[..], "panels, expert {e}, {seq:?}, {tile:?}");
                    close(&f32s(rowwise.last().unwrap())[r0 * n..r1 * n], &dense, 1e-5);
                }
                // Interleaved blocks with integer activations.
                for (encoding, levels) in [(WeightEncoding::Q8_0, ActivationLevels::Int16Words), (WeightEncoding::Q4_1, ActivationLevels::Int8), (WeightEncoding::Q4_0, ActivationLevels::Int16Planes), (WeightEncoding::Q8_0, ActivationLevels::Int16WordPairs)] {
                    let raw = per_expert(encoding);
                    let interleaved: Vec<Vec<Buffer>> = raw.iter().map(|p| interleaved_parts(encoding, p, n, k)).collect();
                    let width = k * levels.bytes() as usize;
                    let mut qbufs = vec![Buffer::F32(x.clone()), Buffer::I8(vec![0; rows * width]), Buffer::F32(vec![0.0; rows * 2 * k / 32])];
                    let quantize = quantize_to(k as u64, levels, DotForm::Int8, seq);
                    run(&quantize, &mut qbufs, rows as u64);
                    let (Buffer::I8(q), Buffer::F32(s)) = (&qbufs[1], &qbufs[2]) else { unreachable!() };
                    let mut bufs = vec![qbufs[1].clone(), qbufs[2].clone(), Buffer::I32(offsets.clone())];
                    bufs.extend(concat(&interleaved));
                    bufs.push(Buffer::F32(vec![f32::NAN; rows * n]));
                    run(&moe_matmul_interleaved(k as u64, n as u64, experts as u64, encoding, seq, tile, levels), &mut bufs, 1);
                    let got = f32s(bufs.last().unwrap()).to_vec();
                    let sb = 2 * k / 32;
                    for e in 0..experts {
                        let (r0, r1) = (offsets[e] as usize, offsets[e + 1] as usize);
                        if r0 == r1 {
                            continue;
                        }
                        let acts = vec![Buffer::I8(q[r0 * width..r1 * width].to_vec()), Buffer::F32(s[r0 * sb..r1 * sb].to_vec())];
                        let dense = run_matmul(&matmul_interleaved(k as u64, n as u64, encoding, None, seq, tile, levels), acts, &interleaved[e], None, (r1 - r0, n));
                        assert_eq!(&got[r0 * n..r1 * n], &dense[..], "{} {levels:?}, expert {e}, {seq:?}, {tile:?}", encoding.name());
                    }
                }
            }
            // Row-major weights in any encoding, decoded value by value.
            for encoding in [WeightEncoding::Float32, WeightEncoding::Q8_0, WeightEncoding::Q4K, WeightEncoding::Q6K] {
                let k = if encoding.block() == 256 { 256 } else { k };
                let x = rand(rows * k, 4);
                let raw: Vec<Vec<Buffer>> = (0..experts).map(|e| random_parts(encoding, n, k, 20 + e as u64)).collect();
                let mut bufs = vec![Buffer::F32(x.clone()), Buffer::I32(offsets.clone())];
                bufs.extend(concat(&raw));
                bufs.push(Buffer::F32(vec![f32::NAN; rows * n]));
                run(&moe_matmul_rows(k as u64, n as u64, experts as u64, encoding), &mut bufs, 1);
                let got = f32s(bufs.last().unwrap()).to_vec();
                for e in 0..experts {
                    let (r0, r1) = (offsets[e] as usize, offsets[e + 1] as usize);
                    if r0 == r1 {
                        continue;
                    }
                    let xs = &x[r0 * k..r1 * k];
                    let dense = match encoding {
                        WeightEncoding::Float32 => naive_matmul(xs, f32s(&raw[e][0]), &[], (r1 - r0, k, n), None),
                        _ => run_matmul(&matmul_blocks(k as u64, n as u64, encoding, None, SeqMode::Dynamic), vec![Buffer::F32(xs.to_vec())], &raw[e], None, (r1 - r0, n)),
                    };
                    // Decoded values against per-block scales: another rounding, as large as the sums.
                    let scale = dense.iter().fold(1.0f32, |a, v| a.max(v.abs()));
                    for (g, w) in got[r0 * n..r1 * n].iter().zip(&dense) {
                        assert!((g - w).abs() <= 1e-5 * scale, "{} rows, expert {e}: {g} vs {w}", encoding.name());
                    }
                }
            }
        }
    }
}
