//! The kernel-IR reference interpreter: runs a [`Kernel`] on host buffers, with
//! bounds checks, as the oracle the compiled backends are tested against.

use crate::ir::*;

/// A host buffer bound to one kernel parameter.
#[derive(Clone, Debug, PartialEq)]
pub enum Buffer {
    F32(Vec<f32>),
    I32(Vec<i32>),
    BF16(Vec<u16>),
    F16(Vec<u16>),
    I8(Vec<i8>),
    U8(Vec<u8>),
}

impl Buffer {
    /// The base pointer the CPU kernel ABI passes for this buffer.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        match self {
            Buffer::F32(v) => v.as_mut_ptr() as *mut u8,
            Buffer::I32(v) => v.as_mut_ptr() as *mut u8,
            Buffer::BF16(v) | Buffer::F16(v) => v.as_mut_ptr() as *mut u8,
            Buffer::I8(v) => v.as_mut_ptr() as *mut u8,
            Buffer::U8(v) => v.as_mut_ptr(),
        }
    }
}

/// bfloat16 bits to f32 (exact).
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// IEEE half bits to f32 (exact, subnormals included).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((h >> 10) & 0x1f) as i32;
    let frac = (h & 0x3ff) as f32;
    match exp {
        0 => sign * frac * 2f32.powi(-24),
        31 if frac == 0.0 => sign * f32::INFINITY,
        31 => f32::NAN,
        e => sign * (1.0 + frac / 1024.0) * 2f32.powi(e - 15),
    }
}

#[derive(Copy, Clone, Debug)]
enum Val {
    F(f32),
    I(i64),
    B(bool),
}

impl Val {
    fn f(self) -> f32 {
        match self {
            Val::F(x) => x,
            _ => unreachable!("validated kernels are well typed"),
        }
    }
    fn i(self) -> i64 {
        match self {
            Val::I(x) => x,
            _ => unreachable!("validated kernels are well typed"),
        }
    }
}

struct Machine<'a> {
    kernel: &'a Kernel,
    /// Under the GPU's mapping: each loop's mapping, by the loop's address, and
    /// the threads per task.
    warp: Option<(std::collections::HashMap<*const Stmt, crate::warp::LoopMapping>, i64)>,
    bufs: &'a mut [Buffer],
    /// The kernel's local arrays, NaN-filled on entry (their contents are undefined).
    locals: Vec<Buffer>,
    vars: Vec<Val>,
    seq: i64,
}

/// Runs every task of `kernel` for a launch with sequence length `seq`.
pub fn run(kernel: &Kernel, bufs: &mut [Buffer], seq: u64) {
    let tasks = kernel.tasks.eval(seq);
    run_tasks(kernel, bufs, seq, 0, tasks);
}

/// Runs every task as the GPU does (`crate::warp`): loops dealt to lanes run
/// lane by lane in the mapping's chunks, and their reductions are combined with
/// the butterfly the warp shuffles perform, then across warps in warp order. The
/// reference for the NVPTX lowering's mapping.
pub fn run_warp(kernel: &Kernel, bufs: &mut [Buffer], seq: u64) {
    let mut loops = Vec::new();
    collect_loops(&kernel.body, &mut loops);
    let mapping = crate::warp::gpu_mapping(kernel);
    let warp = loops.into_iter().zip(mapping.loops).collect();
    run_impl(kernel, bufs, seq, 0, kernel.tasks.eval(seq), Some((warp, mapping.threads.max(1) as i64)));
}

fn collect_loops(stmts: &[Stmt], out: &mut Vec<*const Stmt>) {
    for s in stmts {
        match s {
            Stmt::For { body, .. } => {
                out.push(s as *const Stmt);
                collect_loops(body, out);
            }
            Stmt::If { then, .. } => collect_loops(then, out),
            Stmt::Set { .. } | Stmt::Store { .. } | Stmt::DotBlock { .. } | Stmt::DotRows(_) | Stmt::PairDot { .. } | Stmt::WidenBf16 { .. } | Stmt::Prefetch { .. } => {}
        }
    }
}

/// Runs tasks `begin..end` (the ABI's task range).
pub fn run_tasks(kernel: &Kernel, bufs: &mut [Buffer], seq: u64, begin: u64, end: u64) {
    run_impl(kernel, bufs, seq, begin, end, None);
}

type WarpMapping = (std::collections::HashMap<*const Stmt, crate::warp::LoopMapping>, i64);

