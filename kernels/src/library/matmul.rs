//! Matmul / GEMV: `out[m, n] = x[m, k] @ w[n, k]^T` (Hugging Face `Linear` layout).
//!
//! One task computes a block of [`COLS_PER_TASK`] output columns for every row.
//! Inside a task the work is register-tiled: [`ROW_TILE`] rows by [`COL_TILE`]
//! columns accumulate together, so each vector of x and of w loaded in the
//! reduction loop feeds several FMAs (x reused across columns, w across rows).
//! At decode (`seq = 1`) the row tile is 1 and the kernel is a GEMV that streams
//! [`COL_TILE`] weight rows at a time against one activation row.

use super::elementwise::Broadcast;
use super::SeqMode;
use crate::ir::dsl::*;
use crate::ir::*;

/// Output columns (weight rows) per task.
pub const COLS_PER_TASK: u64 = 8;
/// Columns of the register tile.
pub const COL_TILE: u64 = 4;
/// Rows of the register tile for multi-row (prefill) kernels.
pub const ROW_TILE: u64 = 4;

/// The epilogue of every matmul family: the accumulated dot product at (row,
/// col) of an `n`-column output, plus the addend if any.
pub(super) fn epilogue(acc: Expr, row: Expr, col: Expr, n: i64, addend: Option<(ParamId, Broadcast)>) -> Expr {
    match addend {
        None => acc,
        Some((r, Broadcast::None)) => add(acc, ld(r, add(mul(row, i(n)), col))),
        Some((r, Broadcast::Row)) => add(acc, ld(r, col)),
        Some((r, Broadcast::Scalar)) => add(acc, ld(r, i(0))),
    }
}

/// Builds one register tile: `(builder, rows, cols, first row, first column)`.
pub(super) type TileBuilder<'t> = dyn FnMut(&mut KernelBuilder, i64, i64, VarId, VarId) -> Vec<Stmt> + 't;

/// Which rows a register-tiled task runs over: the step's `0..seq`, or (the
/// grouped expert matmuls, `moe.rs`) `start..end`, one expert's run of a
/// step's rows grouped by expert; `decode` takes one row per tile.
#[derive(Clone, Debug)]
pub(super) struct TaskRows {
    pub decode: bool,
    pub start: Option<Expr>,
    pub end: Expr,
}

impl TaskRows {
    /// The step's rows.
    pub(super) fn of(seq: SeqMode) -> TaskRows {
        TaskRows { decode: seq.is_decode(), start: None, end: seq.expr() }
    }

    /// Row `at` counted from the first row.
    fn offset_by_start(&self, at: Expr) -> Expr {
        match &self.start {
            None => at,
            Some(s) => add(s.clone(), at),
        }
    }

    /// How many rows there are.
    pub(super) fn count(&self) -> Expr {
        match &self.start {
            None => self.end.clone(),
            Some(s) => sub(self.end.clone(), s.clone()),
        }
    }
}

/// The row loop of a register-tiled matmul task: row tiles of `row_tile` rows
/// (one at decode, `seq = 1`) starting at `r0`, counted by `rb`, then the rows
/// left over in tiles of half as many rows, a quarter, ... (each at most once:
/// a batched step's 7 rows under an 8-row tile run as 4 + 2 + 1, not 7 single
/// rows, each of which would unpack the weights again), and the last ones one
/// at a time; `tile(b, rows)` builds one tile of `rows` rows at `r0`.
pub(super) fn row_tiles(b: &mut KernelBuilder, seq: SeqMode, row_tile: i64, (rb, r0): (VarId, VarId), tile: &mut dyn FnMut(&mut KernelBuilder, i64) -> Vec<Stmt>) -> Vec<Stmt> {
    row_range_tiles(b, &TaskRows::of(seq), row_tile, (rb, r0), tile)
}

/// [`row_tiles`] over `rows`.
pub(super) fn row_range_tiles(b: &mut KernelBuilder, rows_in: &TaskRows, row_tile: i64, (rb, r0): (VarId, VarId), tile: &mut dyn FnMut(&mut KernelBuilder, i64) -> Vec<Stmt>) -> Vec<Stmt> {
    let row_tile = if rows_in.decode { 1 } else { row_tile };
    let full_rows = tile(b, row_tile);
    let full_blocks = div(rows_in.count(), i(row_tile));
    let mut tiled = vec![for_(rb, i(0), full_blocks.clone(), {
        let mut body = vec![set(r0, rows_in.offset_by_start(mul(v(rb), i(row_tile))))];
        body.extend(full_rows);
        body
    })];
    if row_tile > 1 {
        // `rb` counts the rows done from here on.
        tiled.push(set(rb, rows_in.offset_by_start(mul(full_blocks, i(row_tile)))));
        let mut rows = row_tile / 2;
        while rows > 1 {
            let mut body = vec![set(r0, v(rb))];
            body.extend(tile(b, rows));
            body.push(set(rb, add(v(rb), i(rows))));
            tiled.push(if_(le(add(v(rb), i(rows)), rows_in.end.clone()), body));
            rows /= 2;
        }
        let tail_row = tile(b, 1);
        tiled.push(for_(r0, v(rb), rows_in.end.clone(), tail_row));
    }
    tiled
}

/// The task structure of the tiled block matmuls (`matmul_blocks.rs`,
/// `matmul_int8.rs`): task `t` owns `cols_per_task` output columns, walked in
/// column tiles of `col_tile`; each full tile runs `tile(b, rows, cols, r0, j0)`
/// over row tiles (one row at decode, [`ROW_TILE`] in prefill) and a last single
/// row, ragged last columns one output at a time. Returns the body, the task
/// count and the task variable.
pub(super) fn column_tasks(
    b: &mut KernelBuilder,
    n: u64,
    seq: SeqMode,
    (cols_per_task, col_tile): (u64, u64),
    tile: &mut TileBuilder<'_>,
) -> (Vec<Stmt>, TaskCount, VarId) {
    let (t, jb, j0, j, rb, r0) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let ni = n as i64;
    let ct = col_tile as i64;
    let tiled = row_tiles(b, seq, ROW_TILE as i64, (rb, r0), &mut |b, rows| tile(b, rows, ct, r0, j0));
    // Ragged last columns (n not a multiple of the tile): one output at a time.
    let single = tile(b, 1, 1, r0, j);
    let ragged = vec![for_(j, v(j0), min(add(v(j0), i(ct)), i(ni)), vec![for_(r0, i(0), seq.expr(), single)])];
    let body = vec![for_(
        jb,
        i(0),
        i((cols_per_task / col_tile) as i64),
        vec![
            set(j0, add(mul(v(t), i(cols_per_task as i64)), mul(v(jb), i(ct)))),
            if_(lt(add(v(j0), i(ct - 1)), i(ni)), tiled),
            if_(lt(v(j0), i(ni)), vec![if_(le(i(ni), add(v(j0), i(ct - 1))), ragged)]),
        ],
    )];
    (body, TaskCount { per_seq: 0, fixed: n.div_ceil(cols_per_task) }, t)
}

/// A matmul kernel's name: `{stem}_{encoding}_k{k}_n{n}_{seq}`, with `_add` and
/// the addend's broadcast after the stem's `matmul`.
pub(super) fn matmul_name(stem: &str, encoding: &str, addend: Option<Broadcast>, k: u64, n: u64, seq: SeqMode) -> String {
    let rest = stem.strip_prefix("matmul").unwrap_or(stem);
    match addend {
        None => format!("matmul{rest}_{encoding}_k{k}_n{n}_{}", seq.tag()),
        Some(bc) => format!("matmul_add{rest}_{encoding}_{}_k{k}_n{n}_{}", format!("{bc:?}").to_lowercase(), seq.tag()),
    }
}

/// The kernel-name suffix of a float weight element type (`""`, `_bf16`, `_f16`).
pub(super) fn float_suffix(w_elem: ElemType) -> &'static str {
    match w_elem {
        ElemType::F32 => "",
        ElemType::BF16 => "_bf16",
        ElemType::F16 => "_f16",
        ElemType::I32 | ElemType::I8 | ElemType::U8 => panic!("integer weights use the block-quantized matmul (matmul_blocks.rs)"),
    }
}