fn run_impl(kernel: &Kernel, bufs: &mut [Buffer], seq: u64, begin: u64, end: u64, warp: Option<WarpMapping>) {
    assert_eq!(bufs.len(), kernel.params.len(), "kernel `{}`: buffer count", kernel.name);
    let vars = kernel
        .vars
        .iter()
        .map(|t| match t {
            ValType::F32 => Val::F(0.0),
            ValType::I64 => Val::I(0),
            ValType::Bool => Val::B(false),
        })
        .collect();
    let locals = kernel.locals.iter().map(|&n| Buffer::F32(vec![f32::NAN; n as usize])).collect();
    let mut m = Machine { kernel, warp, bufs, locals, vars, seq: seq as i64 };
    for t in begin..end {
        m.vars[kernel.task_var as usize] = Val::I(t as i64);
        m.block(&kernel.body);
    }
}

impl Machine<'_> {
    /// Byte `at` of byte parameter `param`, as a signed (I8) or unsigned (U8) number.
    fn byte(&self, param: ParamId, at: i64) -> i64 {
        let (value, len) = match &self.bufs[param.index()] {
            Buffer::I8(b) => (b.get(at as usize).map(|&x| x as i64), b.len()),
            Buffer::U8(b) => (b.get(at as usize).map(|&x| x as i64), b.len()),
            _ => unreachable!("dot operands are bytes (validated)"),
        };
        value.unwrap_or_else(|| panic!("kernel `{}`: dot reads byte {at} of {len} bytes", self.kernel.name))
    }

    fn block(&mut self, stmts: &[Stmt]) {
        for s in stmts {
            match s {
                Stmt::Set { var, value } => {
                    let v = self.eval(value);
                    self.vars[*var as usize] = v;
                }
                Stmt::Store { buf, index, value } => {
                    let idx = self.eval(index).i();
                    let v = self.eval(value);
                    let (kernel, at) = (self.kernel, idx as usize);
                    let target = match *buf {
                        Buf::Local(l) => &mut self.locals[l.index()],
                        Buf::Param(p) => &mut self.bufs[p.index()],
                    };
                    // The name is looked up for the message only: stores and
                    // loads are most of what the interpreter does.
                    let oob = |len: usize| -> ! { panic!("kernel `{}`: store {}[{idx}] out of bounds ({len})", kernel.name, kernel.buffer(*buf).expect("validated").name) };
                    match target {
                        Buffer::F32(b) => {
                            let len = b.len();
                            *b.get_mut(at).unwrap_or_else(|| oob(len)) = v.f()
                        }
                        Buffer::I32(b) => {
                            let len = b.len();
                            *b.get_mut(at).unwrap_or_else(|| oob(len)) = v.i() as i32
                        }
                        Buffer::I8(b) => {
                            let len = b.len();
                            *b.get_mut(at).unwrap_or_else(|| oob(len)) = v.i() as i8
                        }
                        Buffer::F16(b) => {
                            let len = b.len();
                            *b.get_mut(at).unwrap_or_else(|| oob(len)) = half::f16::from_f32(v.f()).to_bits()
                        }
                        // Round to nearest even; a NaN stays a (quiet) NaN.
                        Buffer::BF16(b) => {
                            let len = b.len();
                            *b.get_mut(at).unwrap_or_else(|| oob(len)) = half::bf16::from_f32(v.f()).to_bits()
                        }
                        Buffer::U8(_) => {
                            unreachable!("weight-only parameters are never stored (validated)")
                        }
                    }
                }
                Stmt::For { var, start, end, body, .. } => {
                    let (lo, hi) = (self.eval(start).i(), self.eval(end).i());
                    let mapping = self.warp.as_ref().and_then(|(w, threads)| w.get(&(s as *const Stmt)).map(|m| (m.clone(), *threads)));
                    match mapping {
                        Some((crate::warp::LoopMapping::Lanes { reductions, chunk, .. }, threads)) => self.lanes(*var, (lo, hi), body, &reductions, chunk, threads),
                        _ => {
                            for x in lo..hi {
                                self.vars[*var as usize] = Val::I(x);
                                self.block(body);
                            }
                        }
                    }
                }
                // A hint: nothing to compute (and its index may lie past the buffer).
                Stmt::Prefetch { .. } => {}
                Stmt::If { cond, then } => {
                    if let Val::B(true) = self.eval(cond) {
                        self.block(then);
                    }
                }
                Stmt::DotBlock { acc, scales, weights, w_start, form, act, act_start } => {
                    let scales = [self.eval(&scales[0]).f(), self.eval(&scales[1]).f()];
                    let (w0, a0) = (self.eval(w_start).i(), self.eval(act_start).i());
                    let w = |i: i64| self.byte(*weights, w0 + i);
                    let sums: [f32; DOT_LANES as usize] = std::array::from_fn(|g| {
                        let g = g as i64;
                        let dot: i64 = (4 * g..4 * g + 4).map(|i| form.level(&w, i) * self.byte(*act, a0 + i)).sum();
                        scales[form.block_of_lane(g)] * dot as f32
                    });
                    let Buffer::F32(a) = &mut self.locals[acc.index()] else { unreachable!("locals are f32") };
                    for (g, x) in sums.into_iter().enumerate() {
                        a[g] += x;
                    }
                }
                Stmt::PairDot { acc, weights, w_start, act, act_start } => {
                    let (w0, a0) = (self.eval(w_start).i(), self.eval(act_start).i());
                    let (x0, x1) = (self.load(*act, a0).f(), self.load(*act, a0 + 1).f());
                    let w: [(f32, f32); DOT_LANES as usize] = std::array::from_fn(|l| (self.load(*weights, w0 + l as i64).f(), self.load(*weights, w0 + DOT_LANES + l as i64).f()));
                    let Buffer::F32(a) = &mut self.locals[acc.index()] else { unreachable!("locals are f32") };
                    for (l, (w0, w1)) in w.into_iter().enumerate() {
                        a[l] = x1.mul_add(w1, x0.mul_add(w0, a[l]));
                    }
                }
                Stmt::WidenBf16 { dst, weights, start } => {
                    let w0 = self.eval(start).i();
                    let w: [f32; DOT_LANES as usize] = std::array::from_fn(|l| self.load(*weights, w0 + l as i64).f());
                    let Buffer::F32(d) = &mut self.locals[dst.index()] else { unreachable!("locals are f32") };
                    d[..w.len()].copy_from_slice(&w);
                }
                Stmt::DotRows(d) => {
                    let (w0, a0) = (self.eval(&d.w_start).i(), self.eval(&d.act_start).i());
                    let low = match &d.act_levels {
                        ActLevels::Planes { low } => Some(self.eval(low).i()),
                        _ => None,
                    };
                    let act = |t: i64| match (&d.act_levels, low) {
                        (ActLevels::Planes { .. }, Some(l0)) => HIGH_PLANE_WEIGHT * self.byte(d.act, a0 + t) + self.byte(d.act, l0 + t),
                        // Little-endian: the low byte unsigned, the high one signed.
                        (ActLevels::Words | ActLevels::WordPairs, _) => {
                            let p = if d.act_levels == ActLevels::WordPairs { word_pair_position(t) } else { t };
                            256 * self.byte(d.act, a0 + 2 * p + 1) + (self.byte(d.act, a0 + 2 * p) as u8) as i64
                        }
                        _ => self.byte(d.act, a0 + t),
                    };
                    let (scale, sum) = (self.eval(&d.act_scales[0]).f(), self.eval(&d.act_scales[1]).f());
                    let w = |at: i64| self.byte(d.weights, w0 + at);
                    let high_start = d.high_bits.as_ref().map(|(p, start)| (*p, self.eval(start).i()));
                    let high = |at: i64| {
                        let (p, h0) = high_start.expect("the verifier gives these forms their high bits");
                        self.byte(p, h0 + at)
                    };
                    // Row g's value, times its factor for half `h` (bytes read
                    // as their element type: u8 unsigned, i8 signed).
                    let per_row_half = |r: &RowScale, g: i64, h: i64| -> f32 {
                        let value = self.load(r.values.0, self.eval(&r.values.1).i() + g).f();
                        match &r.factors {
                            None => value,
                            Some((p, start)) => value * self.byte(*p, self.eval(start).i() + 16 * h + g) as f32,
                        }
                    };
                    let per_row = |r: &RowScale, g: i64| per_row_half(r, g, 0);
                    let halves = d.form.halves();
                    let per_half = RowsForm::VALUES / halves;
                    // An integer offset is applied to the levels, exactly (equal
                    // to the `offset * S * act_scales[1]` term under RowDot's
                    // contract on the activation sums, without the cancellation
                    // of two large float terms); with two halves, through the
                    // halves' activation sums.
                    let level_offset = match d.row_min {
                        RowMin::Offset(o) if o.fract() == 0.0 => Some(o as i64),
                        _ => None,
                    };
                    // A half's activation sum (0 without them: the offset is per level then).
                    let half_sum = |h: i64| match &d.half_sums {
                        Some((p, start)) => self.load(*p, self.eval(start).i() + h).i(),
                        None => 0,
                    };
                    let per_level_offset = if d.half_sums.is_some() { 0 } else { level_offset.unwrap_or(0) };
                    let terms: [f32; DOT_LANES as usize] = std::array::from_fn(|g| {
                        let g = g as i64;
                        let row_scale = per_row(&d.row_scales, g);
                        let half_dot = |h: i64| {
                            let dot: i64 = (h * per_half..(h + 1) * per_half).map(|t| (d.form.level(&w, &high, g, t) + per_level_offset) * act(t)).sum();
                            (dot + level_offset.unwrap_or(0) * half_sum(h)) as f32
                        };
                        if level_offset.is_some() {
                            return (0..halves).map(|h| per_row_half(&d.row_scales, g, h) * scale * half_dot(h)).sum();
                        }
                        let dot = half_dot(0);
                        let min = match &d.row_min {
                            RowMin::Offset(o) => o * row_scale,
                            RowMin::Stored(m) => per_row(m, g),
                            RowMin::Subtracted(m) => -per_row(m, g),
                        };
                        row_scale * scale * dot + min * sum
                    });
                    let Buffer::F32(a) = &mut self.locals[d.acc.index()] else { unreachable!("locals are f32") };
                    for (g, x) in terms.into_iter().enumerate() {
                        a[g] += x;
                    }
                }
            }
        }
    }

    /// A loop dealt to the `threads` lanes of a task: lane `l` runs chunks `l, l +
    /// threads, ...` of `chunk` consecutive iterations, then the leftover
    /// iteration `l` if there is one, with its own partial of each reduction.
    /// The partials are combined per warp by a butterfly (lane `l` takes
    /// `op(x_l, x_{l ^ m})` for m = 16, 8, 4, 2, 1), the warps' totals in warp
    /// order, and the result joins the value the variable had before the loop.
    fn lanes(&mut self, var: VarId, (lo, hi): (i64, i64), body: &[Stmt], reductions: &[(VarId, BinOp)], chunk: i64, threads: i64) {
        use crate::warp::{identity, WARP};
        let before: Vec<f32> = reductions.iter().map(|(r, _)| self.vars[*r as usize].f()).collect();
        let mut partial: Vec<Vec<f32>> = reductions.iter().map(|(_, op)| vec![identity(*op); threads as usize]).collect();
        let (whole, left) = ((hi - lo).max(0) / chunk, (hi - lo).max(0) % chunk);
        for lane in 0..threads {
            for (k, (r, _)) in reductions.iter().enumerate() {
                self.vars[*r as usize] = Val::F(partial[k][lane as usize]);
            }
            let mut c = lane;
            while c < whole {
                for u in 0..chunk {
                    self.vars[var as usize] = Val::I(lo + c * chunk + u);
                    self.block(body);
                }
                c += threads;
            }
            if lane < left {
                self.vars[var as usize] = Val::I(lo + whole * chunk + lane);
                self.block(body);
            }
            for (k, (r, _)) in reductions.iter().enumerate() {
                partial[k][lane as usize] = self.vars[*r as usize].f();
            }
        }
        let combine = |op: BinOp, a: f32, b: f32| if op == BinOp::Max { a.max(b) } else { a + b };
        for (k, (r, op)) in reductions.iter().enumerate() {
            let mut warp_totals = Vec::new();
            for warp in partial[k].chunks(WARP as usize) {
                let mut vals = warp.to_vec();
                let mut m = WARP as usize / 2;
                while m > 0 {
                    vals = (0..WARP as usize).map(|l| combine(*op, vals[l], vals[l ^ m])).collect();
                    m /= 2;
                }
                warp_totals.push(vals[0]);
            }
            let total = warp_totals[1..].iter().fold(warp_totals[0], |a, &b| combine(*op, a, b));
            self.vars[*r as usize] = Val::F(combine(*op, before[k], total));
        }
    }

    /// Element `index` of buffer `param` (bounds-checked like a load).
    fn load(&self, param: ParamId, index: i64) -> Val {
        self.load_from(Buf::Param(param), index)
    }

    /// Element `idx` of `buf`, widened to its value type; out of bounds it
    /// panics with the kernel's and the buffer's names (looked up only then).
    fn load_from(&self, buf: Buf, idx: i64) -> Val {
        let oob = |len: usize| -> ! { panic!("kernel `{}`: load {}[{idx}] out of bounds ({len})", self.kernel.name, self.kernel.buffer(buf).expect("validated").name) };
        let source = match buf {
            Buf::Local(l) => &self.locals[l.index()],
            Buf::Param(p) => &self.bufs[p.index()],
        };
        let at = idx as usize;
        match source {
            Buffer::F32(b) => Val::F(*b.get(at).unwrap_or_else(|| oob(b.len()))),
            Buffer::I32(b) => Val::I(*b.get(at).unwrap_or_else(|| oob(b.len())) as i64),
            Buffer::BF16(b) => Val::F(bf16_to_f32(*b.get(at).unwrap_or_else(|| oob(b.len())))),
            Buffer::F16(b) => Val::F(f16_to_f32(*b.get(at).unwrap_or_else(|| oob(b.len())))),
            Buffer::I8(b) => Val::I(*b.get(at).unwrap_or_else(|| oob(b.len())) as i64),
            Buffer::U8(b) => Val::I(*b.get(at).unwrap_or_else(|| oob(b.len())) as i64),
        }
    }

    fn eval(&self, e: &Expr) -> Val {
        match e {
            Expr::F32(x) => Val::F(*x),
            Expr::I64(x) => Val::I(*x),
            Expr::Var(v) => self.vars[*v as usize],
            Expr::Seq => Val::I(self.seq),
            Expr::Load { buf, index } => self.load_from(*buf, self.eval(index).i()),
            Expr::Bin(op, a, b) => match (self.eval(a), self.eval(b)) {
                (Val::F(x), Val::F(y)) => Val::F(match op {
                    BinOp::Add => x + y,
                    BinOp::Sub => x - y,
                    BinOp::Mul => x * y,
                    BinOp::Div => x / y,
                    BinOp::Max => x.max(y),
                    BinOp::Min => x.min(y),
                    BinOp::Rem | BinOp::Shl | BinOp::Shr | BinOp::And => unreachable!("integer-only (validated)"),
                }),
                (Val::I(x), Val::I(y)) => Val::I(match op {
                    BinOp::Add => x + y,
                    BinOp::Sub => x - y,
                    BinOp::Mul => x * y,
                    BinOp::Div => x / y,
                    BinOp::Rem => x % y,
                    BinOp::Shl => x << y,
                    BinOp::Shr => ((x as u64) >> y) as i64,
                    BinOp::And => x & y,
                    BinOp::Max => x.max(y),
                    BinOp::Min => x.min(y),
                }),
                _ => unreachable!("validated kernels are well typed"),
            },
            Expr::Cmp(op, a, b) => {
                let (x, y) = (self.eval(a), self.eval(b));
                Val::B(match (x, y) {
                    (Val::F(x), Val::F(y)) => match op {
                        CmpOp::Lt => x < y,
                        CmpOp::Le => x <= y,
                        CmpOp::Eq => x == y,
                    },
                    (Val::I(x), Val::I(y)) => match op {
                        CmpOp::Lt => x < y,
                        CmpOp::Le => x <= y,
                        CmpOp::Eq => x == y,
                    },
                    _ => unreachable!("validated kernels are well typed"),
                })
            }
            Expr::Un(op, a) => {
                let x = self.eval(a);
                match op {
                    UnOp::ToF32 => Val::F(x.i() as f32),
                    UnOp::Floor => Val::F(x.f().floor()),
                    UnOp::ToI64 => Val::I(x.f() as i64),
                    UnOp::BitsToF32 => Val::F(f32::from_bits(x.i() as u32)),
                    UnOp::HalfBitsToF32 => Val::F(half::f16::from_bits(x.i() as u16).to_f32()),
                    UnOp::Neg => match x {
                        Val::F(f) => Val::F(-f),
                        Val::I(i) => Val::I(-i),
                        Val::B(_) => unreachable!(),
                    },
                    UnOp::Exp => Val::F(x.f().exp()),
                    UnOp::Sqrt => Val::F(x.f().sqrt()),
                    UnOp::Tanh => Val::F(x.f().tanh()),
                    UnOp::Cos => Val::F(x.f().cos()),
                    UnOp::Sin => Val::F(x.f().sin()),
                }
            }
            Expr::MulAdd(a, b, c) => Val::F(self.eval(a).f().mul_add(self.eval(b).f(), self.eval(c).f())),
            Expr::Select(c, a, b) => match self.eval(c) {
                Val::B(true) => self.eval(a),
                _ => self.eval(b),
            },
        }
    }
}