/// Emits the tile `rows x COL_TILE` at row `r0` (an expression) and column `j0`:
/// zero the accumulators, run the k loop, store.
fn tile(
    b: &mut KernelBuilder,
    rows: u64,
    r0: VarId,
    j0: VarId,
    (x, w, out): (ParamId, ParamId, ParamId),
    (k, n): (i64, i64),
    addend: Option<(ParamId, Broadcast)>,
) -> Vec<Stmt> {
    let kk = b.var(ValType::I64);
    let acc: Vec<Vec<VarId>> = (0..rows).map(|_| (0..COL_TILE).map(|_| b.var(ValType::F32)).collect()).collect();
    let mut body = Vec::new();
    for row in &acc {
        for &a in row {
            body.push(set(a, f(0.0)));
        }
    }
    let mut inner = Vec::new();
    for (ri, row) in acc.iter().enumerate() {
        for (ci, &a) in row.iter().enumerate() {
            let xv = ld(x, add(mul(add(v(r0), i(ri as i64)), i(k)), v(kk)));
            let wv = ld(w, add(mul(add(v(j0), i(ci as i64)), i(k)), v(kk)));
            inner.push(set(a, add(v(a), mul(xv, wv))));
        }
    }
    body.push(for_vec(kk, i(0), i(k), inner));
    for (ri, row) in acc.iter().enumerate() {
        for (ci, &a) in row.iter().enumerate() {
            let (row, col) = (add(v(r0), i(ri as i64)), add(v(j0), i(ci as i64)));
            body.push(store(out, add(mul(row.clone(), i(n)), col.clone()), epilogue(v(a), row, col, n, addend)));
        }
    }
    body
}

/// `x: f32[seq, k]`, `w: [n, k]` stored as `w_elem` (f32, bf16 or f16, widened to
/// f32 in registers) -> `out: f32[seq, n]`.
pub fn matmul(k: u64, n: u64, w_elem: ElemType, seq: SeqMode) -> Kernel {
    matmul_impl(k, n, w_elem, seq, None)
}

/// `x @ w^T + r` with `r` broadcast as given (`[seq, n]` residual or `[n]` bias):
/// params `x, w, r, out`.
pub fn matmul_add(k: u64, n: u64, addend: Broadcast, w_elem: ElemType, seq: SeqMode) -> Kernel {
    matmul_impl(k, n, w_elem, seq, Some(addend))
}

fn matmul_impl(k: u64, n: u64, w_elem: ElemType, seq: SeqMode, addend: Option<Broadcast>) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let w = b.param("w", w_elem, false);
    let addend = addend.map(|bc| (b.param("r", ElemType::F32, false), bc));
    let out = b.param("out", ElemType::F32, true);
    let (t, jb, j0, j, rb, r0, kk) =
        (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let acc = b.var(ValType::F32);
    let (ki, ni) = (k as i64, n as i64);
    let bufs = (x, w, out);
    let row_tile = if seq.is_decode() { 1 } else { ROW_TILE };
    // Full tiles: row blocks of `row_tile`, then the leftover rows one at a time.
    let full_rows = tile(&mut b, row_tile, r0, j0, bufs, (ki, ni), addend);
    let tail_row = tile(&mut b, 1, r0, j0, bufs, (ki, ni), addend);
    let full_blocks = div(seq.expr(), i(row_tile as i64));
    let mut tiled = vec![for_(rb, i(0), full_blocks.clone(), {
        let mut v_ = vec![set(r0, mul(v(rb), i(row_tile as i64)))];
        v_.extend(full_rows);
        v_
    })];
    if row_tile > 1 {
        tiled.push(for_(r0, mul(full_blocks, i(row_tile as i64)), seq.expr(), tail_row));
    }
    // Ragged last columns (n not a multiple of the tile): one dot product each.
    let ragged = vec![for_(
        j,
        v(j0),
        min(add(v(j0), i(COL_TILE as i64)), i(ni)),
        vec![for_(
            r0,
            i(0),
            seq.expr(),
            vec![
                set(acc, f(0.0)),
                for_vec(kk, i(0), i(ki), vec![set(acc, add(v(acc), mul(ld(x, add(mul(v(r0), i(ki)), v(kk))), ld(w, add(mul(v(j), i(ki)), v(kk))))))]),
                store(out, add(mul(v(r0), i(ni)), v(j)), epilogue(v(acc), v(r0), v(j), ni, addend)),
            ],
        )],
    )];
    let body = vec![for_(
        jb,
        i(0),
        i((COLS_PER_TASK / COL_TILE) as i64),
        vec![
            set(j0, add(mul(v(t), i(COLS_PER_TASK as i64)), mul(v(jb), i(COL_TILE as i64)))),
            if_(lt(add(v(j0), i(COL_TILE as i64 - 1)), i(ni)), tiled),
            if_(
                Expr::Cmp(CmpOp::Lt, Box::new(v(j0)), Box::new(i(ni))),
                vec![if_(le(i(ni), add(v(j0), i(COL_TILE as i64 - 1))), ragged)],
            ),
        ],
    )];
    let tasks = TaskCount { per_seq: 0, fixed: n.div_ceil(COLS_PER_TASK) };
    let enc = float_suffix(w_elem);
    let name = match addend {
        None => format!("matmul{enc}_k{k}_n{n}_{}", seq.tag()),
        Some((_, bc)) => format!("matmul_add{enc}_{}_k{k}_n{n}_{}", format!("{bc:?}").to_lowercase(), seq.tag()),
    };
    b.finish(name, "matmul", tasks, t, body)
}

/// The GPU form of [`matmul`] / [`matmul_add`] (`addend`): one task per output
/// column instead of [`COLS_PER_TASK`], so a decode GEMV has thousands of
/// thread groups and enough loads in flight for HBM (a task of eight columns
/// left an H100 two blocks per SM: 0.9-1.4 TB/s on the 1.17B shape's smaller
/// projections). The k loop is one reduction per activation row, dealt to the
/// lanes in aligned vector chunks of 4 weights (16 bytes of f32, 8 of bf16 /
/// f16) where k allows; at prefill [`ROW_TILE`] rows share each
/// weight load (the rows past `seq` of the last tile compute a copy of the last
/// row and store nothing). Same parameters and result; tasks
/// [`COLS_PER_TASK`] times the CPU form's, those past `n` idle.
pub fn matmul_rowwise(k: u64, n: u64, w_elem: ElemType, addend: Option<Broadcast>, seq: SeqMode) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let w = b.param("w", w_elem, false);
    let addend = addend.map(|bc| (b.param("r", ElemType::F32, false), bc));
    let out = b.param("out", ElemType::F32, true);
    let (t, kk) = (b.var(ValType::I64), b.var(ValType::I64));
    let ki = k as i64;
    let rows = GpuColumnRows::new(&mut b, seq, ROW_TILE as i64);
    let wv = ld(w, add(v(kk), mul(v(t), i(ki))));
    let step: Vec<Stmt> = rows.acc.iter().zip(&rows.x_row).map(|(&a, &xr)| set(a, add(v(a), mul(ld(x, add(v(kk), mul(v(xr), i(ki)))), wv.clone())))).collect();
    let (body, tasks) = rows.task(t, n, seq, for_vec(kk, i(0), i(ki), step), out, addend);
    let enc = float_suffix(w_elem);
    let name = match addend {
        None => format!("matmul_rows{enc}_k{k}_n{n}_{}", seq.tag()),
        Some((_, bc)) => format!("matmul_add_rows{enc}_{}_k{k}_n{n}_{}", format!("{bc:?}").to_lowercase(), seq.tag()),
    };
    b.finish(name, "matmul", tasks, t, body)
}

/// The task structure the matmuls' GPU forms share ([`matmul_rowwise`],
/// `matmul_blocks::matmul_blocks_rowwise`): task `t` is output column `t`
/// ([`COLS_PER_TASK`] times the CPU form's tasks, those past `n` idle), whose
/// rows go in tiles of `acc.len()` (one at decode). For each tile the caller's
/// dealt loop adds row `r`'s dot product into `acc[r]`, reading activation row
/// `x_row[r]`: the tile's rows clamped to the last one, so the rows past `seq`
/// of the last tile compute a copy of it and store nothing.
pub(super) struct GpuColumnRows {
    pub acc: Vec<VarId>,
    pub x_row: Vec<VarId>,
    tile_index: VarId,
    first_row: VarId,
}

impl GpuColumnRows {
    /// Variables for tiles of `row_tile` rows (one at decode).
    pub(super) fn new(b: &mut KernelBuilder, seq: SeqMode, row_tile: i64) -> GpuColumnRows {
        let rows = if seq.is_decode() { 1 } else { row_tile };
        GpuColumnRows {
            acc: (0..rows).map(|_| b.var(ValType::F32)).collect(),
            x_row: (0..rows).map(|_| b.var(ValType::I64)).collect(),
            tile_index: b.var(ValType::I64),
            first_row: b.var(ValType::I64),
        }
    }

    /// The body of task `t` around `dealt` (zero the accumulators, run it,
    /// store each row's result with `addend`), and the task count.
    pub(super) fn task(&self, t: VarId, n: u64, seq: SeqMode, dealt: Stmt, out: ParamId, addend: Option<(ParamId, Broadcast)>) -> (Vec<Stmt>, TaskCount) {
        let (rows, ni, r0) = (self.acc.len() as i64, n as i64, self.first_row);
        let mut tile = vec![set(r0, mul(v(self.tile_index), i(rows)))];
        for (r, (&a, &xr)) in self.acc.iter().zip(&self.x_row).enumerate() {
            tile.push(set(xr, min(add(v(r0), i(r as i64)), sub(seq.expr(), i(1)))));
            tile.push(set(a, f(0.0)));
        }
        tile.push(dealt);
        for (r, &a) in self.acc.iter().enumerate() {
            let row = add(v(r0), i(r as i64));
            let st = store(out, add(mul(row.clone(), i(ni)), v(t)), epilogue(v(a), row.clone(), v(t), ni, addend));
            tile.push(if r == 0 { st } else { if_(lt(row, seq.expr()), vec![st]) });
        }
        let tiles = div(add(seq.expr(), i(rows - 1)), i(rows));
        let body = vec![if_(lt(v(t), i(ni)), vec![for_(self.tile_index, i(0), tiles, tile)])];
        (body, TaskCount { per_seq: 0, fixed: n.div_ceil(COLS_PER_TASK) * COLS_PER_TASK })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{run, Buffer};
    use crate::library::test_util::*;

    #[test]
    fn the_gpu_form_matches_the_cpu_form() {
        // 6 rows: a row tile and 2 more; 11 columns: a padded last task.
        for (m, seq, addend) in [(6usize, SeqMode::Dynamic, None), (1, SeqMode::Fixed(1), Some(Broadcast::Row)), (3, SeqMode::Dynamic, Some(Broadcast::None))] {
            let (k, n) = (40usize, 11usize);
            let (x, w) = (rand(m * k, 1), rand(n * k, 2));
            let r = rand(if addend == Some(Broadcast::Row) { n } else { m * n }, 4);
            let mut cpu = matmul_buffers(&x, &[Buffer::F32(w.clone())], &r, addend, m * n);
            let mut gpu = cpu.clone();
            let kernel = match addend {
                None => matmul(k as u64, n as u64, ElemType::F32, seq),
                Some(bc) => matmul_add(k as u64, n as u64, bc, ElemType::F32, seq),
            };
            let form = matmul_rowwise(k as u64, n as u64, ElemType::F32, addend, seq);
            assert_eq!(crate::warp::task_split(&kernel.tasks, &form.tasks), Some(COLS_PER_TASK as u32));
            run(&kernel, &mut cpu, m as u64);
            run(&form, &mut gpu, m as u64);
            let (Some(Buffer::F32(want)), Some(Buffer::F32(got))) = (cpu.pop(), gpu.pop()) else { unreachable!() };
            close(&got, &want, 1e-5);
            close(&got, &naive_matmul(&x, &w, &r, (m, k, n), addend), 1e-5);
        }
    }

    #[test]
    fn matches_naive_matmul_with_ragged_rows_and_columns() {
        // 6 rows = one full row tile plus 2 leftover rows; 11 columns = 2 full
        // column tiles plus 3 ragged columns.
        for (m, seq) in [(6usize, SeqMode::Dynamic), (1, SeqMode::Fixed(1)), (3, SeqMode::Dynamic)] {
            let (k, n) = (5usize, 11usize);
            let (x, w) = (rand(m * k, 1), rand(n * k, 2));
            let mut bufs = vec![Buffer::F32(x.clone()), Buffer::F32(w.clone()), Buffer::F32(vec![f32::NAN; m * n])];
            run(&matmul(k as u64, n as u64, ElemType::F32, seq), &mut bufs, m as u64);
            let mut want = vec![0.0; m * n];
            for r in 0..m {
                for j in 0..n {
                    want[r * n + j] = (0..k).map(|q| x[r * k + q] * w[j * k + q]).sum();
                }
            }
            let Buffer::F32(got) = &bufs[2] else { unreachable!() };
            close(got, &want, 1e-6);
        }
    }

    #[test]
    fn epilogue_adds_residual_or_bias() {
        let (m, k, n) = (5usize, 4usize, 9usize);
        let (x, w) = (rand(m * k, 3), rand(n * k, 4));
        for (bc, r) in [(Broadcast::None, rand(m * n, 5)), (Broadcast::Row, rand(n, 6))] {
            let mut bufs = matmul_buffers(&x, &[Buffer::F32(w.clone())], &r, Some(bc), m * n);
            run(&matmul_add(k as u64, n as u64, bc, ElemType::F32, SeqMode::Dynamic), &mut bufs, m as u64);
            let Buffer::F32(got) = &bufs[3] else { unreachable!() };
            close(got, &naive_matmul(&x, &w, &r, (m, k, n), Some(bc)), 1e-5);
        }
    }
}
